"""The native limit probe and load generator (benchmarks/native/limit_probe.c): behaviour, never speed."""

from __future__ import annotations

import os
import re
import socket

import numpy as np
import pytest

from benchmarks import limit_probe
from netagg import wire
from netagg.bmv2.netns import VethRig, can_create_namespaces
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
    assert result["round_trips"] > 0
    assert result["reflector"]["received"] >= result["round_trips"]


def test_netagg_drive_completes_rounds_against_the_reflector() -> None:
    with limit_probe.netagg_reflector() as address:
        result = limit_probe.drive_switch_udp(address, free_ports(1), job_id=4, slots=8, rounds=5)
    assert result["workers"] == 1
    assert result["rounds_completed"] == 5 * 8
    assert result["results_accepted"] == result["contributions_sent"] == 5 * 8
    assert result["cpu_share"] >= 0.0


def test_netagg_drive_sends_switchml_rounds_and_retransmits() -> None:
    """Against a silent target: round 1 in pool 0 for every slot, then the same bytes again."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sink:
        sink.bind(("127.0.0.1", 0))
        sink.settimeout(5.0)
        ports = free_ports(2)
        result = limit_probe.drive_switch_udp(sink.getsockname(), ports, job_id=6, slots=3, seconds=0.2,
                                              rto_ms=20.0)
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
    assert result["results_accepted"] == result["rounds_completed"] == 0
    assert result["retransmissions"] > 0
    assert sum(len(copies) for copies in got.values()) == 6 + result["retransmissions"]


def test_raw_round_trips_on_veth() -> None:
    result = limit_probe.raw_round_trips(window=8, seconds=0.3)
    if isinstance(result, str):
        pytest.skip(f"raw probe {result}")
    assert result["size"] == wire.FRAME_BYTES
    assert result["round_trips"] > 0


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
