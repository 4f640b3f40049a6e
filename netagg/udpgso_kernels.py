"""Compiled twins of :mod:`netagg.udpgso`'s per-batch loops (used when numba is installed).

A wake-up of the host stack often sends or receives only a few datagrams, so the few
microseconds of numpy calls per batch would cost more than the system call they save.
Each function here does exactly what its reference in :mod:`netagg.udpgso` does
(``tests/test_udpgso.py`` compares them); without numba the references run.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from netagg import wire

_SOL_UDP = 17
_UDP_GRO = 104
_SOL_IP = 0
_IP_TOS = 1
_ECN_MASK = wire.ECN_MASK
_ECN_CE = wire.ECN_CE


@njit(cache=True, nogil=True, inline="always")
def gso_header(hdr_words, h, name_addr, name_len, iov_addr, first, size, ctrl_addr, ctrl_bytes, ctrl_size,
               segment):  # pragma: no cover - compiled
    """Message header ``h``: ``size`` segments of ``segment`` bytes from iovec ``first`` on, to the name at
    ``name_addr`` (0: the connected peer), with a UDP_SEGMENT control message when it holds more than one."""
    hdr_words[h, 0] = name_addr
    hdr_words[h, 1] = name_len
    hdr_words[h, 2] = iov_addr + np.uint64(16 * first)
    hdr_words[h, 3] = size
    if size > 1:
        hdr_words[h, 4] = ctrl_addr + np.uint64(ctrl_bytes * h)
        hdr_words[h, 5] = ctrl_bytes
    else:
        hdr_words[h, 4] = 0
        hdr_words[h, 5] = 0
    ctrl_size[h] = segment


@njit(cache=True, nogil=True)
def plan_uniform(addresses, length, per, name_addr, name_len, iov_words, hdr_words, ctrl_size, iov_addr,
                 ctrl_addr, ctrl_bytes, keys):  # pragma: no cover - compiled
    """See ``udpgso._plan_uniform_reference``."""
    n = addresses.shape[0]
    for j in range(n):
        iov_words[j, 0] = addresses[j]
        iov_words[j, 1] = length
    headers = 0
    first = 0
    while first < n:
        size = 1
        while size < per and first + size < n and keys[first + size] == keys[first]:
            size += 1
        gso_header(hdr_words, headers, name_addr, name_len, iov_addr, first, size, ctrl_addr, ctrl_bytes,
                   ctrl_size, length)
        headers += 1
        first += size
    return headers


@njit(cache=True, nogil=True)
def segment_sizes(ctrl, words32, count, sizes, tos):  # pragma: no cover - compiled
    """See ``udpgso._segment_sizes_reference``."""
    marked = 0
    for m in range(count):
        length = np.int64(words32[m, 14])
        used = min(np.int64(words32[m, 10]), np.int64(ctrl.shape[1]))
        size = max(length, np.int64(1))
        tos[m] = -1
        offset = 0
        while offset + 16 <= used:
            c = ctrl[m]
            cmsg_len = np.int64(0)
            for b in range(8):
                cmsg_len |= np.int64(c[offset + b]) << np.int64(8 * b)
            level = np.int64(c[offset + 8]) | (np.int64(c[offset + 9]) << 8) | (np.int64(c[offset + 10]) << 16) \
                | (np.int64(c[offset + 11]) << 24)
            kind = np.int64(c[offset + 12]) | (np.int64(c[offset + 13]) << 8) | (np.int64(c[offset + 14]) << 16) \
                | (np.int64(c[offset + 15]) << 24)
            if level == _SOL_UDP and kind == _UDP_GRO and 20 <= cmsg_len <= used - offset:
                value = np.int64(c[offset + 16]) | (np.int64(c[offset + 17]) << 8) \
                    | (np.int64(c[offset + 18]) << 16) | (np.int64(c[offset + 19]) << 24)
                if 0 < value < 0x80000000:  # the reference reads a signed int: negatives are ignored
                    size = value
            elif level == _SOL_IP and kind == _IP_TOS and 17 <= cmsg_len <= used - offset:
                tos[m] = np.int64(c[offset + 16])
            if cmsg_len < 16 or cmsg_len > used - offset:
                break
            offset += (cmsg_len + 7) & ~np.int64(7)
        sizes[m] = size
        if tos[m] >= 0 and (tos[m] & _ECN_MASK) == _ECN_CE:
            marked += max(np.int64(1), -(-length // size))
    return marked


@njit(cache=True, nogil=True)
def split(big, words32, sizes, rx_names, count, state, buf, lengths, names, first, room,
          headroom):  # pragma: no cover - compiled
    """See ``udpgso._split_reference``."""
    row = first
    end_row = first + room
    width = buf.shape[1] - headroom
    m = state[0]
    offset = state[1]
    while m < count and row < end_row:
        end = np.int64(words32[m, 14])
        if end == 0:
            lengths[row] = 0
            for b in range(rx_names.shape[1]):
                names[row, b] = rx_names[m, b]
            row += 1
            m += 1
            offset = 0
            continue
        size = sizes[m]
        src = big[m]
        name = rx_names[m]
        while offset < end and row < end_row:
            seg = min(size, end - offset)
            copy = min(seg, width)
            # A loop over views that start at 0: numba's slice assignment goes through a temporary array,
            # and a loop with offsets on both sides is not vectorized (8x slower either way).
            dst = buf[row, headroom:headroom + copy]
            part = src[offset:offset + copy]
            for b in range(copy):
                dst[b] = part[b]
            lengths[row] = copy
            out = names[row]
            for b in range(name.shape[0]):
                out[b] = name[b]
            row += 1
            offset += seg
        if offset >= end:
            m += 1
            offset = 0
    state[0] = m
    state[1] = offset
    return row - first
