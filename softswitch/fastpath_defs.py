"""The compiled program's constants and byte helpers: header offsets (from :mod:`netagg.layout`), counter and
drop-reason indices (from :mod:`netagg.dataplane`), and the big-endian reads, writes and copies every kernel of
the software target uses (:mod:`.fastpath_controls`, :mod:`.fastpath_kernels`, :mod:`.io_kernels`)."""

from __future__ import annotations

import numpy as np
from numba import njit

from netagg import dataplane as dp
from netagg import layout, wire
from netagg.dataplane import DropReason, Level, ValueOp
from netagg.slots import RoundState

wire.check_compiled_layout(__name__, "v4 K=64 widths=64,256 version:8,flags:8,job_id:16,slot:16,pool:8,rank:8,"
                                     "exponent:8s,width:8,round:16,seq:32,members:32,exchange:32")

K = wire.K
WIDE = wire.WIDTH_CODES[wire.WIDE_K]
WIDE_CELLS = wire.cells_of(wire.WIDE_K)
NETAGG_PORT = wire.NETAGG_UDP_PORT
TREE_PORT = wire.NETAGG_TREE_UDP_PORT
IPV4_TOTAL_LENGTH = wire.IPV4_TOTAL_LENGTH
UDP_LENGTH = wire.UDP_LENGTH
FRAME_BYTES = wire.FRAME_BYTES
WIDE_IPV4_TOTAL_LENGTH = wire.ipv4_total_length(wire.WIDE_K)
WIDE_UDP_LENGTH = wire.udp_length(wire.WIDE_K)
WIDE_FRAME_BYTES = wire.frame_bytes(wire.WIDE_K)
FLAG_RESULT = wire.FLAG_RESULT
FLAG_OUT_OF_STEP = wire.FLAG_OUT_OF_STEP
ROUND_FLAGS = wire.ROUND_FLAGS
NOT_ROUND_FLAGS = 0xFF & ~wire.ROUND_FLAGS
FLAG_CLOSE = wire.FLAG_CLOSE
NOT_STORED_FLAGS = 0xFF & ~wire.STORED_FLAGS
STORED_FLAGS = wire.STORED_FLAGS
ROUND_CE = wire.ROUND_CE
ECN_MASK = wire.ECN_MASK
ECN_CE = wire.ECN_CE
VERSION = wire.VERSION
DROP_PORT = dp.DROP_PORT
POOLS = wire.NUM_POOLS
RESULT_TTL = 64
HASH_MULT = np.uint64(0x9E3779B97F4A7C15)

# Offsets in a frame (Ethernet / IPv4 without options / UDP / netagg), and of the netagg header's fields in it
# (netagg.layout, from wire.HEADER_FIELDS).
IP, UDP, NA = 14, 34, 42
NA_VERSION, FLAGS, JOB, SLOT, POOL, RANK = (NA + layout.VERSION_AT, NA + layout.FLAGS_AT, NA + layout.JOB_AT,
                                            NA + layout.SLOT_AT, NA + layout.POOL_AT, NA + layout.RANK_AT)
EXPONENT, WIDTH, ROUND, SEQ, MEMBERS, EXCHANGE = (NA + layout.EXPONENT_AT, NA + layout.WIDTH_AT,
                                                  NA + layout.ROUND_AT, NA + layout.SEQ_AT, NA + layout.MEMBERS_AT,
                                                  NA + layout.EXCHANGE_AT)
VALUES = NA + layout.VALUES_AT

# Counter indices in the ``counters`` tuple (see fastpath.COUNTERS).
C_DROPS, C_EGRESS_DROPS, C_CONTRIB, C_RESULTS, C_DUPS, C_RETX, C_REJECTS = 0, 1, 2, 3, 4, 5, 6
# ... and of each counter's (packets, bytes) arrays in the flat ``counters`` tuple. Module-level ints are constants
# to numba, so ``counters[P_REJECTS]`` is a static index (see _bump).
P_DROPS, B_DROPS = 2 * C_DROPS, 2 * C_DROPS + 1
P_EGRESS_DROPS, B_EGRESS_DROPS = 2 * C_EGRESS_DROPS, 2 * C_EGRESS_DROPS + 1
P_CONTRIB, B_CONTRIB = 2 * C_CONTRIB, 2 * C_CONTRIB + 1
P_RESULTS, B_RESULTS = 2 * C_RESULTS, 2 * C_RESULTS + 1
P_DUPS, B_DUPS = 2 * C_DUPS, 2 * C_DUPS + 1
P_RETX, B_RETX = 2 * C_RETX, 2 * C_RETX + 1
P_REJECTS, B_REJECTS = 2 * C_REJECTS, 2 * C_REJECTS + 1

