"""A tree of switches: the topology file, a job's tree, and a 64-worker job through three switch pipelines.

The last tests program three software-target pipelines (a root and two leaves) with exactly the entries
``controller.topology`` computes, written as P4Runtime updates, and carry every frame between them as the
links would, losing some on the links between switches. Every worker must get the exact sum of all 64.
"""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest
from p4.v1 import p4runtime_pb2 as p4rt

from netagg import dataplane as dp
from netagg import wire
from netagg.controller.p4rt_entities import EntityBuilder, multicast_group_entity
from netagg.controller.topology import Allocation, TreeWorker, fabric_state, parse_topology, plan_tree, tree_state
from netagg.jobconfig import ConfigError
from netagg.p4info import P4InfoIndex
from netagg.softswitch.forwarding_state import ForwardingState
from netagg.softswitch.pipeline import NetaggPipeline


def _topology(workers_per_leaf: int = 32, leaves: int = 2, levels: int = 2) -> dict:
    """``leaves`` racks of ``workers_per_leaf`` hosts (ports 1..), each leaf's up port 60 to a parent port
    40 + i; with three levels, the leaves hang off two spines under the root."""
    switches: dict = {"root": {"grpc_address": "unix:/run/root.sock", "device_id": 1,
                               "aggregator": {"ip": "10.90.0.254", "mac": "02:00:00:90:00:fe"}}}
    if levels == 3:
        for s in range(2):
            switches[f"spine{s}"] = {"grpc_address": f"unix:/run/spine{s}.sock",
                                     "aggregator": {"ip": f"10.80.{s}.254", "mac": f"02:00:00:80:{s:02x}:fe"},
                                     "parent": {"switch": "root", "up_port": 60, "port": 40 + s}}
    hosts = []
    for i in range(leaves):
        parent = f"spine{i % 2}" if levels == 3 else "root"
        switches[f"leaf{i}"] = {"grpc_address": f"127.0.0.1:{9600 + i}",
                                "aggregator": {"ip": f"10.91.{i}.254", "mac": f"02:00:00:91:{i:02x}:fe"},
                                "parent": {"switch": parent, "up_port": 60, "port": 40 + i // (2 if levels == 3
                                                                                             else 1)}}
        hosts += [{"name": f"h{i}-{j}", "switch": f"leaf{i}", "port": 1 + j, "ip": f"10.91.{i}.{1 + j}",
                   "mac": f"02:00:00:91:{i:02x}:{j + 1:02x}"} for j in range(workers_per_leaf)]
    return {"switches": switches, "hosts": hosts}


def _workers(topology, hosts: list[str]) -> list[TreeWorker]:
    return [TreeWorker(rank, host, 41000 + rank) for rank, host in enumerate(hosts)]


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(extra=1), "extra: unknown key"),
    (lambda d: d["switches"]["leaf0"].pop("parent"), "exactly one root"),
    (lambda d: d["switches"]["root"].update(parent={"switch": "leaf0", "up_port": 7, "port": 8}), "cycle"),
    (lambda d: d["switches"]["leaf0"]["parent"].update(switch="nowhere"), "unknown switch 'nowhere'"),
    (lambda d: d["switches"]["leaf0"]["parent"].update(up_port=1), "already"),
    (lambda d: d["switches"]["leaf1"]["parent"].update(port=40), "already"),
    (lambda d: d["hosts"][1].update(ip="10.91.0.1"), "address 10.91.0.1 is already"),
    (lambda d: d["hosts"][0].update(mac="nope"), "not a MAC"),
    (lambda d: d["hosts"][0].update(switch="leaf9"), "unknown switch 'leaf9'"),
    (lambda d: d["switches"]["leaf0"]["aggregator"].update(ip="300.1.1.1"), "not an IPv4 address"),
    (lambda d: d["switches"]["leaf0"].update(grpc_address="nowhere"), "not host:port"),
    (lambda d: d["hosts"][0].update(port=511), "switch port"),
    (lambda d: d["switches"]["leaf1"].update(grpc_address="127.0.0.1:9600"), "is already switch 'leaf0'"),
    (lambda d: d["hosts"][1].update(mac="02:00:00:91:00:fe"), "MAC 02:00:00:91:00:fe is already"),
])
def test_a_wrong_topology_is_refused_naming_the_key(change, message):
    data = _topology(workers_per_leaf=2)
    change(data)
    with pytest.raises(ConfigError, match=message):
        parse_topology(data, "topology.yaml")


