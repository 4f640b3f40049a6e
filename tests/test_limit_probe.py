"""The native limit probe and load generator (benchmarks/native/limit_probe.c): behaviour, never speed."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from benchmarks import limit_probe
from netagg import wire
from netagg.bmv2.netns import VethRig, can_create_namespaces, list_namespaces
from netagg.localports import free_ports


@pytest.fixture(scope="module", autouse=True)
def probe() -> None:
    try:
        limit_probe.build_probe()
    except limit_probe.ProbeUnavailable as exc:
        pytest.skip(str(exc))


def _datagram(flags: int = 0) -> bytes:
    header = wire.Header(job_id=3, slot=5, pool=1, rank=0, seq=77, round=9, flags=flags)
    return wire.pack(header, np.arange(wire.K, dtype=np.int32) - 7)


def _echo(address: tuple[str, int], payload: bytes) -> bytes:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5.0)
        s.sendto(payload, address)
        data, source = s.recvfrom(4096)
    assert source == address
    return data


UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)


@contextlib.contextmanager
def _corrupting_echo(every: int) -> Iterator[str]:
    """A Python UDP echo that flips one payload byte of every ``every``-th datagram."""
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    server.settimeout(0.05)
    done = threading.Event()

    def serve() -> None:
        count = 0
        while not done.is_set():
            try:
                data, source = server.recvfrom(4096)
            except TimeoutError:
                continue
            count += 1
            if count % every == 0:
                data = data[:10] + bytes([data[10] ^ 0xFF]) + data[11:]
            server.sendto(data, source)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        done.set()
        thread.join(timeout=5)
        server.close()


def test_udp_reflector_echoes_the_bytes() -> None:
    with limit_probe.reflector(["udp-reflect", "--bind", "127.0.0.1:0"]) as running:
        host, port = running.address.rsplit(":", 1)
        payload = _datagram()
        assert _echo((host, int(port)), payload) == payload
    assert running.stats["received"] == running.stats["sent"] == 1
    assert running.stats["netagg"] is False


def test_netagg_reflector_returns_a_result() -> None:
    payload = _datagram()
    with limit_probe.netagg_reflector() as address:
        echoed = _echo(address, payload)
    header, values = wire.unpack(echoed)
    assert header.is_result
    assert echoed[1] == payload[1] | wire.FLAG_RESULT
    assert echoed[:1] + echoed[2:] == payload[:1] + payload[2:]
    assert (header.job_id, header.slot, header.pool, header.round, header.seq) == (3, 5, 1, 9, 77)
    np.testing.assert_array_equal(values, np.arange(wire.K) - 7)


def test_udp_client_counts_round_trips() -> None:
    result = limit_probe.udp_round_trips(window=8, seconds=0.3)
    assert result["size"] == wire.NETAGG_BYTES
    assert result["gso"] is False
    assert result["round_trips"] > 0
    assert result["payload_errors"] == 0
    assert result["reflector"]["received"] >= result["round_trips"]
    assert result["reflector"]["gro"] is False


def test_gso_client_against_the_gro_reflector() -> None:
    result = limit_probe.udp_round_trips(window=64, seconds=0.3, gso=True)
    assert result["gso"] is True
    assert result["round_trips"] > 0
    assert result["payload_errors"] == 0
    assert result["datagrams_per_receive"] > 1
    assert result["datagrams_per_send"] > 1
    stats = result["reflector"]
    assert stats["gro"] is True
    assert stats["received"] == stats["sent"] >= result["round_trips"]
    assert stats["datagrams_per_buffer"] > 1  # coalesced: GRO, not just recvmmsg batching


@pytest.mark.parametrize("gso", [False, True])
def test_udp_client_counts_corrupted_echoes_as_payload_errors(gso: bool) -> None:
    with _corrupting_echo(every=3) as target:
        result = limit_probe.udp_client(target, window=4, seconds=0.3, gso=gso)
    assert result["round_trips"] > 0
    assert result["payload_errors"] > 0
    assert result["received"] == result["round_trips"] + result["payload_errors"]


def test_gro_reflector_echoes_each_segment_as_a_result() -> None:
    """A GSO send of 2.5 datagrams comes back as 3 datagrams, the last one shorter, each flagged RESULT."""
    payloads = [_datagram(), bytes(reversed(_datagram())), _datagram()[:100]]
    with limit_probe.netagg_reflector(gro=True) as address, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5.0)
        s.setsockopt(socket.IPPROTO_UDP, UDP_SEGMENT, wire.NETAGG_BYTES)
        s.sendto(b"".join(payloads), address)
        echoed = [s.recvfrom(4096)[0] for _ in payloads]
    assert [len(e) for e in echoed] == [wire.NETAGG_BYTES, wire.NETAGG_BYTES, 100]
    for sent, back in zip(payloads, echoed, strict=True):
        assert back[1] == sent[1] | wire.FLAG_RESULT
        assert back[:1] + back[2:] == sent[:1] + sent[2:]


def test_netagg_drive_completes_rounds_against_the_reflector() -> None:
    with limit_probe.netagg_reflector() as address:
        result = limit_probe.drive_switch_udp(address, free_ports(1), job_id=4, slots=8, rounds=5)
    assert result["workers"] == 1
    assert result["rounds_completed"] == 5 * 8
    assert result["results_accepted"] == result["contributions_sent"] == 5 * 8
    assert result["cpu_share"] >= 0.0


@pytest.mark.parametrize("gro", [False, True])
def test_netagg_drive_gso_completes_rounds_against_the_reflector(gro: bool) -> None:
    with limit_probe.netagg_reflector(gro=gro) as address:
        result = limit_probe.drive_switch_udp(address, free_ports(2), job_id=4, slots=8, rounds=5, gso=True)
    assert result["gso"] is True
    assert result["rounds_completed"] == 5 * 8
    assert result["results_accepted"] == result["contributions_sent"] == 2 * 5 * 8
    assert result["datagrams_per_send"] >= 1


@pytest.mark.parametrize("gso", [False, True])
def test_netagg_drive_sends_switchml_rounds_and_retransmits(gso: bool) -> None:
    """Against a silent target: round 1 in pool 0 for every slot, then the same bytes again (with GSO: as
    separate, well-formed datagrams)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sink:
        sink.bind(("127.0.0.1", 0))
        sink.settimeout(5.0)
        ports = free_ports(2)
        result = limit_probe.drive_switch_udp(sink.getsockname(), ports, job_id=6, slots=3, seconds=0.2,
                                              rto_ms=20.0, gso=gso)
        got: dict[tuple[int, int], list[bytes]] = {}
        sink.settimeout(0.5)
        with pytest.raises(TimeoutError):
            while True:
                data, (_, port) = sink.recvfrom(4096)
                header, values = wire.unpack(data)
                assert port == ports[header.rank]
                assert (header.job_id, header.pool, header.round, header.seq) == (6, 0, 1, header.slot)
                assert header.flags == 0
                np.testing.assert_array_equal(values, header.rank + 1)
                got.setdefault((header.rank, header.slot), []).append(data)
    assert set(got) == {(r, s) for r in range(2) for s in range(3)}
    assert all(len(set(copies)) == 1 for copies in got.values())  # resends are the same bytes
    assert result["contributions_sent"] == 6
    assert result["gso"] is gso
    assert result["results_accepted"] == result["rounds_completed"] == 0
    assert result["retransmissions"] > 0
    assert sum(len(copies) for copies in got.values()) == 6 + result["retransmissions"]


