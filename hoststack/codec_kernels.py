"""Fused, compiled kernels for the quantization codec (used when numba is installed).

Each kernel does in one pass what :mod:`netagg.hoststack.quantization` does with several
numpy passes, with bit-identical results (``tests/test_quantization.py`` compares them):
the same float32 operations in the same order, the same round-half-to-even, the same
big-endian wire integers. Large arrays are split over the cores. Install with
``pip install -e '.[fast]'``; without numba the numpy path runs and only speed changes.
"""

from __future__ import annotations

import types

import numpy as np
from numba import njit, prange

from netagg import wire

wire.check_compiled_layout(__name__, "v4 K=64 widths=64,256 version:8,flags:8,job_id:16,slot:16,pool:8,rank:8,"
                                     "exponent:8s,width:8,round:16,seq:32,members:32,exchange:32")

_ABS_MASK = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)
#: Blocks from which a kernel runs on all cores (below, threads cost more than they give).
PARALLEL_BLOCKS = 1024


@njit(cache=True, nogil=True, inline="always")
def _bswap32(v: np.uint32) -> np.uint32:
    return (((v & np.uint32(0xFF)) << np.uint32(24)) | ((v & np.uint32(0xFF00)) << np.uint32(8))
            | ((v >> np.uint32(8)) & np.uint32(0xFF00)) | (v >> np.uint32(24)))


def _block_exponents(bits: np.ndarray, out: np.ndarray) -> int:
    """Writes each block's int8 exponent; returns how many blocks hold a NaN/Inf."""
    bad = 0
    for b in prange(bits.shape[0]):
        row = bits[b]  # a 1-D row and a branch-free max: LLVM vectorizes the inner loop
        top = np.uint32(0)
        for i in range(row.shape[0]):
            top = max(top, row[i] & _ABS_MASK)
        if top >= _INF_BITS:
            bad += 1
        out[b] = np.int8(-128) if top == 0 else np.int8(np.int32(top >> np.uint32(23)) - 127)
    return bad


@njit(cache=True, nogil=True, inline="always")
def quantize_row(src: np.ndarray, a: np.float32, second: np.float32, dst: np.ndarray, first: int) -> None:
    """One block of k values: ``dst[first:first + k]`` (uint32 words) = byte-swapped ``rint(src * a (* second))``. The
    one quantizer of the compiled paths: the codec below and the transport's packet fill
    (``transport_kernels.fill_packets``) inline it; ``quantization.quantize_scaled`` is its numpy twin."""
    if second == np.float32(1.0):  # the branch outside the inner loops keeps them vectorized
        for i in range(src.shape[0]):
            dst[first + i] = _bswap32(np.uint32(np.int32(np.rint(src[i] * a))))
    else:  # an extreme exponent: the scale needs two float32 factors
        for i in range(src.shape[0]):
            dst[first + i] = _bswap32(np.uint32(np.int32(np.rint(src[i] * a * second))))


def _quantize(blocks: np.ndarray, exponents: np.ndarray, enc_a: np.ndarray, enc_b: np.ndarray,
              out: np.ndarray) -> None:
    for b in prange(blocks.shape[0]):
        g = np.int32(exponents[b]) + 128
        quantize_row(blocks[b], enc_a[g], enc_b[g], out[b], 0)


def _dequantize(sums: np.ndarray, exponents: np.ndarray, dec_a: np.ndarray, dec_b: np.ndarray,
                out: np.ndarray) -> None:
    for b in prange(sums.shape[0]):
        g = np.int32(exponents[b]) + 128
        a, second = dec_a[g], dec_b[g]
        src, dst = sums[b], out[b]
        if second == np.float32(1.0):
            for i in range(src.shape[0]):
                dst[i] = np.float32(np.int32(_bswap32(src[i]))) * a
        else:
            for i in range(src.shape[0]):
                dst[i] = np.float32(np.int32(_bswap32(src[i]))) * a * second


def _compiled(fn):
    """A serial and a parallel build of ``fn``. The parallel one compiles a renamed copy:
    numba's on-disk cache is keyed by the function's name, so two builds of one function
    would load each other's machine code (and the parallel build would run serially)."""
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_parallel")
    twin.__qualname__ = fn.__qualname__ + "_parallel"
    return (njit(cache=True, nogil=True)(fn), njit(cache=True, nogil=True, parallel=True)(twin))


_EXPONENTS, _QUANTIZE, _DEQUANTIZE = _compiled(_block_exponents), _compiled(_quantize), _compiled(_dequantize)


def _pick(kernels: tuple, blocks: int):
    return kernels[blocks >= PARALLEL_BLOCKS]


def block_exponents(bits: np.ndarray, out: np.ndarray) -> bool:
    """``bits``: the float32 blocks viewed as uint32 (n, k); writes int8 exponents ``floor(log2 max|x|)``
    (-128 for all-zero blocks) into ``out``; returns False if a block holds a NaN/Inf."""
    return _pick(_EXPONENTS, bits.shape[0])(bits, out) == 0


def quantize(blocks: np.ndarray, exponents: np.ndarray, enc_a: np.ndarray, enc_b: np.ndarray,
             out: np.ndarray) -> None:
    """``out`` (the wire array viewed as uint32): byte-swapped ``rint(x * a (* b))`` per block,
    the factors looked up at index ``G + 128`` of the int8 exponents G."""
    _pick(_QUANTIZE, blocks.shape[0])(blocks, exponents, enc_a, enc_b, out)


def dequantize(sums: np.ndarray, exponents: np.ndarray, dec_a: np.ndarray, dec_b: np.ndarray,
               out: np.ndarray) -> None:
    """``sums``: the wire integers viewed as uint32; writes ``float32(sum) * a (* b)``."""
    _pick(_DEQUANTIZE, sums.shape[0])(sums, exponents, dec_a, dec_b, out)
