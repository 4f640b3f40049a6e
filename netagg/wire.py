"""The netagg wire format: the single source of truth.

Every part of netagg (host stack, software target, controller, tests) imports its
constants and codecs from here; ``p4src/shared/headers.p4`` and
``p4src/shared/defines.p4`` mirror them and ``tests/test_wire_p4_agreement.py``
checks that they agree.

A netagg packet is ``Ethernet / IPv4 (no options) / UDP (dst NETAGG_UDP_PORT) /
netagg header (24 bytes) / k signed 32-bit values``, all in network byte order, where k is the
packet's width: 64 (``K``) or 256 (``WIDE_K``), fixed per job (``width`` names it).
See ``docs/protocol.md`` for the meaning of every field.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

#: Protocol version carried in every header; other versions are dropped.
#: 2: the header gained ``members`` (subset rounds), 16 -> 20 bytes.
#: 3: ``exchange`` (which collective a contribution belongs to), ``width`` (values per packet: reserved for
#: wide packets), the non-finite and out-of-step flags; 20 -> 24 bytes.
#: 4: the ``CLOSE`` flag (deadline rounds: a member closes a round with the contributions that arrived; the
#: result says so and carries their bitmap in ``members``). Same header.
VERSION = 4
#: UDP destination port that marks a packet as netagg (below Linux's ephemeral range).
NETAGG_UDP_PORT = 28900
#: A tree of switches (docs/hierarchy.md): a switch's partials leave for its parent from this port, and the
#: parent's results come back to it; the switch parses packets to either port as netagg packets.
NETAGG_TREE_UDP_PORT = 28901
#: Values per narrow packet (SwitchML's 64), and per *cell*: the unit of switch memory (one value register
#: row per pool). A slot of a job of width k takes ``cells_of(k)`` consecutive cells.
K = 64
#: Values per wide packet (SwitchML's 256-element mode): 1 KB of payload, a quarter of the packets.
WIDE_K = 256
#: Largest number of workers in one job (one 32-bit bitmap word per slot and pool).
MAX_WORKERS = 32
#: Largest number of workers in a job over a tree of switches: 32 members per segment, three levels
#: (docs/hierarchy.md). Quantization leaves one bit of headroom per doubling of it.
MAX_JOB_WORKERS = MAX_WORKERS ** 3
#: Pool versions per slot (SwitchML's shadow copies).
NUM_POOLS = 2

# Flag bits.
FLAG_RESULT = 0x01  #: set by the switch (or PS) on an aggregated result
FLAG_RETRANSMIT = 0x02  #: set by a host on a resent contribution (informational)
FLAG_PS_FORWARDED = 0x04  #: set by a PS on results it computed in software (fallback)
#: The block holds a NaN (host), or some contribution to the round did (result).
FLAG_NAN = 0x08
#: The block holds +inf / -inf (host), or some contribution to the round did (result).
FLAG_POS_INF = 0x10
FLAG_NEG_INF = 0x20
#: Result: the round's contributions named different collectives (``exchange``), or a host aborted it
#: (an *abort contribution*, sent with this flag). No sum of such a round is ever used.
FLAG_OUT_OF_STEP = 0x40
#: Deadline rounds (docs/protocol.md, "Closing a round at a deadline"). On a contribution: close the round
#: with the contributions that have arrived (this one included). On a result: the round was closed before every
#: expected contribution arrived; its ``members`` field holds the bitmap of those in the sum.
FLAG_CLOSE = 0x80
#: The non-finite flags of a block (a host's contribution describes its own values).
NONFINITE_FLAGS = FLAG_NAN | FLAG_POS_INF | FLAG_NEG_INF
#: The flags a switch ORs over a round's contributions and returns in its result (``round_flags``).
ROUND_FLAGS = NONFINITE_FLAGS | FLAG_OUT_OF_STEP
#: What a switch keeps per round beside its exponent and sums, and sets on every packet that leaves with the
#: round's state (the ``round_flags`` register): the round flags and whether the round was closed.
STORED_FLAGS = ROUND_FLAGS | FLAG_CLOSE
KNOWN_FLAGS = FLAG_RESULT | FLAG_RETRANSMIT | FLAG_PS_FORWARDED | STORED_FLAGS

# ECN (RFC 3168) in the IPv4 header's two low TOS bits (docs/protocol.md, "Congestion marks").
ECN_MASK = 0x03
ECN_NOT_ECT = 0x00
#: What hosts send: ECN-capable transport; a queue on the way may turn it into CE instead of dropping.
ECN_ECT0 = 0x02
#: Congestion experienced: set by a queue on the way, by the aggregation switch on a round's result when any of
#: its contributions arrived with it, or by the switch's own egress queue.
ECN_CE = 0x03
#: Not a header flag: the bit of the switch's ``round_flags`` register that keeps "some contribution to this
#: round arrived CE-marked" (FLAG_RESULT's position, which the register never stores). A packet leaves with the
#: register's ``STORED_FLAGS`` in its flags and, with this bit set, ECN CE in its IPv4 header.
ROUND_CE = 0x01
#: ``width`` codes: values per packet. Any other code is MALFORMED; a packet whose width is not its job's
#: is refused (``WRONG_WIDTH``).
WIDTHS = {0: K, 1: WIDE_K}
#: The code of each width.
WIDTH_CODES = {k: code for code, k in WIDTHS.items()}

ETH_HEADER_BYTES = 14
IPV4_HEADER_BYTES = 20
UDP_HEADER_BYTES = 8
ETHERTYPE_IPV4 = 0x0800
IPPROTO_UDP = 17


class Field(NamedTuple):
    """One field of the netagg header."""

    name: str
    bits: int
    signed: bool
    doc: str


#: The netagg header, in wire order. headers.p4 declares exactly these fields.
HEADER_FIELDS: tuple[Field, ...] = (
    Field("version", 8, False, "protocol version, must equal VERSION"),
    Field("flags", 8, False, "RESULT / RETRANSMIT / PS_FORWARDED bits"),
    Field("job_id", 16, False, "tenant job id assigned by the controller (1..MAX_JOBS-1)"),
    Field("slot", 16, False, "job-relative aggregation slot index"),
    Field("pool", 8, False, "pool version of the slot, 0 or 1"),
    Field("rank", 8, False, "sender's rank within the job (0..MAX_WORKERS-1)"),
    Field("exponent", 8, True, "host: local max exponent; result: max over workers"),
    Field("width", 8, False, "values per packet: WIDTHS[width] (0: 64, 1: 256), the job's"),
    Field("round", 16, False, "the slot's round number: +1 at every new use of the slot (mod 2**16)"),
    Field("seq", 32, False, "block id chosen by the host, echoed unchanged"),
    Field("members", 32, False, "the round's expected contributors, bit r = rank r; 0 = every worker of the job"),
    Field("exchange", 32, False, "which collective the packet belongs to (exchange_id); a round's must agree"),
)

_STRUCT_CODES = {(8, False): "B", (8, True): "b", (16, False): "H", (32, False): "I"}
HEADER_STRUCT = struct.Struct("!" + "".join(_STRUCT_CODES[(f.bits, f.signed)] for f in HEADER_FIELDS))
HEADER_BYTES = HEADER_STRUCT.size
#: Position of each field in ``HEADER_STRUCT.unpack``'s tuple (the header grows at its end).
FIELD_INDEX = {f.name: i for i, f in enumerate(HEADER_FIELDS)}
#: Byte offset of each field in the header: what every kernel, the PS's aggregator and the steering programs
#: read and write (``netagg.layout`` names them for compiled code).
FIELD_OFFSETS = {f.name: sum(g.bits for g in HEADER_FIELDS[:i]) // 8 for i, f in enumerate(HEADER_FIELDS)}
assert HEADER_BYTES == sum(f.bits for f in HEADER_FIELDS) // 8 == 24
VALUE_BYTES = 4
#: Sizes of a narrow packet (``K`` values); ``netagg_bytes(k)`` and the functions beside it give any width's.
PAYLOAD_BYTES = K * VALUE_BYTES
#: Bytes after the UDP header: netagg header plus values.
NETAGG_BYTES = HEADER_BYTES + PAYLOAD_BYTES
UDP_LENGTH = UDP_HEADER_BYTES + NETAGG_BYTES
#: Steering (docs/protocol.md, "Steering"): receivers with several cores (switch shards, host threads) pick
#: a packet's core by (job_id + (slot >> SEGMENT_BLOCK_SHIFT)) mod cores, and a segmented (GSO) send is
#: steered once, by its first datagram: so one segmented send carries datagrams of one job and one block of
#: SEGMENT_BLOCK_SLOTS job-relative slots only.
SEGMENT_BLOCK_SHIFT = 6
SEGMENT_BLOCK_SLOTS = 1 << SEGMENT_BLOCK_SHIFT
IPV4_TOTAL_LENGTH = IPV4_HEADER_BYTES + UDP_LENGTH
FRAME_BYTES = ETH_HEADER_BYTES + IPV4_TOTAL_LENGTH
#: The largest frame of any width (receive buffers).
MAX_FRAME_BYTES = ETH_HEADER_BYTES + IPV4_HEADER_BYTES + UDP_HEADER_BYTES + HEADER_BYTES + WIDE_K * VALUE_BYTES


def width_code(k: int) -> int:
    """The ``width`` code of ``k`` values per packet; ValueError for a width the protocol does not define."""
    try:
        return WIDTH_CODES[k]
    except KeyError:
        raise ValueError(f"values per packet must be one of {sorted(WIDTH_CODES)}, got {k!r}") from None


def cells_of(k: int) -> int:
    """Switch memory of one slot of width ``k``, in cells of ``K`` values."""
    width_code(k)
    return k // K


def netagg_bytes(k: int) -> int:
    """Bytes after the UDP header of a packet of width ``k``."""
    return HEADER_BYTES + k * VALUE_BYTES


def udp_length(k: int) -> int:
    return UDP_HEADER_BYTES + netagg_bytes(k)


def ipv4_total_length(k: int) -> int:
    return IPV4_HEADER_BYTES + udp_length(k)


def frame_bytes(k: int) -> int:
    """A whole Ethernet frame (no FCS) of width ``k``."""
    return ETH_HEADER_BYTES + ipv4_total_length(k)

#: Values as they travel: big-endian signed 32-bit.
WIRE_VALUE_DTYPE = np.dtype(">i4")


class MalformedPacket(ValueError):
    """A datagram that is not a well-formed netagg message."""


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded netagg header."""

    job_id: int
    slot: int
    pool: int
    rank: int
    seq: int
    exponent: int = 0
    flags: int = 0
    version: int = VERSION
    width: int = 0
    round: int = 0
    members: int = 0
    exchange: int = 0

    @property
    def is_result(self) -> bool:
        return bool(self.flags & FLAG_RESULT)

    def pack(self) -> bytes:
        return HEADER_STRUCT.pack(*(getattr(self, f.name) for f in HEADER_FIELDS))


