"""The software target over several cores (softswitch/shards.py): exact sums, counters summed over shards,
writes that wait for every shard, frames that reach the wrong shard, and a shard that dies."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import numpy as np
import pytest
from p4.v1 import p4runtime_pb2 as p4rt

from netagg import dataplane as dp
from netagg import udpgso, wire
from netagg.jobconfig import Endpoint
from netagg.localports import free_ports
from netagg.softswitch import fastpath
from netagg.testing.hoststack import LossyRelay, block_scaled_inputs, expected_allreduce, run_workers

if fastpath.unavailable():
    pytest.skip(f"compiled engine unavailable: {fastpath.unavailable()}", allow_module_level=True)

from netagg.softswitch import shards as shards_mod
from netagg.testing import softswitch as testing

N = 4


def _inputs(size: int, seed: int) -> list[np.ndarray]:
    return block_scaled_inputs(N, size, seed, decades=10)


def test_two_tenants_through_three_shards_get_exact_sums_and_every_shard_aggregates():
    a_in, b_in = _inputs(50_000, 1), _inputs(30_000, 2)
    (a_want, _), (b_want, _) = expected_allreduce(a_in), expected_allreduce(b_in)
    results: dict[str, list] = {}
    with testing.LoopbackSwitch(shards=3) as switch:
        sharded = switch.target.switch
        assert isinstance(sharded, shards_mod.ShardedSwitch) and switch.target.shards == 3
        a = switch.add_job(N, slot_count=256)  # 4 steering blocks
        b = switch.add_job(N, slot_count=96)

        def tenant(name, configs, inputs):
            results[name] = run_workers(configs, lambda w, rank: [w.allreduce(inputs[rank]) for _ in range(2)][-1])

        threads = [threading.Thread(target=tenant, args=("a", a, a_in)),
                   threading.Thread(target=tenant, args=("b", b, b_in))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        counters_a = switch.counters(a[0].job_id)
        counters_b = switch.counters(b[0].job_id)
        per_shard = [shard.stats.received for shard in sharded.shards]
        assert sharded.foreign_frames == 0  # hosts cut segmented sends at block boundaries
    for got in results["a"]:
        np.testing.assert_array_equal(got, a_want)
    for got in results["b"]:
        np.testing.assert_array_equal(got, b_want)
    assert all(count > 0 for count in per_shard), per_shard
    # Read over P4Runtime: the sums over shards. Every round completed exactly once (probes included).
    assert counters_a["results"] == 2 * (-(-50_000 // wire.K) + 256)
    assert counters_b["results"] == 2 * (-(-30_000 // wire.K) + 96)
    assert counters_a["contributions"] == N * counters_a["results"]


@pytest.mark.slow
def test_sharded_switch_under_loss_duplication_and_reordering_stays_exact():
    inputs = _inputs(20_000, 3)
    want, _ = expected_allreduce(inputs)
    with testing.LoopbackSwitch(shards=2) as switch:
        host, port = switch.target.loopback.address
        with LossyRelay((host, port), N, drop=0.05, duplicate=0.02, reorder=0.02, seed=9) as relay:
            configs = switch.add_job(N, slot_count=128, bind_ports=[relay.endpoint(i).port for i in range(N)])
            workers = [dataclasses.replace(c, bind=Endpoint("127.0.0.1", p), aggregator=relay.endpoint(i))
                       for i, (c, p) in enumerate(zip(configs, free_ports(N), strict=True))]
            results = run_workers(workers, lambda w, rank: w.allreduce(inputs[rank]), rto_initial=0.01)
            counters = switch.counters(configs[0].job_id)
    for got in results:
        np.testing.assert_array_equal(got, want)
    assert counters["retransmit_results"] > 0
    assert counters["results"] == -(-20_000 // wire.K) + 128


@pytest.mark.skipif(udpgso.gso_unavailable() is not None, reason=f"no UDP GSO here: {udpgso.gso_unavailable()}")
def test_segmented_sends_that_break_the_steering_rule_are_still_aggregated_exactly():
    """Hosts that put two blocks into one GSO send: the kernel hands it all to the first datagram's shard,
    which runs the other shard's frames under both shards' locks. Job 1's slots 32..95: block 0 (shard 1)
    and block 1 (shard 0)."""
    slots = list(range(32, 96))
    with testing.LoopbackSwitch(shards=2) as switch:
        configs = switch.add_job(2, slot_count=128)
        job = configs[0].job_id
        socks = []
        try:
            for config in configs:
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                socks.append(sock)
                sock.bind((config.bind.host, config.bind.port))
                sock.connect((config.aggregator.host, config.aggregator.port))
                sock.settimeout(5)
            gso = udpgso.GsoBatch(len(slots))
            for rank, sock in enumerate(socks):
                rows = np.zeros((len(slots), wire.NETAGG_BYTES), np.uint8)
                for i, slot in enumerate(slots):
                    header = wire.HEADER_STRUCT.pack(wire.VERSION, 0, job, slot, 0, rank, 0, 0, 1, slot, 0, 0)
                    values = np.full(wire.K, 1000 * (rank + 1) + slot, ">i4").tobytes()
                    rows[i] = np.frombuffer(header + values, np.uint8)
                addresses = np.uint64(rows.ctypes.data) + np.arange(len(slots), dtype=np.uint64) \
                    * np.uint64(wire.NETAGG_BYTES)
                headers = gso.plan_uniform(addresses, wire.NETAGG_BYTES)  # no steering keys: one send of 64
                assert headers == 1 and gso.send(sock.fileno(), headers)[0] == len(slots)
            for sock in socks:  # every slot's sum, once, at both workers
                sums = {}
                while len(sums) < len(slots):
                    data = sock.recv(4096)
                    fields = wire.HEADER_STRUCT.unpack_from(data)
                    assert fields[wire.FIELD_INDEX["flags"]] & wire.FLAG_RESULT
                    value = np.frombuffer(data[wire.HEADER_BYTES:], ">i4")
                    sums[fields[wire.FIELD_INDEX["slot"]]] = int(value[0])
                    assert (value == value[0]).all()
                assert sums == {slot: 3000 + 2 * slot for slot in slots}
        finally:
            for sock in socks:
                sock.close()
        foreign = switch.target.switch.foreign_frames
        counters = switch.counters(job)
    assert foreign == 2 * 32  # block 1's half of each worker's send reached block 0's shard
    assert counters["results"] == len(slots) and counters["contributions"] == 2 * len(slots)


def test_counter_writes_and_reads_see_every_shard():
    with testing.LoopbackSwitch(shards=3) as switch:
        configs = switch.add_job(N, slot_count=192)
        inputs = _inputs(10_000, 5)
        run_workers(configs, lambda w, rank: w.allreduce(inputs[rank]))
        job = configs[0].job_id
        state = switch.target.state
        counter = state.index.counter(dp.COUNTER_JOB_CONTRIBUTIONS)
        with state.lock:
            parts = [int(state.counter_arrays(counter.name, shard)[0][job]) for shard in range(3)]
        assert sum(1 for part in parts if part) >= 2  # the job's blocks sit on several shards
        assert switch.counters(job)["contributions"] == sum(parts)
        # A MODIFY sets the cell's value, whatever each shard had counted.
        entry = p4rt.CounterEntry(counter_id=counter.id)
        entry.index.index = job
        entry.data.packet_count = 7
        switch.client.write([p4rt.Update(type=p4rt.Update.MODIFY, entity=p4rt.Entity(counter_entry=entry))])
        assert switch.counters(job)["contributions"] == 7


def test_a_control_plane_write_waits_until_every_shard_is_between_batches():
    with testing.LoopbackSwitch(shards=2) as switch:
        shard_lock = switch.target.switch.pipelines[1].lock
        done = threading.Event()
        with shard_lock:  # shard 1 is in the middle of a batch
            writer = threading.Thread(target=lambda: (switch.add_job(2, slot_count=8), done.set()))
            writer.start()
            assert not done.wait(0.5)  # the write is not applied (nor acknowledged) yet
        assert done.wait(10)
        writer.join()


def test_a_shard_that_dies_takes_the_whole_switch_down_loudly(caplog):
    with testing.LoopbackSwitch(shards=3) as switch:
        sharded = switch.target.switch
        told: list[str] = []
        sharded.on_failure = told.append
        victim = sharded.shards[1]

        def crash(*_args):
            raise SystemExit("injected")

        victim._serve_loopback = crash
        sock = switch.target.loopback.sock
        configs = switch.add_job(2, slot_count=256)
        # Traffic for every shard's slots, until the victim meets some.
        deadline = time.monotonic() + 10
        while not told and time.monotonic() < deadline:
            for slot in range(0, 256, 64):
                header = wire.HEADER_STRUCT.pack(wire.VERSION, 0, configs[0].job_id, slot, 0, 0, 0, 0, 1, 0, 0, 0)
                try:
                    sock.sendto(header + bytes(wire.PAYLOAD_BYTES), sock.getsockname())
                except OSError:  # the switch went down (and closed this, its own socket) before telling us
                    break
            time.sleep(0.05)
        assert told and "shard 1 stopped (SystemExit: injected)" in told[0]
        assert sharded.failed == told[0]
        assert "the switch is down" in caplog.text
        for shard in sharded.shards:  # every shard stopped and closed its sockets: no partial aggregation
            assert not (shard._thread and shard._thread.is_alive())
            assert all(port.fileno() == -1 for port in shard.ports.values())


def test_shard_count_falls_back_to_one_where_the_loop_runs_per_packet(caplog):
    assert shards_mod.shard_counts(None, None) == shards_mod.default_shards() >= 1
    assert shards_mod.shard_counts(4, None) == 4
    assert shards_mod.shard_counts(4, "fault injection runs per packet") == 1
    assert "1 shard, not 4 (fault injection runs per packet)" in caplog.text
    with pytest.raises(ValueError):
        shards_mod.shard_counts(0, None)
    with testing.LoopbackSwitch(drop=0.1, shards=3) as switch:
        assert switch.target.shards == 1


def test_ports_that_cannot_be_sharded_run_one_shard_and_say_why(monkeypatch, caplog):
    def refuse(*_args, **_kwargs):
        raise shards_mod.ShardingUnavailable("refused for the test")

    monkeypatch.setattr(shards_mod.ShardedSwitch, "__init__", refuse)
    inputs = _inputs(5_000, 6)
    want, _ = expected_allreduce(inputs)
    with testing.LoopbackSwitch(shards=3) as switch:
        assert switch.target.shards == 1 and not isinstance(switch.target.switch, shards_mod.ShardedSwitch)
        configs = switch.add_job(N, slot_count=64)
        results = run_workers(configs, lambda w, rank: w.allreduce(inputs[rank]))
    for got in results:
        np.testing.assert_array_equal(got, want)
    assert "1 shard, not 3 (refused for the test)" in caplog.text