D_NONE = int(DropReason.NONE)
D_NOT_IPV4 = int(DropReason.NOT_IPV4)
D_NO_ROUTE = int(DropReason.NO_ROUTE)
D_TTL = int(DropReason.TTL_EXPIRED)
D_MALFORMED = int(DropReason.MALFORMED)
D_BAD_VERSION = int(DropReason.BAD_VERSION)
D_RESULT_FROM_HOST = int(DropReason.RESULT_FROM_HOST)
D_UNKNOWN_JOB = int(DropReason.UNKNOWN_JOB)
D_UNKNOWN_WORKER = int(DropReason.UNKNOWN_WORKER)
D_SLOT_RANGE = int(DropReason.SLOT_OUT_OF_RANGE)
D_BAD_POOL = int(DropReason.BAD_POOL)
D_RANK = int(DropReason.RANK_MISMATCH)
D_NO_REPLICA = int(DropReason.NO_REPLICA)
D_SPOOFED = int(DropReason.SPOOFED_SOURCE)
D_NOT_MEMBER = int(DropReason.NOT_A_MEMBER)
D_MEMBERS = int(DropReason.MEMBERS_MISMATCH)
D_EXCHANGE = int(DropReason.EXCHANGE_MISMATCH)
D_WRONG_WIDTH = int(DropReason.WRONG_WIDTH)
D_CLOSE_REFUSED = int(DropReason.CLOSE_REFUSED)
D_LATE_CLOSED = int(DropReason.LATE_FOR_CLOSED_ROUND)
LEVEL_OPEN, LEVEL_UP, LEVEL_FINAL = int(Level.OPEN), int(Level.UP), int(Level.FINAL)
FLAG_RETRANSMIT = wire.FLAG_RETRANSMIT
OP_NONE, OP_WRITE, OP_MERGE, OP_READ = int(ValueOp.NONE), int(ValueOp.WRITE), int(ValueOp.MERGE), int(ValueOp.READ)
ROUND_SAME, ROUND_NEW, ROUND_OLD = int(RoundState.SAME), int(RoundState.NEW), int(RoundState.OLD)
#: Actions of the sources table as compiled.
SRC_SWITCH_ONLY, SRC_BIND = 1, 2
BLOCK_SHIFT = wire.SEGMENT_BLOCK_SHIFT


@njit(cache=True, inline="always")
def _u16(b, i):
    return (np.int64(b[i]) << 8) | np.int64(b[i + 1])


@njit(cache=True, inline="always")
def _u32(b, i):
    return (np.int64(b[i]) << 24) | (np.int64(b[i + 1]) << 16) | (np.int64(b[i + 2]) << 8) | np.int64(b[i + 3])


@njit(cache=True, inline="always")
def _put16(b, i, v):
    b[i] = (v >> 8) & 0xFF
    b[i + 1] = v & 0xFF


@njit(cache=True, inline="always")
def _put32(b, i, v):
    b[i] = (v >> 24) & 0xFF
    b[i + 1] = (v >> 16) & 0xFF
    b[i + 2] = (v >> 8) & 0xFF
    b[i + 3] = v & 0xFF


@njit(cache=True, inline="always")
def _copy(dst, d0, src, s0, n):
    """``dst[d0:d0+n] = src[s0:s0+n]`` as a loop over views that start at 0: numba's slice assignment checks
    for overlap and copies through a temporary array (about 15x slower for a frame), and a loop indexing
    both arrays with offsets is not vectorized (8x slower)."""
    d = dst[d0:d0 + n]
    s = src[s0:s0 + n]
    for j in range(n):
        d[j] = s[j]


@njit(cache=True, inline="always")
def _bump(packets, byte_counts, index, nbytes):
    """Count one packet of ``nbytes`` at ``index`` of a counter's (packets, bytes) arrays.

    Callers pick the arrays out of the ``counters`` tuple with constant indices (P_x, B_x = 2 * C_x, 2 * C_x + 1):
    a computed index into a tuple of arrays makes numba copy the whole tuple onto the stack at every
    use, which cost more than the rest of a dropped packet's path."""
    if 0 <= index < packets.shape[0]:
        packets[index] += 1
        byte_counts[index] += nbytes


@njit(cache=True, inline="always")
def _slot_of(key, mask):
    return np.int64((np.uint64(key) * HASH_MULT) >> np.uint64(40)) & mask


@njit(cache=True, inline="always")
def _ipv4_checksum(b):
    """NetaggComputeChecksum: csum16 over the 20-byte header with the checksum field zero."""
    b[IP + 10] = 0
    b[IP + 11] = 0
    total = 0
    for i in range(IP, IP + 20, 2):
        total += (np.int64(b[i]) << 8) | np.int64(b[i + 1])
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    _put16(b, IP + 10, ~total & 0xFFFF)


@njit(cache=True, inline="always")
def _emit(work, length, port, out_buf, out_len, out_port, n):
    _copy(out_buf[n], 0, work, 0, length)
    out_len[n] = length
    out_port[n] = port
    return n + 1
