"""Block floating point: float32 gradients to int32 values the switch can sum without overflow.

Every block of k values (one packet of the job's width, ``wire.K`` or ``wire.WIDE_K``) shares one
exponent ``G``, the maximum over all workers of each worker's *block exponent*
``E = floor(log2(max |x|))`` (the IEEE-754 exponent of the block's largest magnitude, so every value
of the block satisfies ``|x| < 2**(E+1)``).
With ``n`` workers each value is scaled by the power of two ``2**(P - G - 1)``, where
``2**P`` is the largest power of two with ``n * 2**P <= 2**31``, and rounded to the
nearest integer: ``|q| < 2**P``, so the sum of ``n`` of them fits in an int32.
See ``docs/quantization.md`` for the derivation and the error bound.

The scale is a power of two, so ``x * scale`` and ``sum * 2**-scale`` are exact in
float32: encoding rounds once (to an integer) and decoding rounds once (to float32).
Everything is vectorized over ``(blocks, k)`` arrays; no Python loop per value.
"""

from __future__ import annotations

import numpy as np

from netagg import wire

K = wire.K
#: Exponent of a block without any magnitude (all zeros, or "no block"): int8's minimum,
#: so it never raises the switch's maximum.
EXP_NONE = -128
#: Smallest exponent of a non-zero float32 block (denormals: |x| < 2**-126).
EXP_MIN = -127
#: Largest exponent of a finite float32 (max float32 < 2**128).
EXP_MAX = 127

_ABS_MASK = np.uint32(0x7FFFFFFF)
_INF_BITS = 0x7F800000
#: Wire values: big-endian int32.
WIRE_DTYPE = wire.WIRE_VALUE_DTYPE

try:  # fused one-pass kernels when numba is installed (extra "fast"); same results, faster
    from netagg.hoststack import codec_kernels as kernels
except ImportError:
    kernels = None


def _fused(*arrays: np.ndarray) -> bool:
    """Whether the compiled kernels can take these arrays (numba present, C-contiguous)."""
    return kernels is not None and all(a.flags.c_contiguous for a in arrays)


def scale_bits(num_workers: int) -> int:
    """P: the largest integer with ``num_workers * 2**P <= 2**31``. ``num_workers`` is the whole job's, up to
    ``wire.MAX_JOB_WORKERS`` over a tree of switches (docs/hierarchy.md): every level's partial stays below it."""
    if not 1 <= num_workers <= wire.MAX_JOB_WORKERS:
        raise ValueError(f"num_workers {num_workers} not in 1..{wire.MAX_JOB_WORKERS}")
    return 31 - (num_workers - 1).bit_length()


