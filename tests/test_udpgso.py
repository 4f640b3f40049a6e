"""UDP GSO sends and GRO receives (netagg.udpgso): compiled kernels against their references, real loopback
sockets (kernel-split and coalesced receives, small batches, headroom), the fallback when the kernel refuses
segmentation (for real: SO_NO_CHECK), and the worker transport end to end on each path."""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import time

import numpy as np
import pytest

from netagg import mmsg, udpgso, wire
from netagg.testing.hoststack import LOCALHOST, expected_allreduce, fallback_job, run_workers

try:
    from netagg import udpgso_kernels as kernels
except ImportError:  # numba missing (extra "fast"): only the references run
    kernels = None

needs_kernels = pytest.mark.skipif(kernels is None, reason="numba is not installed: no compiled twins to compare")
needs_mmsg = pytest.mark.skipif(not mmsg.AVAILABLE, reason="recvmmsg/sendmmsg are not available here")
IMPLS = ["reference", pytest.param("compiled", marks=needs_kernels)]

#: SO_NO_CHECK (asm-generic socket.h): no UDP checksum on sends, so the kernel refuses UDP_SEGMENT (EINVAL).
SO_NO_CHECK = 11
SEED_COUNT = 40


# -- differential: compiled kernels vs references ---------------------------------------------------------------

def _gso_arrays(capacity: int, rng: np.random.Generator):
    """iov/hdr words and the control block (its strided u2 size view as in GsoBatch), filled with noise."""
    iov_words = rng.integers(0, 2**63, (capacity, 2), dtype=np.uint64)
    hdr_words = rng.integers(0, 2**63, (capacity, 8), dtype=np.uint64)
    ctrl = rng.integers(0, 256, (capacity, udpgso.CONTROL_BYTES), dtype=np.uint8)
    return iov_words, hdr_words, ctrl


def _plan_both(addresses, length, per, name, iov_addr, ctrl_addr, arrays, keys):
    """Run reference and kernel on identical copies of ``arrays``; returns both (count, iov, hdr, ctrl)."""
    out = []
    for plan in (udpgso._plan_uniform_reference, kernels.plan_uniform):
        iov_words, hdr_words, ctrl = (a.copy() for a in arrays)
        ctrl_size = ctrl.view("<u2")[:, 8]
        count = plan(addresses, length, per, name[0], name[1], iov_words, hdr_words, ctrl_size, iov_addr,
                     ctrl_addr, udpgso.CONTROL_BYTES, keys)
        out.append((count, iov_words, hdr_words, ctrl))
    return out


def _runs(keys, per) -> list[int]:
    """Sizes of the runs a plan must make: equal keys, at most ``per`` each (written independently)."""
    sizes: list[int] = []
    for j, key in enumerate(keys.tolist()):
        if sizes and sizes[-1] < per and keys[j - 1] == key:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return sizes


def _check_plan(addresses, length, per, name, iov_addr, ctrl_addr, before, after, keys) -> None:
    """What the reference must have written (independently of the kernel)."""
    count, iov_words, hdr_words, ctrl = after
    n = addresses.shape[0]
    runs = _runs(keys, per)
    assert count == len(runs)
    np.testing.assert_array_equal(iov_words[:n, 0], addresses)
    assert np.all(iov_words[:n, 1] == length)
    np.testing.assert_array_equal(iov_words[n:], before[0][n:])  # nothing past the segments
    np.testing.assert_array_equal(hdr_words[count:], before[1][count:])
    first = 0
    for h in range(count):
        size = runs[h]
        assert hdr_words[h, :4].tolist() == [name[0], name[1], int(iov_addr) + 16 * first, size]
        if size > 1:
            assert hdr_words[h, 4:6].tolist() == [int(ctrl_addr) + udpgso.CONTROL_BYTES * h, udpgso.CONTROL_BYTES]
        else:
            assert hdr_words[h, 4:6].tolist() == [0, 0]
        assert int(ctrl[h].view("<u2")[8]) == length
        first += size
    np.testing.assert_array_equal(np.delete(ctrl, [16, 17], axis=1), np.delete(before[2], [16, 17], axis=1))