def test_raw_round_trips_on_veth() -> None:
    result = limit_probe.raw_round_trips(window=8, seconds=0.3)
    if isinstance(result, str):
        pytest.skip(f"raw probe {result}")
    assert result["size"] == wire.FRAME_BYTES
    assert result["round_trips"] > 0


@pytest.mark.parametrize("gso", [False, True])
def test_veth_udp_round_trips(gso: bool) -> None:
    result = limit_probe.veth_udp_round_trips(window=64, seconds=0.3, gso=gso)
    if isinstance(result, str):
        pytest.skip(f"veth UDP probe {result}")
    assert result["gso"] is gso
    assert result["reflector"]["gro"] is gso
    assert result["round_trips"] > 0
    assert result["payload_errors"] == 0
    if gso:
        assert result["reflector"]["datagrams_per_buffer"] > 1  # GSO packets crossed the veth coalesced
    assert not [name for name in list_namespaces() if name.startswith(f"lv{os.getpid() % 100000}-")]


def test_netagg_drive_raw_frames_against_the_raw_reflector() -> None:
    ok, why = can_create_namespaces()
    if not ok:
        pytest.skip(f"raw netagg-drive: {why}")
    with VethRig(f"lt{os.getpid() % 100000}", 1) as rig:
        reflect = ["raw-reflect", "--ifname", rig.switch_interfaces()[1], "--netagg"]
        with limit_probe.reflector(reflect, rig.namespace):
            result = limit_probe.drive_switch_raw([rig.test_interfaces()[1]], ["10.88.0.1"], ["02:00:00:88:00:01"],
                                                  "10.88.0.254", "02:00:00:00:00:fe", slots=4, rounds=3,
                                                  namespace=rig.namespace)
    assert result["transport"] == "raw"
    assert result["rounds_completed"] == result["results_accepted"] == 3 * 4


def test_the_native_probe_states_the_wire_layout_of_netagg_wire() -> None:
    source = limit_probe.SOURCE.read_text()
    constants = dict(re.findall(r"\b(NETAGG_VERSION|NETAGG_HDR|K) = (\d+)", source))
    assert constants == {"NETAGG_VERSION": str(wire.VERSION), "NETAGG_HDR": str(wire.HEADER_BYTES), "K": str(wire.K)}
