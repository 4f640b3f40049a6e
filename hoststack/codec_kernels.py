"""Fused, compiled kernels for the quantization codec (used when numba is installed).

Each kernel does in one pass what :mod:`netagg.hoststack.quantization` does with several
numpy passes, with bit-identical results (``tests/test_quantization.py`` compares them):
the same float32 operations in the same order, the same round-half-to-even, the same
big-endian wire integers. Large arrays are split over the cores. Install with
``pip install -e '.[fast]'``; without numba the numpy path runs and only speed changes.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_ABS_MASK = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)
#: Blocks from which a kernel runs on all cores (below, threads cost more than they give).
PARALLEL_BLOCKS = 4096


@njit(cache=True, nogil=True, inline="always")
def _bswap32(v: np.uint32) -> np.uint32:
    return (((v & np.uint32(0xFF)) << np.uint32(24)) | ((v & np.uint32(0xFF00)) << np.uint32(8))
            | ((v >> np.uint32(8)) & np.uint32(0xFF00)) | (v >> np.uint32(24)))


def _block_tops(bits: np.ndarray, tops: np.ndarray) -> None:
    """The largest magnitude (as float32 bits without the sign) of every block."""
    n, k = bits.shape
    for b in prange(n):
        top = np.uint32(0)
        for i in range(k):  # a branch-free max: LLVM vectorizes it
            top = max(top, bits[b, i] & _ABS_MASK)
        tops[b] = top


def _quantize(blocks: np.ndarray, index: np.ndarray, enc_a: np.ndarray, enc_b: np.ndarray, out: np.ndarray) -> None:
    n, k = blocks.shape
    for b in prange(n):
        a = enc_a[index[b]]
        second = enc_b[index[b]]
        extreme = second != np.float32(1.0)
        for i in range(k):
            x = blocks[b, i] * a
            if extreme:
                x = x * second
            out[b, i] = _bswap32(np.uint32(np.int32(np.rint(x))))


def _dequantize(sums: np.ndarray, index: np.ndarray, dec_a: np.ndarray, dec_b: np.ndarray, out: np.ndarray) -> None:
    n, k = sums.shape
    for b in prange(n):
        a = dec_a[index[b]]
        second = dec_b[index[b]]
        extreme = second != np.float32(1.0)
        for i in range(k):
            y = np.float32(np.int32(_bswap32(sums[b, i]))) * a
            if extreme:
                y = y * second
            out[b, i] = y


def _compiled(fn):  # one serial and one parallel build of each kernel
    return (njit(cache=True, nogil=True)(fn), njit(cache=True, nogil=True, parallel=True)(fn))


_TOPS, _QUANTIZE, _DEQUANTIZE = _compiled(_block_tops), _compiled(_quantize), _compiled(_dequantize)


def _pick(kernels: tuple, blocks: int):
    return kernels[blocks >= PARALLEL_BLOCKS]


def block_exponents(bits: np.ndarray, out: np.ndarray) -> int:
    """``bits``: the float32 blocks viewed as uint32 (n, K); writes int8 exponents ``floor(log2 max|x|)``
    (-128 for all-zero blocks); returns the first block holding a NaN/Inf, or -1."""
    tops = np.empty(bits.shape[0], np.uint32)
    _pick(_TOPS, bits.shape[0])(bits, tops)
    bad = np.flatnonzero(tops >= _INF_BITS)
    if bad.size:
        return int(bad[0])
    out[:] = (tops >> 23).astype(np.int16) - 127
    out[tops == 0] = -128
    return -1


def quantize(blocks: np.ndarray, index: np.ndarray, enc_a: np.ndarray, enc_b: np.ndarray, out: np.ndarray) -> None:
    """``out`` (the wire array viewed as uint32): byte-swapped ``rint(x * a (* b))`` per block."""
    _pick(_QUANTIZE, blocks.shape[0])(blocks, index, enc_a, enc_b, out)


def dequantize(sums: np.ndarray, index: np.ndarray, dec_a: np.ndarray, dec_b: np.ndarray, out: np.ndarray) -> None:
    """``sums``: the wire integers viewed as uint32; writes ``float32(sum) * a (* b)``."""
    _pick(_DEQUANTIZE, sums.shape[0])(sums, index, dec_a, dec_b, out)