@needs_kernels
@pytest.mark.parametrize("n", [0, 1, 2, 63, 64, 65, 127, 128, 129, 200])
@pytest.mark.parametrize("length", [1, 276, 1400, 9000])
def test_plan_uniform_kernel_matches_reference(n, length):
    rng = np.random.default_rng(n * 10007 + length)
    capacity = 210
    gso_per = max(1, min(udpgso.MAX_SEGMENTS, udpgso.MAX_SEND_BYTES // length))
    for per in sorted({gso_per, 1, 64, 128, int(rng.integers(1, 130))}):
        for name in ((0, 0), (int(rng.integers(1, 2**47)), 16)):
            addresses = rng.integers(0, 2**63, n, dtype=np.uint64)
            iov_addr, ctrl_addr = np.uint64(rng.integers(1, 2**47)), np.uint64(rng.integers(1, 2**47))
            arrays = _gso_arrays(capacity, rng)
            # No steering breaks, a block every 64 slots from a random start, and random keys.
            start = int(rng.integers(0, 200))
            for keys in (np.zeros(n, np.int64), (np.arange(start, start + n) >> 6).astype(np.int64),
                         rng.integers(0, 3, n).astype(np.int64)):
                ref, compiled = _plan_both(addresses, length, per, name, iov_addr, ctrl_addr, arrays, keys)
                assert ref[0] == compiled[0]
                for a, b in zip(ref[1:], compiled[1:]):
                    np.testing.assert_array_equal(a, b)
                _check_plan(addresses, length, per, name, iov_addr, ctrl_addr, arrays, ref, keys)


@needs_mmsg
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("length", "per"), [(1, 64), (276, 64), (1400, 46), (9000, 7), (65000, 1)])
def test_gso_batch_plan_caps_runs_at_64_segments_and_max_send_bytes(impl, length, per):
    gso = _use(udpgso.GsoBatch(200), impl)
    gso.refused = None  # whatever the self-test said: the plan of a segmenting batch
    addresses = np.arange(200, dtype=np.uint64) * np.uint64(7)
    headers = gso.plan_uniform(addresses, length)
    assert headers == -(-200 // per)
    assert gso.hdr_words[:headers, 3].max() == per
    assert int(gso.hdr_words[:headers, 3].sum()) == 200
    assert per == 1 or per * length <= udpgso.MAX_SEND_BYTES
    assert gso.plan_uniform(addresses, 276, max_segments=10) == 20
    # A run never spans two steering blocks (slots 32..231: blocks 0..3 cut at 64, 128, 192).
    blocks = (np.arange(32, 232) >> 6).astype(np.int64)
    if per >= 64:
        assert gso.plan_uniform(addresses, length, keys=blocks) == 4
        assert gso.hdr_words[:4, 3].tolist() == [32, 64, 64, 40]
    gso.refused = "refused"  # after a refusal: one segment per header, no control message
    assert gso.plan_uniform(addresses, 276) == 200
    assert np.all(gso.hdr_words[:200, 3] == 1) and np.all(gso.hdr_words[:200, 4:6] == 0)
    assert gso.plan_uniform(addresses[:0], 276) == 0


def _cmsg(level: int, kind: int, length: int, value: bytes = b"") -> bytes:
    """One control message (cmsghdr + data), padded to 8 bytes like CMSG_SPACE."""
    raw = length.to_bytes(8, "little") + level.to_bytes(4, "little", signed=True) \
        + kind.to_bytes(4, "little", signed=True) + value
    return raw + bytes(-len(raw) % 8)


def _gro(size: int) -> bytes:
    return _cmsg(udpgso.SOL_UDP, udpgso.UDP_GRO, 20, size.to_bytes(4, "little", signed=True))


def _control_cases(rng: np.random.Generator, count: int):
    """Per message: (control bytes, msg_controllen) of a random kind; GRO sizes include 0 and negatives."""
    pktinfo = _cmsg(0, 8, 28, bytes(12))  # IP_PKTINFO: 32 bytes padded
    for _ in range(count):
        size = int(rng.choice([1, 276, 1400, 9000, 65535, int(rng.integers(1, 70000))]))
        kind = int(rng.integers(0, 13))
        if kind == 0:
            raw, used = _gro(size), 24
        elif kind == 1:
            raw, used = b"", 0  # no control message: the whole message is one datagram
        elif kind == 2:
            raw = pktinfo + _gro(size)
            used = len(raw)
        elif kind == 3:
            raw = _cmsg(0, 2, 20, bytes(4))  # IP_TTL only
            used = len(raw)
        elif kind == 4:
            raw = _cmsg(0, 7, 17, b"\x01") + _gro(size)  # odd length: the next one starts 8-aligned
            used = len(raw)
        elif kind == 5:
            raw, used = _gro(size), int(rng.integers(0, 20))  # truncated controllen
        elif kind == 6:
            raw = _cmsg(udpgso.SOL_UDP, udpgso.UDP_GRO, int(rng.integers(0, 20)), size.to_bytes(4, "little"))
            used = 24  # a GRO cmsg too short to hold its value
        elif kind == 7:
            raw, used = _cmsg(0, 2, 0) + _gro(size), 40  # cmsg_len 0: parsing stops
        elif kind == 8:
            raw, used = _gro(0), 24
        elif kind == 9:
            raw, used = _gro(int(rng.choice([-1, -276, -(2**31)]))), 24  # negative size: ignored
        elif kind == 10:
            raw = _cmsg(udpgso.SOL_UDP, 1, 20, bytes(4)) + _gro(size)  # UDP level, another type, first
            used = len(raw)
        elif kind == 11:
            raw = _gro(size) + _cmsg(udpgso.SOL_IP, udpgso.IP_TOS, 17, bytes([size & 0xFF]))  # IP_RECVTOS's
            used = len(raw)
        else:  # garbage, with cmsg_len words below 2**62 (what any kernel could write is far below that)
            raw = rng.integers(0, 256, udpgso.RX_CONTROL_BYTES, dtype=np.uint8)
            raw[7::8] &= 0x3F
            raw, used = raw.tobytes(), int(rng.integers(0, udpgso.RX_CONTROL_BYTES + 1))
        assert len(raw) <= udpgso.RX_CONTROL_BYTES
        yield raw, used, kind, size


@needs_kernels
@pytest.mark.parametrize("seed", range(SEED_COUNT))
def test_segment_sizes_kernel_matches_reference(seed):
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 40))
    ctrl = rng.integers(0, 256, (count, udpgso.RX_CONTROL_BYTES), dtype=np.uint8)
    words32 = rng.integers(0, 2**32, (count, 16), dtype=np.uint64).astype(np.uint32)
    expected = {}
    kinds = {}
    for m, (raw, used, kind, size) in enumerate(_control_cases(rng, count)):
        kinds[m] = kind
        ctrl[m, :len(raw)] = np.frombuffer(raw, np.uint8)
        words32[m, 10] = used
        words32[m, 14] = int(rng.choice([0, 1, 276, 9000, 65535, int(rng.integers(0, 65536))]))
        whole = max(int(words32[m, 14]), 1)
        if kind in (0, 2, 4, 10, 11):
            expected[m] = size
        elif kind == 12 or (kind == 5 and used >= 16):  # garbage; a header whose value lies past controllen
            expected[m] = None
        else:
            expected[m] = whole
    ref = np.full(count + 3, -7, np.int64)
    compiled, ref_tos, compiled_tos = ref.copy(), ref.copy(), ref.copy()
    ref_marked = udpgso._segment_sizes_reference(ctrl, words32, count, ref, ref_tos)
    compiled_marked = kernels.segment_sizes(ctrl, words32, count, compiled, compiled_tos)
    assert ref_marked == compiled_marked
    np.testing.assert_array_equal(ref, compiled)
    np.testing.assert_array_equal(ref_tos, compiled_tos)
    assert ref[count:].tolist() == ref_tos[count:].tolist() == [-7] * 3
    for m, size in expected.items():
        if size is not None:
            assert ref[m] == size, (m, ctrl[m], words32[m])
            assert ref_tos[m] == (size & 0xFF if kinds[m] == 11 else -1)