def test_a_job_in_one_rack_is_one_segment_without_links():
    topo = parse_topology(_topology(4), "t")
    plan = plan_tree(topo, _workers(topo, ["h1-2", "h1-0"]))
    assert plan.root == "leaf1" and list(plan.segments) == ["leaf1"]
    assert [(m.local_rank, m.rank, m.host) for m in plan.segments["leaf1"].members] == [(0, 0, "h1-2"), (1, 1, "h1-0")]
    states = tree_state(topo, plan, {"leaf1": Allocation(3, 0, 8, 77)}, _workers(topo, ["h1-2", "h1-0"]))
    tables = {e.table for e in states["leaf1"].entries.values()}
    assert dp.TABLE_UP_LINKS not in tables and dp.TABLE_DOWN_LINKS not in tables


def test_a_job_across_racks_is_a_tree_up_to_the_lowest_shared_switch():
    topo = parse_topology(_topology(3, leaves=4, levels=3), "t")
    # leaves 0 and 2 hang off spine0: the tree stops there.
    plan = plan_tree(topo, _workers(topo, ["h0-0", "h2-1", "h0-2"]))
    assert plan.root == "spine0" and set(plan.segments) == {"spine0", "leaf0", "leaf2"}
    assert [m.switch for m in plan.segments["spine0"].members] == ["leaf0", "leaf2"]
    assert plan.rank_at_parent("leaf2") == 1
    # leaves 0 and 1 are under different spines: three levels.
    workers = _workers(topo, ["h0-0", "h1-0", "h1-1"])
    plan = plan_tree(topo, workers)
    assert next(iter(plan.segments)) == "root"
    assert set(plan.segments) == {"root", "spine0", "spine1", "leaf0", "leaf1"}
    allocations = {s: Allocation(10 + i, 100 * i, 4, 500 + i) for i, s in enumerate(plan.segments)}
    states = tree_state(topo, plan, allocations, workers)
    up = next(e for e in states["leaf1"].entries.values() if e.table == dp.TABLE_UP_LINKS)
    assert dict(up.params) == {"port": 60, "parent_job": allocations["spine1"].job_id, "parent_rank": 0,
                               "parent_mac": 0x0200008001FE, "parent_addr": int.from_bytes(
                                   socket.inet_aton("10.80.1.254"), "big")}
    child = next(e for e in states["spine1"].entries.values() if e.table == dp.TABLE_WORKERS)
    assert dict(child.match)["udp_src"] == wire.NETAGG_TREE_UDP_PORT and dict(child.match)["ingress_port"] == 40


def test_a_segment_of_more_than_32_members_needs_another_level():
    topo = parse_topology(_topology(33, leaves=1), "t")
    with pytest.raises(ConfigError, match=r"33 members.*add a level"):
        plan_tree(topo, _workers(topo, [f"h0-{j}" for j in range(33)]))
    with pytest.raises(ConfigError, match="rank is used twice"):
        plan_tree(topo, [TreeWorker(0, "h0-0", 1), TreeWorker(0, "h0-1", 2)])
    with pytest.raises(ConfigError, match="unknown host"):
        plan_tree(topo, [TreeWorker(0, "nobody", 1)])


# --------------------------------------------------------------------------- three switches, 64 workers

def _frame(src_mac: str, dst_mac: str, src: str, dst: str, sport: int, payload: bytes) -> bytes:
    udp = struct.pack("!HHHH", sport, wire.NETAGG_UDP_PORT, 8 + len(payload), 0) + payload
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0x4000, 64, 17, 0,
                               socket.inet_aton(src), socket.inet_aton(dst)))
    ip[10:12] = wire.ipv4_checksum(bytes(ip)).to_bytes(2, "big")
    return bytes.fromhex(dst_mac.replace(":", "")) + bytes.fromhex(src_mac.replace(":", "")) + b"\x08\x00" + \
        bytes(ip) + udp


