"""The compiled codec kernels (numba, optional) give bit-identical results to the numpy path."""

import numpy as np
import pytest

from netagg import wire
from netagg.hoststack import quantization as qz

pytest.importorskip("numba", reason="the fused kernels are optional: pip install -e '.[fast]'")


def _blocks(rng: np.random.Generator, n: int) -> np.ndarray:
    scales = np.exp2(rng.integers(-149, 127, (n, 1)).astype(np.float64))
    blocks = (rng.standard_normal((n, wire.K)) * scales).clip(-3e38, 3e38).astype(np.float32)
    blocks[0] = 0.0  # all-zero block
    blocks[1] = np.float32(1e-45) * rng.integers(-3, 4, wire.K)  # denormals only
    blocks[2] = np.arange(wire.K, dtype=np.float32) - 31.5  # exact .5 ties after scaling
    return blocks


@pytest.mark.parametrize("n", [5, 5000])  # serial and parallel kernels
@pytest.mark.parametrize("workers", [1, 3, 32])
def test_kernels_match_numpy_bit_for_bit(monkeypatch, n, workers):
    rng = np.random.default_rng(n * 100 + workers)
    blocks = _blocks(rng, n)
    fused_exp = qz.block_exponents(blocks)
    fused_q = qz.quantize(blocks, fused_exp, workers)
    sums = (fused_q.astype(np.int64) * workers).clip(-(2**31), 2**31 - 1).astype(wire.WIRE_VALUE_DTYPE)
    fused_d = qz.dequantize(sums, fused_exp, workers)
    monkeypatch.setattr(qz, "kernels", None)
    np.testing.assert_array_equal(fused_exp, qz.block_exponents(blocks))
    assert qz.quantize(blocks, fused_exp, workers).tobytes() == fused_q.tobytes()
    assert qz.dequantize(sums, fused_exp, workers).tobytes() == fused_d.tobytes()


@pytest.mark.parametrize("n", [5, 5000])
def test_non_finite_blocks_give_the_same_exponents_and_flags(monkeypatch, n):
    rng = np.random.default_rng(n)
    blocks = _blocks(rng, n)
    blocks[3, 7] = np.nan
    blocks[n - 1, 0] = -np.inf
    fused = qz.inspect(blocks)
    monkeypatch.setattr(qz, "kernels", None)
    reference = qz.inspect(blocks)
    np.testing.assert_array_equal(fused[0], reference[0])
    np.testing.assert_array_equal(fused[1], reference[1])
    assert fused[1][3] == wire.FLAG_NAN and fused[1][n - 1] == wire.FLAG_NEG_INF


def test_parallel_builds_do_not_share_the_serial_cache_entry():
    # numba's on-disk cache is keyed by the function's qualified name: a parallel build of
    # the same function would load the serial machine code from the cache and run on one core.
    from netagg.hoststack import codec_kernels as kernels

    for serial, parallel in (kernels._EXPONENTS, kernels._QUANTIZE, kernels._DEQUANTIZE):
        assert parallel.targetoptions.get("parallel") and not serial.targetoptions.get("parallel")
        assert parallel.py_func.__qualname__ != serial.py_func.__qualname__
        assert parallel.py_func.__code__ is serial.py_func.__code__  # the same kernel body