def pack(header: Header, values: np.ndarray) -> bytes:
    """Encode one netagg message (the UDP payload): header plus exactly ``WIDTHS[header.width]`` int32 values."""
    k = WIDTHS.get(header.width)
    if k is None or values.shape != (k,):
        raise ValueError(f"a netagg packet of width code {header.width} carries {k} values, got shape {values.shape}")
    return header.pack() + values.astype(WIRE_VALUE_DTYPE, copy=False).tobytes()


def unpack(payload: bytes | memoryview) -> tuple[Header, np.ndarray]:
    """Decode one netagg message; raises MalformedPacket on a wrong size, version, pool or width code."""
    if len(payload) < HEADER_BYTES:
        raise MalformedPacket(f"netagg message shorter than its {HEADER_BYTES}-byte header: {len(payload)} bytes")
    fields = HEADER_STRUCT.unpack_from(payload, 0)
    header = Header(**{f.name: v for f, v in zip(HEADER_FIELDS, fields, strict=True)})
    if header.version != VERSION:
        raise MalformedPacket(f"netagg version {header.version}, expected {VERSION}")
    k = WIDTHS.get(header.width)
    if k is None:
        raise MalformedPacket(f"width code {header.width} is not one of {sorted(WIDTHS)}")
    if len(payload) != netagg_bytes(k):
        raise MalformedPacket(f"netagg message of {k} values must be {netagg_bytes(k)} bytes, got {len(payload)}")
    if header.pool >= NUM_POOLS:
        raise MalformedPacket(f"pool {header.pool} out of range")
    values = np.frombuffer(payload, dtype=WIRE_VALUE_DTYPE, count=k, offset=HEADER_BYTES)
    return header, values.astype(np.int32)


