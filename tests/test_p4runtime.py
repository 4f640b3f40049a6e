"""The P4Runtime layer end to end: the real gRPC server over a ForwardingState, driven by the real client."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2 as p4rt

from netagg.controller.p4runtime_client import EntryOp, P4RuntimeClient, P4RuntimeError
from netagg.localports import free_ports
from netagg.p4info import (
    P4InfoIndex,
    P4InfoLookupError,
    decode_int,
    encode_int,
    load_p4info,
    p4info_differences,
    same_pipeline,
)
from netagg.softswitch.forwarding_state import ForwardingState, StateError
from netagg.softswitch.p4runtime_server import serve

P4INFO_PATH = Path(__file__).resolve().parents[1] / "p4src" / "v1model" / "netagg.p4info.txtpb"
P4INFO = load_p4info(P4INFO_PATH)  # parsed once: text parsing costs ~40 ms
INDEX = P4InfoIndex(P4INFO)
JOBS = "NetaggIngress.worker_lookup.jobs"
WORKERS = "NetaggIngress.worker_lookup.workers"
ROUTES = "NetaggIngress.ipv4_forward.routes"
SET_JOB = "NetaggIngress.worker_lookup.set_job"
UNKNOWN_JOB = "NetaggIngress.worker_lookup.unknown_job"
SET_WORKER = "NetaggIngress.worker_lookup.set_worker"
FORWARD = "NetaggIngress.ipv4_forward.forward"
NO_ROUTE = "NetaggIngress.ipv4_forward.no_route"
CONTRIBUTIONS = "NetaggIngress.job_contributions"
JOBS_ID, ROUTES_ID = 0x02000001, 0x02000004
SET_JOB_ID, UNKNOWN_JOB_ID, FORWARD_ID = 0x01000001, 0x01000002, 0x01000007


def job_params(n: int = 1) -> dict[str, int]:
    return {"num_workers": 2, "slot_base": 16 * n, "slot_count": 16, "mgid": n, "generation": n, "width": 0}


def wait_for(condition: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Switch(NamedTuple):
    state: ForwardingState
    address: str


def start_switch(p4info: p4info_pb2.P4Info) -> tuple[Switch, grpc.Server]:
    state = ForwardingState(P4InfoIndex(p4info))
    server, port = serve(state, "127.0.0.1:0")
    return Switch(state, f"127.0.0.1:{port}"), server


@pytest.fixture
def switch() -> Iterator[Switch]:
    sw, server = start_switch(P4INFO)
    yield sw
    server.stop(0)


def connect(sw: Switch, election_id: tuple[int, int] = (0, 10), **kwargs: object) -> P4RuntimeClient:
    c = P4RuntimeClient(sw.address, election_id=election_id, timeout=3.0, **kwargs)  # type: ignore[arg-type]
    c.index = INDEX
    return c.connect()


@pytest.fixture
def client(switch: Switch) -> Iterator[P4RuntimeClient]:
    c = connect(switch)
    c.set_pipeline(P4INFO)
    yield c
    c.close()


def table_update(kind: int, table_id: int, match: list[p4rt.FieldMatch], action_id: int = 0,
                 params: list[tuple[int, bytes]] = (), priority: int = 0,  # type: ignore[assignment]
                 ) -> p4rt.Update:
    entry = p4rt.TableEntry(table_id=table_id, match=match, priority=priority)
    if action_id:
        entry.action.action.action_id = action_id
        for param_id, value in params:
            entry.action.action.params.add(param_id=param_id, value=value)
    return p4rt.Update(type=kind, entity=p4rt.Entity(table_entry=entry))


def exact(field_id: int, value: bytes) -> p4rt.FieldMatch:
    return p4rt.FieldMatch(field_id=field_id, exact=p4rt.FieldMatch.Exact(value=value))


def lpm(field_id: int, value: bytes, prefix_len: int) -> p4rt.FieldMatch:
    return p4rt.FieldMatch(field_id=field_id, lpm=p4rt.FieldMatch.LPM(value=value, prefix_len=prefix_len))


GOOD_JOB_PARAMS = [(1, b"\x02"), (2, b"\x00"), (3, b"\x10"), (4, b"\x01"), (5, b"\x01"), (6, b"\x00")]


def write_error(c: P4RuntimeClient, *updates: p4rt.Update) -> P4RuntimeError:
    with pytest.raises(P4RuntimeError) as info:
        c.write(list(updates))
    return info.value


# --------------------------------------------------------------------------- byte strings, P4Info


def test_encode_int_is_canonical() -> None:
    assert encode_int(0, 8) == b"\x00"
    assert encode_int(1, 16) == b"\x01"
    assert encode_int(256, 9) == b"\x01\x00"
    assert encode_int(2**48 - 1, 48) == b"\xff" * 6


@pytest.mark.parametrize(("value", "bitwidth"), [(256, 8), (-1, 8), (2**9, 9), (1, 0)])
def test_encode_int_rejects_what_does_not_fit(value: int, bitwidth: int) -> None:
    with pytest.raises(ValueError, match=r"fit|positive"):
        encode_int(value, bitwidth)


@given(st.integers(1, 128).flatmap(lambda w: st.tuples(st.just(w), st.integers(0, 2**w - 1))),
       st.integers(0, 3))
def test_decode_int_reads_canonical_and_padded(width_value: tuple[int, int], padding: int) -> None:
    width, value = width_value
    encoded = encode_int(value, width)
    assert len(encoded) == max(1, (value.bit_length() + 7) // 8)
    assert decode_int(encoded) == decode_int(b"\x00" * padding + encoded) == value


def test_decode_int_rejects_empty() -> None:
    with pytest.raises(ValueError):
        decode_int(b"")


def test_p4info_index_by_name_alias_and_id() -> None:
    index = P4InfoIndex.from_file(P4INFO_PATH)
    assert index.p4info == P4INFO
    assert index.table(JOBS) is index.table("jobs") is index.table(JOBS_ID)
    assert index.match_field(ROUTES, "ipv4_dst").match_kind == "lpm"
    assert index.table(WORKERS).match_field(3).name == "udp_src"
    assert index.param(SET_JOB, "mgid").bitwidth == 16
    assert index.action(FORWARD_ID).param(1).bitwidth == 9
    assert index.counter(CONTRIBUTIONS).unit == "both"
    assert index.register("NetaggIngress.value_sum.value_07").bitwidth == 32
    with pytest.raises(KeyError, match="no table 'nope'"):
        index.table("nope")
    with pytest.raises(P4InfoLookupError, match="has no match field 'port'"):
        index.match_field(JOBS, "port")


def test_p4info_differences() -> None:
    expected = P4INFO
    assert p4info_differences(expected, copy.deepcopy(expected)) == []
    changed = copy.deepcopy(expected)
    next(t for t in changed.tables if t.preamble.name == JOBS).size = 2
    next(a for a in changed.actions if a.preamble.name.endswith(".set_job")).params[1].bitwidth = 16
    del changed.counters[0]
    diffs = p4info_differences(expected, changed)
    assert len(diffs) == 3
    assert f"table '{JOBS}'" in diffs[0] and "size" in diffs[0] and "1024" in diffs[0]
    assert "slot_base" in diffs[1] and "16" in diffs[1]
    assert "NetaggIngress.drop_reasons" in diffs[2] and "missing" in diffs[2]
    assert not same_pipeline(expected, changed)


# --------------------------------------------------------------------------- arbitration


def test_capabilities_and_primary(switch: Switch) -> None:
    with connect(switch) as c:
        assert c.is_primary
        assert c.primary_election_id == (0, 10)
        assert c.capabilities() == "1.3.0"
        assert c.arbitrate()  # same id again: still primary


def test_higher_election_id_is_primary_and_backup_cannot_write(client: P4RuntimeClient,
                                                              switch: Switch) -> None:
    with connect(switch, (0, 5)) as backup:
        assert not backup.is_primary and client.is_primary
        assert backup.primary_election_id == (0, 10)
        err = write_error(backup, table_update(p4rt.Update.INSERT, JOBS_ID, [exact(1, b"\x01")],
                                               SET_JOB_ID, GOOD_JOB_PARAMS))
        assert err.code == "PERMISSION_DENIED" and "not primary" in str(err)
        with connect(switch, (0, 20)) as higher:
            assert higher.is_primary
            assert wait_for(lambda: not client.is_primary)  # the old primary is told it lost
            with pytest.raises(P4RuntimeError, match="PERMISSION_DENIED"):
                client.insert_entry(JOBS, {"job_id": 1}, SET_JOB, job_params())
        # The primary left: the next-highest client is primary again (as PI does)...
        assert wait_for(lambda: client.is_primary)
        assert not backup.is_primary
        client.close()
        assert wait_for(lambda: backup.is_primary)
        # ...and re-arbitrating with a higher id keeps it there.
        assert backup.arbitrate((0, 30))
        backup.insert_entry(JOBS, {"job_id": 1}, SET_JOB, job_params())
        assert switch.state.table(JOBS).lookup((1,))[0] == SET_JOB


def test_duplicate_election_id_and_wrong_device_end_the_stream(client: P4RuntimeClient,
                                                               switch: Switch) -> None:
    with pytest.raises(P4RuntimeError) as info:
        connect(switch, (0, 10))
    assert info.value.code == "INVALID_ARGUMENT" and "already used" in str(info.value)
    with pytest.raises(P4RuntimeError) as info:
        connect(switch, (0, 11), device_id=7)
    assert info.value.code == "NOT_FOUND" and "device id 7" in str(info.value)
    assert client.is_primary


def test_unreachable_server_fails_quickly() -> None:
    port = free_ports(1, "tcp")[0]  # outside the ephemeral range: no connection's local port takes it meanwhile
    start = time.monotonic()
    with pytest.raises(P4RuntimeError) as info:
        P4RuntimeClient(f"127.0.0.1:{port}", timeout=0.5).connect()
    assert time.monotonic() - start < 3
    assert info.value.code == "UNAVAILABLE" and f"127.0.0.1:{port}" in str(info.value)


# --------------------------------------------------------------------------- pipeline


def test_pipeline_set_get_and_write_before_pipeline(switch: Switch) -> None:
    with connect(switch) as c:
        assert c.get_pipeline_p4info() is None
        with pytest.raises(P4RuntimeError) as info:
            c.insert_entry(JOBS, {"job_id": 1}, SET_JOB, job_params())
        assert info.value.code == "FAILED_PRECONDITION"
        c.set_pipeline(P4INFO_PATH, b'{"bmv2": "json"}')
        assert switch.state.configured
        assert same_pipeline(c.get_pipeline_p4info(), load_p4info(P4INFO_PATH))
        get = p4rt.GetForwardingPipelineConfigRequest
        cookie_only = c.stub.GetForwardingPipelineConfig(
            get(device_id=1, response_type=get.COOKIE_ONLY), timeout=3).config
        assert not cookie_only.HasField("p4info") and not cookie_only.p4_device_config
        device = c.stub.GetForwardingPipelineConfig(
            get(device_id=1, response_type=get.DEVICE_CONFIG_AND_COOKIE), timeout=3).config
        assert device.p4_device_config == b'{"bmv2": "json"}' and not device.HasField("p4info")


def test_mismatching_p4info_is_rejected(switch: Switch) -> None:
    other = copy.deepcopy(P4INFO)
    next(t for t in other.tables if t.preamble.name == JOBS).size = 2
    next(a for a in other.actions if a.preamble.name.endswith(".set_worker")).params[0].bitwidth = 9
    with connect(switch) as c:
        with pytest.raises(P4RuntimeError) as info:
            c.set_pipeline(other)
        assert info.value.code == "INVALID_ARGUMENT"
        assert f"table '{JOBS}'" in str(info.value) and "size differs" in str(info.value)
        assert "'rank'" in str(info.value)
        assert not switch.state.configured


def set_config(c: P4RuntimeClient, action: int, with_config: bool = True) -> None:
    config = p4rt.ForwardingPipelineConfig(p4info=P4INFO) if with_config else None
    c.stub.SetForwardingPipelineConfig(p4rt.SetForwardingPipelineConfigRequest(
        device_id=1, election_id=p4rt.Uint128(low=10), action=action, config=config), timeout=3)


def test_pipeline_actions_reset_or_keep_state(client: P4RuntimeClient, switch: Switch) -> None:
    request = p4rt.SetForwardingPipelineConfigRequest
    client.insert_entry(JOBS, {"job_id": 1}, SET_JOB, job_params())
    set_config(client, request.VERIFY)
    set_config(client, request.RECONCILE_AND_COMMIT)
    assert len(switch.state.table(JOBS)) == 1
    set_config(client, request.VERIFY_AND_SAVE)
    set_config(client, request.COMMIT, with_config=False)
    assert len(switch.state.table(JOBS)) == 1
    with pytest.raises(grpc.RpcError) as info:
        set_config(client, request.COMMIT, with_config=False)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    client.set_pipeline(P4INFO)  # VERIFY_AND_COMMIT clears the forwarding state
    assert len(switch.state.table(JOBS)) == 0
    assert switch.state.table(JOBS).lookup((1,)) == (UNKNOWN_JOB, ())


# --------------------------------------------------------------------------- table entries


def test_insert_duplicate_modify_delete(client: P4RuntimeClient, switch: Switch) -> None:
    jobs = switch.state.table(JOBS)
    client.insert_entry(JOBS, {"job_id": 5}, SET_JOB, job_params(5))
    assert jobs.lookup((5,)) == (SET_JOB, (2, 80, 16, 5, 5, 0))
    with pytest.raises(P4RuntimeError) as info:
        client.insert_entry(JOBS, {"job_id": 5}, SET_JOB, job_params(6))
    assert info.value.code == "UNKNOWN" and info.value.errors[0].code == "ALREADY_EXISTS"
    assert "job_id=0x5" in str(info.value)
    client.modify_entry(JOBS, {"job_id": 5}, SET_JOB, job_params(7))
    assert jobs.lookup((5,)) == (SET_JOB, (2, 112, 16, 7, 7, 0))
    with pytest.raises(P4RuntimeError) as info:
        client.modify_entry(JOBS, {"job_id": 6}, SET_JOB, job_params(6))
    assert info.value.errors[0].code == "NOT_FOUND"
    [view] = client.read_entries(JOBS)
    assert (view.table, view.match, view.action, view.params) == (JOBS, {"job_id": 5}, SET_JOB,
                                                                   job_params(7))
    client.delete_entry(JOBS, {"job_id": 5})
    assert jobs.lookup((5,)) == (UNKNOWN_JOB, ())
    with pytest.raises(P4RuntimeError) as info:
        client.delete_entry(JOBS, {"job_id": 5})
    assert info.value.errors[0].code == "NOT_FOUND"
    assert client.read_entries(JOBS) == []


def test_batched_write_reports_each_failed_update(client: P4RuntimeClient, switch: Switch) -> None:
    client.insert_entry(JOBS, {"job_id": 2}, SET_JOB, job_params(2))
    with pytest.raises(P4RuntimeError) as info:
        client.write_entries([EntryOp.insert(JOBS, {"job_id": 1}, SET_JOB, job_params(1)),
                              EntryOp.insert(JOBS, {"job_id": 2}, SET_JOB, job_params(2)),
                              EntryOp.delete(JOBS, {"job_id": 9}),
                              EntryOp.insert(JOBS, {"job_id": 3}, SET_JOB, job_params(3))])
    err = info.value
    assert [(e.index, e.code) for e in err.errors] == [(1, "ALREADY_EXISTS"), (2, "NOT_FOUND")]
    assert "2 of 4 update(s) failed" in str(err) and "\n" not in str(err)
    assert {v.match["job_id"] for v in client.read_entries(JOBS)} == {1, 2, 3}


def test_exact_lookup_on_four_fields(client: P4RuntimeClient, switch: Switch) -> None:
    client.insert_entry(WORKERS, {"job_id": 1, "ipv4_src": 0x0A000001, "udp_src": 5000, "ingress_port": 3},
                        SET_WORKER, {"rank": 0, "worker_mask": 1})
    client.insert_entry(WORKERS, {"job_id": 1, "ipv4_src": 0x0A000002, "udp_src": 5000, "ingress_port": 4},
                        SET_WORKER, {"rank": 1, "worker_mask": 2})
    workers = switch.state.table(WORKERS)
    assert workers.lookup((1, 0x0A000002, 5000, 4)) == (SET_WORKER, (1, 2))
    assert workers.lookup((1, 0x0A000002, 5001, 4))[0] == "NetaggIngress.worker_lookup.unknown_worker"
    # The same address and port from another switch port (another host forging it): no match.
    assert workers.lookup((1, 0x0A000002, 5000, 3))[0] == "NetaggIngress.worker_lookup.unknown_worker"


def test_lpm_longest_prefix_wins(client: P4RuntimeClient, switch: Switch) -> None:
    routes = switch.state.table(ROUTES)
    for prefix, length, port in [(0x0A000000, 8, 1), (0x0A010000, 16, 2), (0x0A010100, 24, 3),
                                 (0x0A010101, 32, 4)]:
        client.insert_entry(ROUTES, {"ipv4_dst": (prefix, length)}, FORWARD, {"port": port, "dst_mac": port})
    assert routes.lookup((0x0A010101,)) == (FORWARD, (4, 4))
    assert routes.lookup((0x0A010102,)) == (FORWARD, (3, 3))
    assert routes.lookup((0x0A01FF01,)) == (FORWARD, (2, 2))
    assert routes.lookup((0x0AFF0000,)) == (FORWARD, (1, 1))
    assert routes.lookup((0x0B000000,)) == (NO_ROUTE, ())
    client.insert_entry(ROUTES, {"ipv4_dst": (0, 0)}, FORWARD, {"port": 9, "dst_mac": 9})  # /0: field omitted
    assert routes.lookup((0x0B000000,)) == (FORWARD, (9, 9))
    client.delete_entry(ROUTES, {"ipv4_dst": (0x0A010100, 24)})
    assert routes.lookup((0x0A010102,)) == (FORWARD, (2, 2))
    assert {v.match.get("ipv4_dst", (0, 0))[1] for v in client.read_entries(ROUTES)} == {0, 8, 16, 32}


_INSERT = p4rt.Update.INSERT
ONE = [exact(1, b"\x01")]
PORT_AND_MAC = [(1, b"\x01"), (2, b"\x01")]
TEN_SLASH_8 = [lpm(1, b"\x0a\x00\x00\x00", 8)]


def insert_job(match: list[p4rt.FieldMatch] = ONE, action_id: int = SET_JOB_ID,
               params: list[tuple[int, bytes]] = GOOD_JOB_PARAMS, priority: int = 0) -> p4rt.Update:
    return table_update(_INSERT, JOBS_ID, match, action_id, params, priority)


def insert_route(match: list[p4rt.FieldMatch], params: list[tuple[int, bytes]] = PORT_AND_MAC,
                 ) -> p4rt.Update:
    return table_update(_INSERT, ROUTES_ID, match, FORWARD_ID, params)


INVALID_UPDATES = [  # (id, update, code, fragment of the message)
    ("value too wide", insert_job([exact(1, b"\x01\x00\x00")]), "INVALID_ARGUMENT",
     "does not fit in 16 bits"),
    ("unknown field", insert_job([*ONE, exact(2, b"\x01")]), "INVALID_ARGUMENT", "no match field with id 2"),
    ("missing exact field", insert_job([]), "INVALID_ARGUMENT", "'job_id' (exact, 16 bits) is missing"),
    ("wrong match kind", insert_job([lpm(1, b"\x01", 16)]), "INVALID_ARGUMENT", "got a lpm match"),
    ("bits beyond prefix", insert_route([lpm(1, b"\x0a\x01\x00\x00", 8)]), "INVALID_ARGUMENT",
     "bits set beyond the prefix length 8"),
    ("prefix too long", insert_route([lpm(1, b"\x0a\x00\x00\x00", 33)]), "INVALID_ARGUMENT",
     "prefix length 33"),
    ("missing param", insert_job(params=GOOD_JOB_PARAMS[:4]), "INVALID_ARGUMENT",
     "missing parameter(s) generation"),
    ("param too wide", insert_route(TEN_SLASH_8, [(1, b"\x02\x00"), (2, b"\x01")]), "INVALID_ARGUMENT",
     "parameter 'port' (9 bits): value 0x200 does not fit"),
    ("unknown param", insert_job(params=[*GOOD_JOB_PARAMS, (7, b"\x01")]), "INVALID_ARGUMENT",
     "no parameter with id 7"),
    ("foreign action", insert_job(action_id=FORWARD_ID, params=PORT_AND_MAC), "INVALID_ARGUMENT",
     "not an action of table"),
    ("@defaultonly action", insert_job(action_id=UNKNOWN_JOB_ID, params=[]), "PERMISSION_DENIED",
     "@defaultonly"),
    ("no action", insert_job(action_id=0), "INVALID_ARGUMENT", "needs an action"),
    ("priority on exact table", insert_job(priority=5), "INVALID_ARGUMENT", "priority must be 0"),
    ("unknown table", table_update(_INSERT, 0x02000099, [], SET_JOB_ID), "INVALID_ARGUMENT",
     "no table with id"),
    ("empty value", insert_job([exact(1, b"")]), "INVALID_ARGUMENT", "empty byte string"),
]


@pytest.mark.parametrize(("update", "code", "fragment"), [case[1:] for case in INVALID_UPDATES],
                         ids=[case[0] for case in INVALID_UPDATES])
def test_invalid_entries_are_rejected(client: P4RuntimeClient, switch: Switch, update: p4rt.Update,
                                      code: str, fragment: str) -> None:
    err = write_error(client, update)
    assert err.code == "UNKNOWN"
    [failed] = err.errors
    assert failed.code == code and fragment in failed.message, failed
    assert all(len(t) == 0 for t in switch.state.tables.values())


def test_padded_values_are_accepted_and_read_back_canonical(client: P4RuntimeClient) -> None:
    client.write([table_update(_INSERT, JOBS_ID, [exact(1, b"\x00\x00\x07")], SET_JOB_ID,
                               [(1, b"\x00\x02"), (2, b"\x00\x00\x00\x00"), (3, b"\x10"), (4, b"\x01"),
                                (5, b"\x00\x01"), (6, b"\x00\x01")])])
    [entity] = client.read([p4rt.Entity(table_entry=p4rt.TableEntry(table_id=JOBS_ID))])
    entry = entity.table_entry
    assert entry.match[0].exact.value == b"\x07"
    assert [p.value for p in entry.action.action.params] == [b"\x02", b"\x00", b"\x10", b"\x01", b"\x01", b"\x01"]


def test_const_default_action_cannot_be_modified(client: P4RuntimeClient) -> None:
    entry = p4rt.TableEntry(table_id=JOBS_ID, is_default_action=True)
    entry.action.action.action_id = UNKNOWN_JOB_ID
    err = write_error(client, p4rt.Update(type=p4rt.Update.MODIFY, entity=p4rt.Entity(table_entry=entry)))
    assert err.errors[0].code == "PERMISSION_DENIED" and "const default action" in err.errors[0].message
    [default] = client.read([p4rt.Entity(table_entry=p4rt.TableEntry(table_id=JOBS_ID,
                                                                     is_default_action=True))])
    assert default.table_entry.action.action.action_id == UNKNOWN_JOB_ID


def test_single_entry_and_all_tables_reads(client: P4RuntimeClient) -> None:
    client.insert_entry(JOBS, {"job_id": 1}, SET_JOB, job_params(1))
    client.insert_entry(JOBS, {"job_id": 2}, SET_JOB, job_params(2))
    client.insert_entry(ROUTES, {"ipv4_dst": (0x0A000000, 8)}, FORWARD, {"port": 1, "dst_mac": 1})
    one = client.read([p4rt.Entity(table_entry=p4rt.TableEntry(table_id=JOBS_ID,
                                                               match=[exact(1, b"\x02")]))])
    assert [decode_int(e.table_entry.match[0].exact.value) for e in one] == [2]
    assert client.read([p4rt.Entity(table_entry=p4rt.TableEntry(table_id=JOBS_ID,
                                                                match=[exact(1, b"\x03")]))]) == []
    assert sorted(v.table for v in client.read_entries()) == [ROUTES, JOBS, JOBS]


def test_full_table_is_resource_exhausted() -> None:
    small = copy.deepcopy(P4INFO)
    next(t for t in small.tables if t.preamble.name == JOBS).size = 2
    sw, server = start_switch(small)
    try:
        with P4RuntimeClient(sw.address, timeout=3.0) as c:
            c.set_pipeline(small)
            c.insert_entry(JOBS, {"job_id": 1}, SET_JOB, job_params(1))
            c.insert_entry(JOBS, {"job_id": 2}, SET_JOB, job_params(2))
            with pytest.raises(P4RuntimeError) as info:
                c.insert_entry(JOBS, {"job_id": 3}, SET_JOB, job_params(3))
            assert info.value.errors[0].code == "RESOURCE_EXHAUSTED" and "full (2 entries)" in str(info.value)
            c.delete_entry(JOBS, {"job_id": 1})
            c.insert_entry(JOBS, {"job_id": 3}, SET_JOB, job_params(3))
            assert len(sw.state.table(JOBS)) == 2
    finally:
        server.stop(0)


# --------------------------------------------------------------------------- multicast


def group_update(kind: int, gid: int, replicas: list[p4rt.Replica]) -> p4rt.Update:
    group = p4rt.MulticastGroupEntry(multicast_group_id=gid, replicas=replicas)
    return p4rt.Update(type=kind, entity=p4rt.Entity(
        packet_replication_engine_entry=p4rt.PacketReplicationEngineEntry(multicast_group_entry=group)))


def test_multicast_group_crud(client: P4RuntimeClient, switch: Switch) -> None:
    client.set_multicast_group(1, [(1, 0), (2, 0), (2, 1)])
    client.set_multicast_group(2, [(0, 5)])
    assert client.read_multicast_groups() == {1: [(1, 0), (2, 0), (2, 1)], 2: [(0, 5)]}
    client.set_multicast_group(1, [(3, 7)])  # exists: modified
    assert switch.state.multicast_groups == {1: [(3, 7)], 2: [(0, 5)]}
    client.delete_multicast_group(1)
    assert client.read_multicast_groups() == {2: [(0, 5)]}
    for update, code in [(group_update(p4rt.Update.DELETE, 1, []), "NOT_FOUND"),
                         (group_update(_INSERT, 2, []), "ALREADY_EXISTS"),
                         (group_update(_INSERT, 0, []), "INVALID_ARGUMENT"),
                         (group_update(_INSERT, 1 << 15, []), "OUT_OF_RANGE"),
                         (group_update(_INSERT, 3, [p4rt.Replica(egress_port=1)] * 2), "INVALID_ARGUMENT")]:
        assert write_error(client, update).errors[0].code == code
    with pytest.raises(P4RuntimeError, match="NOT_FOUND"):
        client.read([group_update(0, 9, []).entity])


def test_replica_ports_read_back_in_the_form_written(client: P4RuntimeClient, switch: Switch) -> None:
    client.write([group_update(_INSERT, 4, [p4rt.Replica(port=b"\x00\x07", instance=1),
                                            p4rt.Replica(egress_port=8, instance=2)])])
    assert switch.state.multicast_groups[4] == [(7, 1), (8, 2)]
    [entity] = client.read([group_update(0, 4, []).entity])
    replicas = entity.packet_replication_engine_entry.multicast_group_entry.replicas
    assert [(r.WhichOneof("port_kind"), r.port, r.egress_port) for r in replicas] == [
        ("port", b"\x00\x07", 0), ("egress_port", b"", 8)]
    assert client.read_multicast_groups() == {4: [(7, 1), (8, 2)]}
    # PI's rules for the bytes form: port 0 invalid, more than 4 bytes unimplemented.
    assert write_error(client, group_update(_INSERT, 5, [p4rt.Replica(port=b"\x00")])
                       ).errors[0].code == "INVALID_ARGUMENT"
    assert write_error(client, group_update(_INSERT, 5, [p4rt.Replica(port=b"\x00" * 4 + b"\x01")])
                       ).errors[0].code == "UNIMPLEMENTED"


# --------------------------------------------------------------------------- counters, registers


def test_counters_read(client: P4RuntimeClient, switch: Switch) -> None:
    with switch.state.lock:
        switch.state.count(CONTRIBUTIONS, 5, 300)
        switch.state.count(CONTRIBUTIONS, 5, 300)
        switch.state.count(CONTRIBUTIONS, 4096, 300)  # out of range: ignored, as BMv2
        switch.state.count("NetaggIngress.drop_reasons", 3, 64)
    assert client.read_counter(CONTRIBUTIONS, 5) == (2, 600)
    assert switch.state.counter_values(CONTRIBUTIONS, 5) == (2, 600)
    cells = client.read_counters(CONTRIBUTIONS)
    assert len(cells) == 1024 and cells[5] == (2, 600) and sum(p for p, _ in cells.values()) == 2
    assert client.read_counters("NetaggIngress.drop_reasons")[3] == (1, 64)
    every_counter = client.read([p4rt.Entity(counter_entry=p4rt.CounterEntry(index=p4rt.Index(index=3)))])
    assert len(every_counter) == 7  # counter_id 0: cell 3 of each counter
    assert {e.counter_entry.counter_id: e.counter_entry.data.packet_count for e in every_counter
            }[0x12000001] == 1
    with pytest.raises(P4RuntimeError) as info:
        client.read_counter(CONTRIBUTIONS, 1024)
    assert info.value.code == "OUT_OF_RANGE"


def counter_update(kind: int, index: int, packets: int = 0, byte_count: int = 0) -> p4rt.Update:
    cell = p4rt.CounterEntry(counter_id=0x12000002, index=p4rt.Index(index=index),
                             data=p4rt.CounterData(packet_count=packets, byte_count=byte_count))
    return p4rt.Update(type=kind, entity=p4rt.Entity(counter_entry=cell))


def test_counter_writes(client: P4RuntimeClient) -> None:
    client.write([counter_update(p4rt.Update.MODIFY, 7, 40, 4000)])
    assert client.read_counter(CONTRIBUTIONS, 7) == (40, 4000)
    client.write([counter_update(p4rt.Update.DELETE, 7)])  # PI zeroes the cell
    assert client.read_counter(CONTRIBUTIONS, 7) == (0, 0)
    assert write_error(client, counter_update(_INSERT, 7)).errors[0].code == "INVALID_ARGUMENT"
    assert write_error(client, counter_update(p4rt.Update.MODIFY, 1024)).errors[0].code == "OUT_OF_RANGE"


def test_wrong_device_id_is_not_found(client: P4RuntimeClient) -> None:
    request = p4rt.WriteRequest(device_id=2, election_id=p4rt.Uint128(low=10))
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Write(request, timeout=3)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "device id 2" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Read(p4rt.ReadRequest(device_id=1, role="tenant-a"), timeout=3).next()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "role 'tenant-a'" in info.value.details()


def test_register_read_is_unimplemented_as_in_bmv2(client: P4RuntimeClient) -> None:
    with pytest.raises(P4RuntimeError) as info:
        client.read([p4rt.Entity(register_entry=p4rt.RegisterEntry(register_id=0x16000001))])
    assert info.value.code == "UNIMPLEMENTED" and "Register reads" in str(info.value)


# --------------------------------------------------------------------------- ForwardingState alone


def synthetic_p4info(*fields: tuple[str, int]) -> p4info_pb2.P4Info:
    """One table "acl" (id 0x02000010) with 8-bit fields of these kinds, action "hit"(x: bit<8>)."""
    p4info = p4info_pb2.P4Info()
    table = p4info.tables.add(size=16)
    table.preamble.id, table.preamble.name = 0x02000010, "acl"
    for field_id, (name, kind) in enumerate(fields, start=1):
        table.match_fields.add(id=field_id, name=name, bitwidth=8, match_type=kind)
    table.action_refs.add(id=0x01000010)
    action = p4info.actions.add()
    action.preamble.id, action.preamble.name = 0x01000010, "hit"
    action.params.add(id=1, name="x", bitwidth=8)
    return p4info


def insert_into_acl(state: ForwardingState, priority: int, x: int, *match: p4rt.FieldMatch) -> None:
    state.apply_update(table_update(_INSERT, 0x02000010, list(match), 0x01000010, [(1, bytes([x]))],
                                    priority=priority))


def test_ternary_range_optional_priority() -> None:
    mf = p4info_pb2.MatchField
    state = ForwardingState(P4InfoIndex(synthetic_p4info(("t", mf.TERNARY), ("r", mf.RANGE),
                                                         ("o", mf.OPTIONAL))))

    def insert(priority: int, x: int, *match: p4rt.FieldMatch) -> None:
        insert_into_acl(state, priority, x, *match)

    ternary = p4rt.FieldMatch(field_id=1, ternary=p4rt.FieldMatch.Ternary(value=b"\x10", mask=b"\xf0"))
    in_range = p4rt.FieldMatch(field_id=2, range=p4rt.FieldMatch.Range(low=b"\x05", high=b"\x0a"))
    optional = p4rt.FieldMatch(field_id=3, optional=p4rt.FieldMatch.Optional(value=b"\x01"))
    insert(10, 1, ternary)
    insert(20, 2, ternary, in_range)
    insert(5, 3, optional)
    acl = state.table("acl")
    assert acl.lookup((0x1F, 7, 1)) == ("hit", (2,))  # both 10 and 20 match: 20 wins
    assert acl.lookup((0x1F, 11, 1)) == ("hit", (1,))
    assert acl.lookup((0x2F, 11, 1)) == ("hit", (3,))
    assert acl.lookup((0x2F, 11, 2)) == ("NoAction", ())
    with pytest.raises(StateError) as info:
        insert(0, 4, optional)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "priority > 0" in info.value.message
    bad_ternary = p4rt.FieldMatch(field_id=1, ternary=p4rt.FieldMatch.Ternary(value=b"\x11", mask=b"\xf0"))
    with pytest.raises(StateError, match="outside mask"):
        insert(1, 4, bad_ternary)


def test_exact_plus_lpm_table() -> None:
    mf = p4info_pb2.MatchField
    state = ForwardingState(P4InfoIndex(synthetic_p4info(("vrf", mf.EXACT), ("dst", mf.LPM),
                                                         ("tos", mf.EXACT))))
    insert_into_acl(state, 0, 1, exact(1, b"\x01"), lpm(2, b"\x80", 1), exact(3, b"\x00"))
    insert_into_acl(state, 0, 2, exact(1, b"\x01"), lpm(2, b"\xc0", 2), exact(3, b"\x00"))
    insert_into_acl(state, 0, 3, exact(1, b"\x02"), exact(3, b"\x00"))  # dst omitted: /0
    acl = state.table("acl")
    assert acl.lookup((1, 0xC5, 0)) == ("hit", (2,))
    assert acl.lookup((1, 0x85, 0)) == ("hit", (1,))
    assert acl.lookup((1, 0x05, 0)) == ("NoAction", ())
    assert acl.lookup((2, 0x05, 0)) == ("hit", (3,))
    assert acl.lookup((1, 0xC5, 1)) == ("NoAction", ())
    [entry] = state.read_table_entries(p4rt.TableEntry(table_id=0x02000010,
                                                       match=[exact(1, b"\x02"), exact(3, b"\x00")]))
    assert [m.field_id for m in entry.match] == [1, 3]


def test_reset_clears_everything_but_keeps_table_objects() -> None:
    state = ForwardingState(INDEX)
    jobs = state.table(JOBS)
    state.apply_update(table_update(_INSERT, JOBS_ID, [exact(1, b"\x01")], SET_JOB_ID, GOOD_JOB_PARAMS))
    state.apply_update(group_update(_INSERT, 1, [p4rt.Replica(egress_port=1)]))
    state.count(CONTRIBUTIONS, 1, 100)
    hooks: list[str] = []
    state.add_reset_hook(lambda: hooks.append("reset"))
    state.reset()
    assert state.table(JOBS) is jobs and jobs.lookup((1,)) == (UNKNOWN_JOB, ())
    assert state.multicast == {} and state.counter_values(CONTRIBUTIONS, 1) == (0, 0)
    assert hooks == ["reset"]