class Fabric:
    """Pipelines for every switch of a topology, programmed with ``fabric_state`` and a job's ``tree_state``
    as P4Runtime updates, and the wires between them (with loss on the links between switches)."""

    def __init__(self, topo, engine: str) -> None:
        index = P4InfoIndex.from_file(dp.P4INFO_PATH)
        builder = EntityBuilder(index)
        self.topo = topo
        self.pipes = {}
        for name in topo.switches:
            state = ForwardingState(index)
            state.configured = True
            if engine == "fast":
                from netagg.softswitch.fastpath import FastPipeline, unavailable
                if unavailable():
                    pytest.skip(f"compiled engine unavailable: {unavailable()}")
                self.pipes[name] = FastPipeline(state, index.p4info)
            else:
                self.pipes[name] = NetaggPipeline(state, index.p4info)
        self.builder = builder
        for name, desired in fabric_state(topo).items():
            self.install(name, desired)
        # (switch, port) -> (switch, port) on the other end of each link between switches.
        self.links = {}
        for s in topo.switches.values():
            if s.parent is not None:
                self.links[(s.name, s.up_port)] = (s.parent, s.parent_port)
                self.links[(s.parent, s.parent_port)] = (s.name, s.up_port)

    def install(self, name: str, desired) -> None:
        state = self.pipes[name].state
        for entry in desired.entries.values():
            update = p4rt.Update(type=p4rt.Update.INSERT, entity=p4rt.Entity(table_entry=self.builder.table_entry(
                entry.table, dict(entry.match), entry.action, dict(entry.params))))
            with state.lock:
                state.apply_update(update)
        for gid, replicas in desired.groups.items():
            with state.lock:
                state.apply_update(p4rt.Update(type=p4rt.Update.INSERT,
                                               entity=multicast_group_entity(gid, list(replicas))))

    def deliver(self, frames: list[tuple[str, int, bytes]], rng, link_loss: float) -> list[tuple[str, int, bytes]]:
        """Run frames through the fabric until none is in flight; returns what left on host ports."""
        out = []
        while frames:
            switch, port, frame = frames.pop(0)
            for egress, emitted in self.pipes[switch].process(frame, port):
                peer = self.links.get((switch, egress))
                if peer is None:
                    out.append((switch, egress, emitted))
                elif rng.random() >= link_loss:
                    frames.append((*peer, emitted))
        return out


def _send(topo, plan, allocations, w: TreeWorker, values: np.ndarray, exponent: int, fields: dict,
          flags: int = 0) -> tuple[str, int, bytes]:
    """Worker ``w``'s packet into its leaf's port: its leaf segment's job id and its rank there."""
    host = topo.hosts[w.host]
    leaf = topo.switches[host.switch]
    _, rank = plan.leaf_of(w.rank)
    header = wire.Header(job_id=allocations[leaf.name].job_id, rank=rank, exponent=exponent, flags=flags, **fields)
    return (leaf.name, host.port, _frame(host.mac, leaf.aggregator_mac, host.ip, leaf.aggregator_ip, w.udp_port,
                                         wire.pack(header, values)))