def _pow2_tables(num_workers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per exponent G (index G + 128): encode factors (a, b) and decode factors (c, d).

    ``x * a * b == x * 2**(P-G-1)`` and ``s * c * d == s * 2**(G+1-P)``, each factor a
    finite float32 power of two (one factor alone would overflow or underflow float32 for
    extreme G); the second factor is 1 wherever the first suffices.
    """
    p = scale_bits(num_workers)
    g = np.arange(-128, 128, dtype=np.int64)
    enc = p - g - 1  # in [p-128, p+127]
    enc_a = np.minimum(enc, 100)
    enc_b = enc - enc_a
    dec = -enc  # in [-p-127, 128-p]
    dec_a = np.maximum(dec, -100)
    dec_b = dec - dec_a
    one = np.float32(1)
    return tuple(np.ldexp(one, e.astype(np.int32)).astype(np.float32) for e in (enc_a, enc_b, dec_a, dec_b))


_TABLES: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}


def factor_tables(num_workers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per exponent G (index G + 128), float32: encode factors (a, b) and decode factors (c, d) for
    ``num_workers`` (cached); what :func:`quantize_scaled` and the compiled kernels take."""
    tables = _TABLES.get(num_workers)
    if tables is None:
        tables = _TABLES[num_workers] = _pow2_tables(num_workers)
    return tables


def block_exponents(blocks: np.ndarray) -> np.ndarray:
    """Each block's exponent ``floor(log2(max |x|))`` over its finite values, as int8.

    ``blocks`` is a float32 array of shape ``(nblocks, k)``. Denormal-only blocks get
    ``EXP_MIN`` (-127, still ``|x| < 2**(E+1)``); blocks without a finite non-zero value get
    ``EXP_NONE``. NaN and inf are left out (see :func:`inspect` for their flags).
    """
    return inspect(blocks)[0]


def inspect(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Each block's exponent over its finite values (:func:`block_exponents`) and each block's non-finite flags
    (``wire.FLAG_NAN | FLAG_POS_INF | FLAG_NEG_INF`` of the values it holds, uint8; all 0 when every value is
    finite). Such blocks are sent with those values as 0 and the flags set (docs/protocol.md, "Non-finite
    values"): see :func:`finite_blocks`."""
    if blocks.dtype != np.float32 or blocks.ndim != 2 or blocks.shape[1] not in wire.WIDTH_CODES:
        raise TypeError(f"expected float32 blocks of shape (n, k), k in {sorted(wire.WIDTH_CODES)}, "
                        f"got {blocks.dtype} {blocks.shape}")
    flags = np.zeros(blocks.shape[0], np.uint8)
    if blocks.shape[0] == 0:
        return np.empty(0, np.int8), flags
    if _fused(blocks):
        exponents = np.empty(blocks.shape[0], np.int8)
        if kernels.block_exponents(blocks.view(np.uint32), exponents):
            return exponents, flags
    magnitude = np.bitwise_and(blocks.view(np.uint32), _ABS_MASK)
    nonfinite = magnitude >= _INF_BITS
    if nonfinite.any():
        nan = magnitude > _INF_BITS
        inf = nonfinite & ~nan
        negative = (blocks.view(np.uint32) >> 31).astype(bool)
        flags = (np.where(nan.any(axis=1), wire.FLAG_NAN, 0)
                 | np.where((inf & ~negative).any(axis=1), wire.FLAG_POS_INF, 0)
                 | np.where((inf & negative).any(axis=1), wire.FLAG_NEG_INF, 0)).astype(np.uint8)
        magnitude = np.where(nonfinite, np.uint32(0), magnitude)
    block_max = magnitude.max(axis=1)
    exponents = (block_max >> 23).astype(np.int16) - 127
    exponents[block_max == 0] = EXP_NONE
    return exponents.astype(np.int8), flags


def inspected(blocks: np.ndarray, exponents: np.ndarray | None, flags: np.ndarray | None
              ) -> tuple[np.ndarray, np.ndarray]:
    """``exponents`` and ``flags`` of ``blocks`` as a caller gave them, each computed by :func:`inspect` where not
    given (exponents alone do not say whether the blocks are finite)."""
    if exponents is not None and flags is not None:
        return exponents, flags
    own_exponents, own_flags = inspect(blocks)
    return (own_exponents if exponents is None else exponents), own_flags if flags is None else flags


def finite_blocks(blocks: np.ndarray, flags: np.ndarray | None) -> np.ndarray:
    """``blocks`` with every NaN and inf replaced by 0 (a copy if ``flags`` marks a block, else ``blocks``)."""
    if flags is None or not flags.any():
        return blocks
    out = blocks.copy()
    rows = np.flatnonzero(flags)
    out[rows] = np.where(np.isfinite(out[rows]), out[rows], np.float32(0))
    return out


def apply_flags(values: np.ndarray, flags: np.ndarray | None) -> np.ndarray:
    """Overwrite each block of ``values`` ((n, k) floats) whose result ``flags`` are non-finite: NaN (NAN, or
    POS_INF and NEG_INF together), +inf (POS_INF alone) or -inf (NEG_INF alone): what IEEE-754 sums give where
    those values meet (docs/protocol.md, "Non-finite values"). Returns ``values``."""
    if flags is None:
        return values
    nonfinite = flags & wire.NONFINITE_FLAGS
    if not nonfinite.any():
        return values
    both = wire.FLAG_POS_INF | wire.FLAG_NEG_INF
    nan = ((nonfinite & wire.FLAG_NAN) != 0) | ((nonfinite & both) == both)
    values[nan] = np.nan
    values[~nan & ((nonfinite & wire.FLAG_POS_INF) != 0)] = np.inf
    values[~nan & ((nonfinite & wire.FLAG_NEG_INF) != 0)] = -np.inf
    return values


def quantize(blocks: np.ndarray, exponents: np.ndarray, num_workers: int, out: np.ndarray | None = None) -> np.ndarray:
    """``rint(x * 2**(P - G - 1))`` per block as int32 (big-endian wire order by default).

    ``exponents`` are the *global* exponents G (int8, one per block): G must be at least
    each block's own :func:`block_exponents` value, else the values could overflow.
    """
    enc_a, enc_b, _, _ = factor_tables(num_workers)
    if out is None:
        out = np.empty(blocks.shape, WIRE_DTYPE)
    if out.dtype == WIRE_DTYPE and exponents.dtype == np.int8 and _fused(blocks, out, exponents):
        kernels.quantize(blocks, exponents, enc_a, enc_b, out.view(np.uint32))
        return out
    return quantize_scaled(blocks, exponents, enc_a, enc_b, out)


def quantize_scaled(blocks: np.ndarray, exponents: np.ndarray, enc_a: np.ndarray, enc_b: np.ndarray,
                    out: np.ndarray | None = None) -> np.ndarray:
    """:func:`quantize` with the encode factors of :func:`factor_tables` given, in numpy (the reference
    the compiled kernels, ``codec_kernels.quantize_row``, follow operation for operation)."""
    if out is None:
        out = np.empty(blocks.shape, WIRE_DTYPE)
    index = exponents.astype(np.intp) + 128
    scaled = np.multiply(blocks, enc_a[index][:, None])
    extreme = np.flatnonzero(enc_b[index] != 1)  # rare: G < P - 101 (about -70)
    if extreme.size:
        scaled[extreme] *= enc_b[index[extreme]][:, None]  # scale beyond float32 range: second factor
    np.rint(scaled, out=out, casting="unsafe")
    return out


def dequantize(
    sums: np.ndarray, exponents: np.ndarray, num_workers: int, out: np.ndarray | None = None,
    flags: np.ndarray | None = None,
) -> np.ndarray:
    """The values ``sum * 2**(G + 1 - P)`` of summed int32 blocks (any byte order).

    ``flags``: the results' round flags per block: blocks with non-finite flags become NaN or inf
    (:func:`apply_flags`).

    Computed in ``out``'s dtype: float32 by default (correctly rounded: one rounding of the
    int32 sum to 24 bits, then an exact power-of-two scaling), float64 if ``out`` is float64.
    A float32 result is ``inf`` only where the exact sum exceeds float32's range.
    """
    _, _, dec_a, dec_b = factor_tables(num_workers)
    if out is None:
        out = np.empty(sums.shape, np.float32)
    fusable = sums.dtype == WIRE_DTYPE and out.dtype == np.float32 and exponents.dtype == np.int8
    if fusable and _fused(sums, out, exponents):
        kernels.dequantize(sums.view(np.uint32), exponents, dec_a, dec_b, out)
        return apply_flags(out, flags)
    index = exponents.astype(np.intp) + 128
    with np.errstate(over="ignore"):  # inf: the exact sum is beyond float32 (documented)
        np.multiply(sums, dec_a[index][:, None], out=out, dtype=out.dtype, casting="unsafe")
    extreme = np.flatnonzero(dec_b[index] != 1)
    if extreme.size:  # tiny exponents: 2**(G+1-P) is below float32's range, scale twice
        out[extreme] *= dec_b[index[extreme]][:, None]
    return apply_flags(out, flags)


def error_bound(exponents: np.ndarray, num_workers: int) -> np.ndarray:
    """Per block: the largest |decoded sum - exact sum| from quantization alone (float64).

    ``n * 2**(G - P)``: half a quantum per worker. Decoding to float32 adds at most half a
    float32 ulp of the result (see docs/quantization.md).
    """
    g = exponents.astype(np.float64)
    return num_workers * np.exp2(g - scale_bits(num_workers))