def layout() -> str:
    """The wire layout as one line: version, values per packet and every header field (name:bits, ``s`` when
    signed), in wire order. Compiled kernels state the line they were written for (:func:`check_compiled_layout`)."""
    fields = ",".join(f"{f.name}:{f.bits}{'s' if f.signed else ''}" for f in HEADER_FIELDS)
    widths = ",".join(str(WIDTHS[c]) for c in sorted(WIDTHS))
    return f"v{VERSION} K={K} widths={widths} {fields}"


def check_compiled_layout(module: str, written_for: str) -> None:
    """Fail loudly when a numba kernel module was written for another wire layout.

    numba caches compiled kernels with the layout's offsets and constants baked in and invalidates the cache
    only when the kernel's own file changes; each kernel module therefore states the :func:`layout` it was
    written for (every field, not only the sizes), so that a change here forces an edit (and a recompile) there.
    """
    if written_for != layout():
        raise RuntimeError(f"{module} was written for the wire layout {written_for!r}; wire.py is {layout()!r}: "
                           "update the module (and so numba's cache of it)")


_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that spreads every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def exchange_id(index: int, num_blocks: int, tag: int = 0) -> int:
    """The ``exchange`` field of a collective: a 32-bit digest of its order, size and caller's tag.

    ``index``: the collective's number among the worker's collectives (every rank counts alike, a call that
    failed before sending included); ``num_blocks``: its size in packets' worth of values; ``tag``: anything
    the caller names the collective by (0: none). Ranks out of step — one skipped or failed a call, or called
    with another size — give different ids with probability 1 - 2**-32, and the switch refuses to sum
    contributions of different ids in one round (docs/protocol.md, "Collectives out of step").
    """
    h = _mix64((index & _MASK64) ^ _MIX)
    h = _mix64(h ^ (num_blocks & _MASK64))
    h = _mix64(h ^ (tag & _MASK64))
    return h & 0xFFFFFFFF


def members_of(ranks) -> int:
    """The ``members`` field of a subset round whose expected contributors are ``ranks``."""
    mask = 0
    for rank in ranks:
        if not 0 <= rank < MAX_WORKERS:
            raise ValueError(f"rank {rank} not in 0..{MAX_WORKERS - 1}")
        mask |= 1 << rank
    if not mask:
        raise ValueError("a subset round needs at least one member")
    return mask


def ipv4_checksum(header: bytes) -> int:
    """The IPv4 header checksum (csum16) of a 20-byte header whose checksum field is zero."""
    total = sum(struct.unpack("!10H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def payload_efficiency(ethernet_overhead: int = 24, k: int = K) -> float:
    """Share of gradient payload in each frame of width ``k`` on the wire.

    ``ethernet_overhead`` counts what the frame bytes leave out: preamble and
    start delimiter (8), frame check sequence (4) and inter-frame gap (12).
    """
    return k * VALUE_BYTES / (frame_bytes(k) + ethernet_overhead)