@pytest.mark.parametrize("engine", ["reference", "fast"])
def test_64_workers_in_two_racks_get_the_exact_sum_through_three_switches(engine):
    rng = np.random.default_rng(7)
    topo = parse_topology(_topology(32, leaves=2), "t")
    hosts = [f"h{i}-{j}" for i in range(2) for j in range(32)]
    workers = _workers(topo, hosts)
    plan = plan_tree(topo, workers)
    assert plan.root == "root" and len(plan.segments["root"].members) == 2
    fabric = Fabric(topo, engine)
    allocations = {"root": Allocation(7, 64, 8, 1001), "leaf0": Allocation(3, 0, 8, 1002),
                   "leaf1": Allocation(9, 16, 8, 1003)}
    for name, desired in tree_state(topo, plan, allocations, workers).items():
        fabric.install(name, desired)
    leaf_job = {w.rank: allocations[topo.hosts[w.host].switch].job_id for w in workers}
    for round_ in range(1, 5):
        slot, pool = round_ % 3, round_ % 2
        values = {w.rank: rng.integers(-2**22, 2**22, wire.K).astype(np.int32) for w in workers}
        exps = {w.rank: int(rng.integers(-20, 20)) for w in workers}
        total = np.sum([v.astype(np.int64) for v in values.values()], axis=0).astype(np.int32)
        got: dict[int, tuple] = {}
        header = {"slot": slot, "pool": pool, "round": round_, "seq": round_}
        frames = [_send(topo, plan, allocations, w, values[w.rank], exps[w.rank], header)
                  for w in workers if rng.random() > 0.05]  # 5 % of first packets lost
        resent = set()
        for _attempt in range(20):
            for _switch, _port, frame in fabric.deliver(frames, rng, link_loss=0.3):
                header, vals = wire.unpack(frame[42:])
                dst = socket.inet_ntoa(frame[30:34])
                rank = next(w.rank for w in workers if topo.hosts[w.host].ip == dst)
                assert header.flags & wire.FLAG_RESULT and header.job_id == leaf_job[rank]
                got[rank] = (header.exponent, vals.copy(), header.round)
            missing = [w for w in workers if w.rank not in got]
            if not missing:
                break
            resent.update(w.rank for w in missing)
            frames = [_send(topo, plan, allocations, w, values[w.rank], exps[w.rank], header, wire.FLAG_RETRANSMIT)
                      for w in missing]  # their timeouts fire
        assert len(got) == 64, f"round {round_}: {64 - len(got)} workers never got the result"
        for rank, (exponent, vals, r) in got.items():
            assert exponent == max(exps.values()) and r == round_
            np.testing.assert_array_equal(vals, total, err_msg=f"worker {rank}, round {round_}")
        assert resent  # the lossy links made workers resend, and the tree recovered
    # Each level summed each of its members once per round: 4 rounds at each switch.
    for name in allocations:
        assert fabric.pipes[name].state.counter_total(dp.COUNTER_JOB_RESULTS) == 4, name


def test_the_cli_checks_the_committed_topology_and_plans_a_job(capsys):
    from netagg.controller.cli import main

    path = dp.REPO_ROOT / "configs" / "topology.yaml"
    assert main(["topology", "check", str(path)]) == 0
    assert "3 switch(es), 4 host(s)" in capsys.readouterr().out
    assert main(["topology", "plan", str(path), "--hosts", "r0h0,r1h0,r0h1"]) == 0
    out = capsys.readouterr().out
    assert "root root" in out and "rack1, rank 1 in root: 0=rank 1 (r1h0)" in out
    assert main(["topology", "plan", str(path), "--hosts", "r0h0,nobody"]) == 2
    assert "unknown host 'nobody'" in capsys.readouterr().err


def test_a_tree_takes_the_same_slots_on_every_switch_or_none():
    from netagg.controller.allocator import FabricAllocator, SlotRange

    fabric = FabricAllocator({"root": 64, "rack0": 64, "rack1": 64})
    fabric.allocators["rack1"].allocate(40)  # another job's
    got = fabric.allocate(["root", "rack0", "rack1"], want=32, minimum=8)
    assert {s: r.count for s, r in got.items()} == {"root": 24, "rack0": 24, "rack1": 24}  # what all of them have
    free = {s: a.free_slots for s, a in fabric.allocators.items()}
    assert fabric.allocate(["root", "rack0", "rack1"], want=16) is None  # rack1 is full: nothing taken anywhere
    assert {s: a.free_slots for s, a in fabric.allocators.items()} == free
    fabric.release(got)
    assert fabric.allocators["root"].free_ranges == (SlotRange(0, 64),)
    with pytest.raises(ValueError, match="unknown switch"):
        fabric.allocate(["root", "nowhere"], want=4)