def _split_case(rng: np.random.Generator):
    count = int(rng.integers(1, 9))
    stride = int(rng.choice([8, 64, 300, 1500]))
    headroom = int(rng.choice([0, 0, min(14, stride - 1), stride // 2]))  # rows keep some room
    sizes = np.array([int(rng.choice([1, 3, 64, 276, 1400, 9000, int(rng.integers(1, 2000))]))
                      for _ in range(count)], np.int64)
    lens = []
    for size in sizes.tolist():
        segs = int(rng.integers(1, min(60, 9000 // size + 2) + 1))
        kind = int(rng.integers(0, 5))
        if kind == 0:
            lens.append(0)
        elif kind == 1:
            lens.append(size * segs)  # whole segments
        elif kind == 2:
            lens.append(size * (segs - 1) + int(rng.integers(1, size + 1)))  # the last one shorter
        elif kind == 3:
            lens.append(int(rng.integers(1, size + 1)))  # a single (maybe short) datagram
        else:
            lens.append(int(rng.integers(0, size * segs + 1)))
    big = rng.integers(0, 256, (count, max(max(lens), 1) + 5), dtype=np.uint8)
    words32 = rng.integers(0, 2**32, (count, 16), dtype=np.uint64).astype(np.uint32)
    words32[:, 14] = lens
    rx_names = rng.integers(0, 256, (count, mmsg.NAME_BYTES), dtype=np.uint8)
    rows = int(rng.integers(1, 150))
    return count, stride, headroom, sizes, lens, big, words32, rx_names, rows


def _expected_segments(lens, sizes, big, rx_names, width):
    out = []
    for m, (end, size) in enumerate(zip(lens, sizes.tolist())):
        if end == 0:
            out.append((b"", bytes(rx_names[m])))
        for offset in range(0, end, size):
            out.append((bytes(big[m, offset:min(offset + size, end)][:width]), bytes(rx_names[m])))
    return out


@pytest.mark.parametrize("seed", range(SEED_COUNT))
def test_split_kernel_matches_reference_across_calls(seed):
    rng = np.random.default_rng(1000 + seed)
    count, stride, headroom, sizes, lens, big, words32, rx_names, rows = _split_case(rng)
    width = stride - headroom
    buf = rng.integers(0, 256, (rows, stride), dtype=np.uint8)
    lengths = rng.integers(0, 2**32, rows, dtype=np.uint64).astype(np.uint32)
    names = rng.integers(0, 256, (rows, mmsg.NAME_BYTES), dtype=np.uint8)
    ref = [np.zeros(2, np.int64), buf, lengths, names]
    compiled = [a.copy() for a in ref] if kernels is not None else None
    got = []
    for _ in range(100_000):
        if ref[0][0] >= count:
            break
        first = int(rng.integers(0, rows))
        room = int(rng.integers(0, rows - first + 1))
        before = ref[1].copy()
        filled = udpgso._split_reference(big, words32, sizes, rx_names, count, ref[0], ref[1], ref[2], ref[3],
                                         first, room, headroom)
        assert 0 <= filled <= room
        for row in range(first, first + filled):
            length = int(ref[2][row])
            got.append((bytes(ref[1][row, headroom:headroom + length]), bytes(ref[3][row])))
            before[row, headroom:headroom + length] = ref[1][row, headroom:headroom + length]
        np.testing.assert_array_equal(ref[1], before)  # headroom, row tails and other rows untouched
        if compiled is not None:
            done = kernels.split(big, words32, sizes, rx_names, count, compiled[0], compiled[1], compiled[2],
                                 compiled[3], first, room, headroom)
            assert done == filled
            for a, b in zip(ref, compiled):
                np.testing.assert_array_equal(a, b)
    assert ref[0].tolist() == [count, 0]
    assert got == _expected_segments(lens, sizes, big, rx_names, width)


# -- real sockets on loopback ----------------------------------------------------------------------------------

def _use(batch, impl: str):
    """Make ``batch`` run the references or the compiled kernels."""
    compiled = impl == "compiled"
    if isinstance(batch, udpgso.GsoBatch):
        batch._plan = kernels.plan_uniform if compiled else udpgso._plan_uniform_reference
    else:
        batch._split = kernels.split if compiled else udpgso._split_reference
        batch._segment_sizes = kernels.segment_sizes if compiled else udpgso._segment_sizes_reference
    return batch


@pytest.fixture
def pair():
    """(sender, receiver): UDP sockets bound to loopback; the receiver has a large buffer."""
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        tx.bind((LOCALHOST, 0))
        rx.bind((LOCALHOST, 0))
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        yield tx, rx
    finally:
        tx.close()
        rx.close()


@pytest.fixture
def fresh_gso_check():
    """Clears gso_unavailable's cache before and after (for tests that change NETAGG_UDP_GSO)."""
    udpgso.gso_unavailable.cache_clear()
    yield
    udpgso.gso_unavailable.cache_clear()


def _require_gso() -> None:
    reason = udpgso.gso_unavailable()
    if reason:
        pytest.skip(f"segmented sends do not work here: {reason}")


def _segments(n: int, size: int, seed: int) -> np.ndarray:
    """``n`` rows of ``size`` distinct bytes (the row index in the first bytes)."""
    rows = np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)
    index = np.arange(n, dtype=">u4").view(np.uint8).reshape(n, 4)
    rows[:, :min(size, 4)] = index[:, 4 - min(size, 4):]
    return rows


def _send(gso: udpgso.GsoBatch, tx: socket.socket, rows: np.ndarray, dest, connected: bool) -> tuple[int, int]:
    """Plan and send ``rows`` to ``dest`` (by name, or over a connected socket); returns GsoBatch.send's answer."""
    name = mmsg.sockaddr_in(*dest)
    if connected:
        tx.connect(dest)
    addresses = np.uint64(rows.ctypes.data) + np.arange(rows.shape[0], dtype=np.uint64) * np.uint64(rows.shape[1])
    headers = gso.plan_uniform(addresses, rows.shape[1], *((0, 0) if connected else (name.ctypes.data, name.size)))
    return gso.send(tx.fileno(), headers)


def _recv_plain(rx: socket.socket, count: int) -> list[bytes]:
    """``count`` datagrams, then checks that no more arrive."""
    rx.settimeout(5)
    got = [rx.recv(65536) for _ in range(count)]
    assert not select.select([rx], [], [], 0.05)[0], "more datagrams than sent"
    return got


def _recv_gro(gro: udpgso.GroBatch, rx: socket.socket, count: int, sender, limit: int | None = None,
              first: int = 0) -> tuple[list[bytes], int]:
    """Up to ``count`` datagrams through ``gro`` (rows ``first ..``, ``limit`` per call); returns them and how
    many calls found leftovers pending. Checks every row's sender, and that nothing more arrives."""
    got, pending_seen = [], 0
    expected_name = bytes(mmsg.sockaddr_in(*sender)[:8])
    deadline = time.monotonic() + 5
    while len(got) < count and time.monotonic() < deadline:
        if gro.pending:
            pending_seen += 1
        elif not select.select([rx], [], [], 0.5)[0]:
            continue
        filled = gro.recv(rx.fileno(), first, limit)
        assert filled <= (limit if limit is not None else gro.capacity - first)
        for row in range(first, first + filled):
            got.append(bytes(gro.buf[row, gro.headroom:gro.headroom + gro.lengths[row]]))
            assert bytes(gro.names[row, :8]) == expected_name
    assert not gro.pending
    assert not select.select([rx], [], [], 0.05)[0], "more datagrams than sent"
    return got, pending_seen


def _rows_bytes(rows: np.ndarray) -> list[bytes]:
    return [bytes(row) for row in rows]


@needs_mmsg
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("connected", [False, True])
@pytest.mark.parametrize("n", [1, 64, 65, 300])
def test_segmented_send_arrives_split_at_a_plain_socket(pair, impl, connected, n):
    _require_gso()
    tx, rx = pair
    gso = _use(udpgso.GsoBatch(300), impl)
    assert gso.segmenting
    rows = _segments(n, 276, seed=n)
    assert _send(gso, tx, rows, rx.getsockname(), connected) == (n, 0)
    assert _recv_plain(rx, n) == _rows_bytes(rows)


@needs_mmsg
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("connected", [False, True])
@pytest.mark.parametrize("n", [1, 64, 65, 300])
def test_segmented_send_arrives_coalesced_at_a_gro_batch(pair, impl, connected, n):
    _require_gso()
    tx, rx = pair
    if not udpgso.enable_gro(rx):
        pytest.skip("no UDP_GRO on this kernel")
    gro = _use(udpgso.GroBatch(512, 512), impl)
    rows = _segments(n, 276, seed=n + 1)
    assert _send(_use(udpgso.GsoBatch(300), impl), tx, rows, rx.getsockname(), connected) == (n, 0)
    got, _ = _recv_gro(gro, rx, n, tx.getsockname())
    assert got == _rows_bytes(rows)
    assert gro.datagrams == n
    if n >= 64:
        assert gro.datagrams / gro.calls > 1  # coalesced: fewer receive calls than datagrams


@needs_mmsg
@pytest.mark.parametrize("impl", IMPLS)
def test_a_gro_batch_counts_ce_marked_datagrams(pair, impl):
    """ECN: with ``enable_ecn`` on both ends, datagrams sent ECT(0) arrive unmarked and datagrams whose sender set
    CE are counted in ``ce_datagrams`` (segmented and single sends alike), and their bytes arrive intact."""
    _require_gso()
    tx, rx = pair
    if not udpgso.enable_gro(rx) or not udpgso.enable_ecn(rx) or not udpgso.enable_ecn(tx):
        pytest.skip("no UDP_GRO or IP_RECVTOS on this kernel")
    gro = _use(udpgso.GroBatch(512, 512), impl)
    rows = _segments(100, 276, seed=3)
    assert _send(_use(udpgso.GsoBatch(300), impl), tx, rows[:70], rx.getsockname(), False) == (70, 0)
    got, _ = _recv_gro(gro, rx, 70, tx.getsockname())
    assert got == _rows_bytes(rows[:70]) and gro.ce_datagrams == 0
    tx.setsockopt(udpgso.SOL_IP, udpgso.IP_TOS, wire.ECN_CE)  # as if a queue on the way had marked them
    assert _send(_use(udpgso.GsoBatch(300), impl), tx, rows[70:], rx.getsockname(), False) == (30, 0)
    tx.sendto(b"one more", rx.getsockname())
    got, _ = _recv_gro(gro, rx, 31, tx.getsockname())
    assert got == [*_rows_bytes(rows[70:]), b"one more"]
    assert gro.ce_datagrams == 31


@needs_mmsg
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("capacity", "limit", "first", "messages"), [(10, None, 0, 64), (64, 7, 3, 2), (2, 1, 1, 1)])
def test_a_small_gro_batch_keeps_leftovers_pending_and_loses_nothing(pair, impl, capacity, limit, first, messages):
    _require_gso()
    tx, rx = pair
    if not udpgso.enable_gro(rx):
        pytest.skip("no UDP_GRO on this kernel")
    gro = _use(udpgso.GroBatch(capacity, 300, headroom=16, messages=messages), impl)
    rows = _segments(300, 276, seed=capacity)
    assert _send(_use(udpgso.GsoBatch(300), impl), tx, rows, rx.getsockname(), False) == (300, 0)
    got, pending_seen = _recv_gro(gro, rx, 300, tx.getsockname(), limit=limit, first=first)
    assert got == _rows_bytes(rows)
    assert pending_seen > 0  # leftovers were handed out by calls that did not read the socket
    assert not gro.buf[:, :16].any()  # the headroom stays free


@needs_mmsg
@pytest.mark.parametrize("impl", IMPLS)
def test_gro_batch_rows_short_tails_plain_and_empty_datagrams_and_overlong_segments(pair, impl):
    _require_gso()
    tx, rx = pair
    if not udpgso.enable_gro(rx):
        pytest.skip("no UDP_GRO on this kernel")
    dest = rx.getsockname()
    payload = bytes(_segments(1, 10 * 276 + 100, seed=5)[0])  # 10 whole segments and a 100-byte tail
    tx.sendmsg([payload], [(udpgso.SOL_UDP, udpgso.UDP_SEGMENT, (276).to_bytes(2, "little"))], 0, dest)
    tx.sendto(b"", dest)
    tx.sendto(b"plain datagram", dest)
    expected = [payload[i:i + 276] for i in range(0, len(payload), 276)] + [b"", b"plain datagram"]
    gro = _use(udpgso.GroBatch(64, 300, headroom=8), impl)
    got, _ = _recv_gro(gro, rx, len(expected), tx.getsockname())
    assert got == expected
    # Rows narrower than the segments: each datagram is cut to the row, and so is its length.
    tx.sendmsg([payload], [(udpgso.SOL_UDP, udpgso.UDP_SEGMENT, (276).to_bytes(2, "little"))], 0, dest)
    narrow = _use(udpgso.GroBatch(64, 208, headroom=8), impl)
    got, _ = _recv_gro(narrow, rx, 11, tx.getsockname())
    assert got == [segment[:200] for segment in expected[:11]]


# -- the fallback: the kernel refuses segmentation --------------------------------------------------------------

def _fill(gso: udpgso.GsoBatch, rows: np.ndarray, runs: list[int], name: tuple[int, int]) -> int:
    """Headers by hand (as compiled callers fill them): header ``h`` holds ``runs[h]`` consecutive rows."""
    size = rows.shape[1]
    gso.iov_words[:rows.shape[0], 0] = np.uint64(rows.ctypes.data) + np.arange(rows.shape[0], dtype=np.uint64) \
        * np.uint64(size)
    gso.iov_words[:rows.shape[0], 1] = size
    first = 0
    for h, run in enumerate(runs):
        words = gso.hdr_words[h]
        words[0], words[1] = name
        words[2], words[3] = gso.iov_addr + np.uint64(16 * first), run
        words[4], words[5] = (gso.ctrl_addr + np.uint64(udpgso.CONTROL_BYTES * h), udpgso.CONTROL_BYTES) \
            if run > 1 else (0, 0)
        gso.ctrl_size[h] = size
        first += run
    assert first == rows.shape[0]
    return len(runs)


def test_so_no_check_makes_the_kernel_refuse_segmented_sends(pair):
    """The premise of the fallback tests: a real refusal, not a mock."""
    tx, rx = pair
    tx.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)
    with pytest.raises(OSError) as refused:
        tx.sendmsg([bytes(552)], [(udpgso.SOL_UDP, udpgso.UDP_SEGMENT, (276).to_bytes(2, "little"))], 0,
                   rx.getsockname())
    assert refused.value.errno in (errno.EINVAL, errno.EIO)
    tx.sendto(b"still fine", rx.getsockname())
    assert _recv_plain(rx, 1) == [b"still fine"]


@needs_mmsg
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("connected", [False, True])
def test_a_refused_segmented_send_is_resent_one_datagram_per_message(pair, impl, connected, caplog):
    _require_gso()
    tx, rx = pair
    dest = rx.getsockname()
    tx.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)
    if connected:
        tx.connect(dest)
    name_array = mmsg.sockaddr_in(*dest)
    name = (0, 0) if connected else (name_array.ctypes.data, name_array.size)
    gso = _use(udpgso.GsoBatch(300), impl)
    assert gso.segmenting
    # A single datagram goes out first, then the kernel refuses the second (segmented) header.
    runs = [1, 10, 1, 29, 64, 64, 2]
    rows = _segments(sum(runs), 276, seed=3)
    with caplog.at_level(logging.WARNING, logger="netagg.udpgso"):
        assert gso.send(tx.fileno(), _fill(gso, rows, runs, name)) == (sum(runs), 0)
        assert _recv_plain(rx, sum(runs)) == _rows_bytes(rows)
        assert not gso.segmenting
        assert gso.refused == f"the kernel refused a segmented send ({os.strerror(errno.EINVAL)})"
        # From now on: plans of one segment per header, sent as they are.
        rows = _segments(150, 276, seed=4)
        addresses = np.uint64(rows.ctypes.data) + np.arange(150, dtype=np.uint64) * np.uint64(276)
        headers = gso.plan_uniform(addresses, 276, *name)
        assert headers == 150 and np.all(gso.hdr_words[:150, 3] == 1) and np.all(gso.hdr_words[:150, 5] == 0)
        assert gso.send(tx.fileno(), headers) == (150, 0)
        assert _recv_plain(rx, 150) == _rows_bytes(rows)
        # A batch filled by hand with segmented headers after the refusal goes one per message too.
        rows = _segments(70, 276, seed=5)
        assert gso.send(tx.fileno(), _fill(gso, rows, [64, 6], name)) == (70, 0)
        assert _recv_plain(rx, 70) == _rows_bytes(rows)
    warnings = [r for r in caplog.records if r.name == "netagg.udpgso" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Invalid argument" in warnings[0].getMessage()


@needs_mmsg
@pytest.mark.parametrize("impl", IMPLS)
def test_empty_segments_go_one_datagram_each(pair, impl):
    # A UDP_SEGMENT send of zero-length segments is one empty datagram, not one per segment: plan them singly.
    tx, rx = pair
    gso = _use(udpgso.GsoBatch(10), impl)
    rows = np.zeros((10, 4), np.uint8)
    assert gso.plan_uniform(np.full(10, rows.ctypes.data, np.uint64), 0) == 10
    assert _send(gso, tx, rows[:, :0], rx.getsockname(), True) == (10, 0)
    assert _recv_plain(rx, 10) == [b""] * 10


@needs_mmsg
def test_an_icmp_error_counts_segments_as_failed_but_keeps_segmenting(pair):
    _require_gso()
    tx, rx = pair
    dest = rx.getsockname()
    tx.connect(dest)
    rx.close()  # port unreachable: the kernel answers sends with ICMP, then ECONNREFUSED on this socket
    gso = udpgso.GsoBatch(300)
    rows = _segments(300, 276, seed=7)
    outcomes = [_send(gso, tx, rows, dest, True) for _ in range(3)]
    assert all(sent + failed == 300 for sent, failed in outcomes)
    assert sum(failed for _, failed in outcomes) > 0
    assert gso.segmenting  # a transient error is not a refusal of segmentation


@needs_mmsg
def test_netagg_udp_gso_0_starts_batches_refused(pair, monkeypatch, fresh_gso_check):
    monkeypatch.setenv("NETAGG_UDP_GSO", "0")
    assert udpgso.gso_unavailable() == "NETAGG_UDP_GSO=0 in the environment"
    tx, rx = pair
    gso = udpgso.GsoBatch(100)
    assert gso.refused == "NETAGG_UDP_GSO=0 in the environment" and not gso.segmenting
    rows = _segments(100, 276, seed=6)
    assert _send(gso, tx, rows, rx.getsockname(), False) == (100, 0)
    assert np.all(gso.hdr_words[:100, 3] == 1) and np.all(gso.hdr_words[:100, 5] == 0)
    assert _recv_plain(rx, 100) == _rows_bytes(rows)
    monkeypatch.setenv("NETAGG_UDP_GSO", "1")
    assert udpgso.gso_unavailable() == "NETAGG_UDP_GSO=0 in the environment"  # cached for the process
    udpgso.gso_unavailable.cache_clear()
    assert udpgso.GsoBatch(4).refused == udpgso.gso_unavailable()


# -- the transport end to end on each path -----------------------------------------------------------------------

@needs_mmsg
@pytest.mark.parametrize("path", ["gso", "no-gso-env", "no-gro", "refused"])
def test_transport_exchanges_exactly_on_every_io_path(path, monkeypatch, fresh_gso_check):
    if path == "no-gso-env":
        monkeypatch.setenv("NETAGG_UDP_GSO", "0")
    elif path == "no-gro":
        monkeypatch.setattr(udpgso, "enable_gro", lambda sock: False)
    elif path in ("gso", "refused"):
        _require_gso()
    rng = np.random.default_rng(42)
    size = 20_000  # ~300 blocks through 32 slots: sends of many segments each
    inputs = [(rng.standard_normal(size) * 10.0 ** rng.integers(-20, 20, size)).astype(np.float32)]

    def work(worker, rank):
        transport = worker.transport
        if path == "refused":
            transport.sock.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)
        return worker.allreduce(inputs[rank]), transport.gso_refused, transport.gro

    with fallback_job(1, slot_count=32) as (_server, configs):
        [(result, refused, gro)] = run_workers(configs, work, timeout=60)
    np.testing.assert_array_equal(result, expected_allreduce(inputs)[0])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        expected_gro = path != "no-gro" and udpgso.enable_gro(probe)
    assert gro == expected_gro
    if path == "gso":
        assert refused is None
    elif path == "no-gso-env":
        assert refused == "NETAGG_UDP_GSO=0 in the environment"
    elif path == "refused":
        assert refused == f"the kernel refused a segmented send ({os.strerror(errno.EINVAL)})"
    else:
        assert refused == udpgso.gso_unavailable()


# -- the regression window ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("release", "inside"), [
    ("7.0.0", True), ("7.1.4", True), ("7.1.5", False), ("6.18.44-fc-v657", False), ("7.0-rc1", True),
    ("7.1.4-200.fc42.x86_64", True), ("7", True), ("6.19", False), ("8.0.0", False), ("garbage", False), ("", False),
])
def test_kernel_in_regression(release, inside):
    assert udpgso._kernel_in_regression(release) is inside
