"""Scapy layers for netagg, generated from ``netagg.wire.HEADER_FIELDS``.

``Ether()/IP()/UDP(dport=NETAGG_UDP_PORT)/Netagg(...)/NetaggValues(values=[...])``
builds a packet for PTF tests and debugging; UDP to the netagg port dissects as
netagg automatically.
"""

from __future__ import annotations

from collections.abc import Sequence

from scapy.fields import ByteField, FieldListField, IntField, ShortField, SignedByteField, SignedIntField
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

from netagg import wire

_FIELD_TYPES = {
    (8, False): ByteField,
    (8, True): SignedByteField,
    (16, False): ShortField,
    (32, False): IntField,
}


def _header_fields() -> list:
    defaults = {"version": wire.VERSION}
    return [_FIELD_TYPES[(f.bits, f.signed)](f.name, defaults.get(f.name, 0)) for f in wire.HEADER_FIELDS]


class Netagg(Packet):
    """The 24-byte netagg header."""

    name = "netagg"
    fields_desc = _header_fields()


def _value_count(pkt: Packet) -> int:
    """Values to dissect: as many as the netagg header's ``width`` code says (``K`` for an undefined code)."""
    header = pkt.underlayer
    return wire.WIDTHS.get(getattr(header, "width", 0), wire.K)


class NetaggValues(Packet):
    """The signed 32-bit values: ``K`` (narrow) or ``WIDE_K`` (wide), as the header's ``width`` says."""

    name = "netagg values"
    fields_desc = [
        FieldListField("values", [0] * wire.K, SignedIntField("v", 0), count_from=_value_count,
                       max_count=wire.WIDE_K),
    ]


bind_layers(UDP, Netagg, dport=wire.NETAGG_UDP_PORT)
bind_layers(UDP, Netagg, sport=wire.NETAGG_UDP_PORT)
bind_layers(UDP, Netagg, dport=wire.NETAGG_TREE_UDP_PORT)
bind_layers(Netagg, NetaggValues)


def netagg_payload(values: Sequence[int], **header: int) -> Packet:
    """``Netagg(**header)/NetaggValues(values)`` with values wrapped to int32.

    ``values``: ``K`` or ``WIDE_K`` of them; ``width`` defaults to their width's code (give it to build a
    packet whose code disagrees with its values, as a malformed-input test does).
    """
    if len(values) not in wire.WIDTH_CODES:
        raise ValueError(f"need exactly {' or '.join(map(str, sorted(wire.WIDTH_CODES)))} values, got {len(values)}")
    header.setdefault("width", wire.WIDTH_CODES[len(values)])
    wrapped = [((int(v) + 2**31) % 2**32) - 2**31 for v in values]
    return Netagg(**header) / NetaggValues(values=wrapped)
