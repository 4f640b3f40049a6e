"""The wire codec and its scapy mirror."""

import importlib

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from netagg import layout, wire
from netagg.scapy_layers import Netagg, NetaggValues, netagg_payload


def _header(**overrides):
    fields = dict(job_id=7, slot=513, pool=1, rank=31, seq=0xDEADBEEF, exponent=-3, flags=wire.FLAG_RETRANSMIT,
                  members=0x80000005, exchange=0xC0FFEE01)
    fields.update(overrides)
    return wire.Header(**fields)


def test_layout_sizes():
    assert wire.HEADER_BYTES == 24
    assert wire.NETAGG_BYTES == 24 + 4 * wire.K
    assert wire.FRAME_BYTES == 14 + 20 + 8 + wire.NETAGG_BYTES == 322
    assert wire.UDP_LENGTH == 8 + wire.NETAGG_BYTES


def test_pack_unpack_roundtrip_with_extremes():
    values = np.array([2**31 - 1, -(2**31), 0, -1] * (wire.K // 4), dtype=np.int32)
    header = _header()
    decoded_header, decoded = wire.unpack(wire.pack(header, values))
    assert decoded_header == header
    np.testing.assert_array_equal(decoded, values)
    assert decoded.dtype == np.int32


def test_network_byte_order():
    data = wire.pack(_header(job_id=0x0102, slot=0x0304, seq=0x05060708, members=0x090A0B0C, exchange=0x0D0E0F10),
                     np.arange(wire.K, dtype=np.int32))
    assert data[2:4] == b"\x01\x02"
    assert data[4:6] == b"\x03\x04"
    assert data[12:16] == b"\x05\x06\x07\x08"
    assert data[16:20] == b"\x09\x0a\x0b\x0c"
    assert data[20:24] == b"\x0d\x0e\x0f\x10"
    assert data[24:28] == b"\x00\x00\x00\x00" and data[28:32] == b"\x00\x00\x00\x01"
    assert data[8] == (-3) & 0xFF  # exponent, two's complement


@pytest.mark.parametrize("size", [0, 15, wire.NETAGG_BYTES - 1, wire.NETAGG_BYTES + 1,
                                  wire.netagg_bytes(wire.WIDE_K), 2000])
def test_wrong_size_is_malformed(size):
    payload = (_header().pack() + bytes(2000))[:size]  # a narrow header: the size must be its width's
    with pytest.raises(wire.MalformedPacket, match="bytes"):
        wire.unpack(payload)


@pytest.mark.parametrize("k", [wire.K, wire.WIDE_K])
def test_both_widths_round_trip_and_name_their_code(k):
    values = np.arange(-k // 2, k // 2, dtype=np.int32) * 1000
    data = wire.pack(_header(width=wire.width_code(k)), values)
    assert len(data) == wire.netagg_bytes(k) == wire.HEADER_BYTES + 4 * k
    assert wire.frame_bytes(k) == 14 + 20 + 8 + len(data)
    header, back = wire.unpack(data)
    assert header.width == wire.WIDTH_CODES[k] and wire.WIDTHS[header.width] == k
    np.testing.assert_array_equal(back, values)
    assert wire.cells_of(k) == k // wire.K


def test_widths_the_protocol_does_not_define_are_refused():
    for k in (0, 32, 128, 512):
        with pytest.raises(ValueError, match="values per packet"):
            wire.width_code(k)
    assert wire.payload_efficiency(k=wire.WIDE_K) > 0.9 > wire.payload_efficiency() > 0.7


def test_wrong_version_and_pool_are_malformed():
    values = np.zeros(wire.K, np.int32)
    with pytest.raises(wire.MalformedPacket, match="version"):
        wire.unpack(wire.pack(_header(version=wire.VERSION - 1), values))
    with pytest.raises(wire.MalformedPacket, match="pool"):
        wire.unpack(wire.pack(_header(pool=2), values))
    data = bytearray(wire.pack(_header(), values))
    data[wire.FIELD_OFFSETS["width"]] = 1  # a wide code on a narrow packet: the size is not the code's
    with pytest.raises(wire.MalformedPacket, match="bytes"):
        wire.unpack(bytes(data))
    data[wire.FIELD_OFFSETS["width"]] = 2  # a code the protocol does not define
    with pytest.raises(wire.MalformedPacket, match="width"):
        wire.unpack(bytes(data))


def test_exchange_ids_tell_order_size_and_tag_apart():
    ids = {wire.exchange_id(index, blocks, tag) for index in range(64) for blocks in range(1, 33) for tag in (0, 7)}
    assert len(ids) == 64 * 32 * 2  # no collision among neighbours
    assert wire.exchange_id(5, 10) == wire.exchange_id(5, 10, 0)  # deterministic: every rank computes the same
    assert all(0 <= i < 2**32 for i in ids)


def test_pack_rejects_wrong_value_count():
    with pytest.raises(ValueError, match="carries"):
        wire.pack(_header(), np.zeros(wire.K - 1, np.int32))
    with pytest.raises(ValueError, match="carries"):
        wire.pack(_header(width=1), np.zeros(wire.K, np.int32))


def test_scapy_layer_matches_codec():
    values = np.arange(-32, 32, dtype=np.int32)
    header = _header()
    fields = {f.name: getattr(header, f.name) for f in wire.HEADER_FIELDS}
    scapy_bytes = bytes(netagg_payload(values.tolist(), **fields))
    assert scapy_bytes == wire.pack(header, values)


def test_scapy_dissects_netagg_by_port():
    frame = Ether() / IP() / UDP(sport=1234, dport=wire.NETAGG_UDP_PORT) / netagg_payload([5] * wire.K, job_id=3)
    parsed = Ether(bytes(frame))
    assert parsed[Netagg].job_id == 3
    assert parsed[NetaggValues].values == [5] * wire.K
    assert len(parsed) == wire.FRAME_BYTES


def test_ipv4_checksum_matches_scapy():
    raw = bytes(IP(src="10.0.0.1", dst="10.0.0.2", ttl=9) / UDP())[:20]
    zeroed = raw[:10] + b"\x00\x00" + raw[12:]
    assert wire.ipv4_checksum(zeroed) == int.from_bytes(raw[10:12], "big")


def test_payload_efficiency():
    assert wire.payload_efficiency(0) == pytest.approx(256 / 322)
    assert 0.7 < wire.payload_efficiency() < wire.payload_efficiency(0)


def test_members_of_a_subset_round():
    assert wire.members_of([0, 2, 31]) == 0x80000005
    assert wire.members_of({3}) == 8
    with pytest.raises(ValueError, match="at least one"):
        wire.members_of([])
    with pytest.raises(ValueError, match="rank 32"):
        wire.members_of([1, 32])


def test_a_kernel_module_written_for_another_layout_fails_loudly():
    wire.check_compiled_layout("ok", wire.layout())
    with pytest.raises(RuntimeError, match="update the module"):
        wire.check_compiled_layout("stale", wire.layout().replace("exchange:32", "reserved:32"))  # a field renamed


def test_every_field_offset_follows_from_the_field_table_and_the_kernels_use_it():
    offset = 0
    for field in wire.HEADER_FIELDS:
        assert wire.FIELD_OFFSETS[field.name] == offset == layout.BY_FIELD[field.name]
        assert wire.HEADER_STRUCT.unpack_from(bytes(offset) + b"\x01" + bytes(wire.HEADER_BYTES), 0)[
            wire.FIELD_INDEX[field.name]] != 0  # the struct reads the field at that offset
        offset += field.bits // 8
    assert set(layout.BY_FIELD) == {f.name for f in wire.HEADER_FIELDS}
    # The compiled modules state the whole layout they were written for (imported here: they would raise).
    for module in ("netagg.softswitch.fastpath_kernels", "netagg.softswitch.fastpath_controls",
                   "netagg.softswitch.fastpath_defs", "netagg.softswitch.io_kernels",
                   "netagg.hoststack.transport_kernels",
                   "netagg.hoststack.codec_kernels"):
        pytest.importorskip("numba")
        importlib.import_module(module)
