"""Block floating point quantization: exponents, no overflow, the documented error bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netagg import wire
from netagg.hoststack import quantization as qz

K = wire.K
INT32_MAX = 2**31 - 1
F32_MAX = float(np.finfo(np.float32).max)
SMALLEST_DENORMAL = float(np.finfo(np.float32).smallest_subnormal)


def simulate(worker_blocks: list[np.ndarray]) -> dict[str, np.ndarray]:
    """What n workers and the switch compute: exponents, int sums (checked), decoded values."""
    n = len(worker_blocks)
    local = [qz.block_exponents(b) for b in worker_blocks]
    global_exp = np.max(local, axis=0).astype(np.int8)
    quantized = [qz.quantize(b, global_exp, n).astype(np.int64) for b in worker_blocks]
    p = qz.scale_bits(n)
    for q in quantized:
        assert np.abs(q).max(initial=0) < 2**p
    exact_int = np.sum(quantized, axis=0)
    assert np.abs(exact_int).max(initial=0) <= INT32_MAX, "the int32 sum would overflow"
    wrapped = np.sum([q.astype(np.int32) for q in quantized], axis=0, dtype=np.int32)  # the switch's adds
    np.testing.assert_array_equal(wrapped, exact_int)
    sums = wrapped.astype(qz.WIRE_DTYPE)
    return {
        "exp": global_exp,
        "sums": sums,
        "exact_int": exact_int,
        "f32": qz.dequantize(sums, global_exp, n),
        "f64": qz.dequantize(sums, global_exp, n, out=np.empty(sums.shape, np.float64)),
        "truth": np.sum([b.astype(np.float64) for b in worker_blocks], axis=0),
    }


def assert_within_bound(result: dict[str, np.ndarray], n: int) -> None:
    """|decoded - exact| <= n 2^(G-P) (quantization) + half a float32 ulp of the decoded value."""
    quant_bound = qz.error_bound(result["exp"], n)[:, None]
    assert np.all(np.abs(result["f64"] - result["truth"]) <= quant_bound)
    finite = np.isfinite(result["f32"])
    f32_err = np.abs(result["f32"].astype(np.float64) - result["truth"])
    rounding = np.abs(result["f64"]) * 2.0**-24 + 2.0**-150
    assert np.all((f32_err <= quant_bound + rounding)[finite])


def test_scale_bits_is_the_largest_safe_power_of_two():
    for n in [*range(1, 65), 1000, 1024, 1025, wire.MAX_JOB_WORKERS]:  # past 32: jobs over a tree of switches
        p = qz.scale_bits(n)
        assert n * 2**p <= 2**31 < n * 2 ** (p + 1)
    assert qz.scale_bits(wire.MAX_JOB_WORKERS) == 16  # three levels of 32: bfloat16's precision, still exact sums
    with pytest.raises(ValueError):
        qz.scale_bits(0)
    with pytest.raises(ValueError):
        qz.scale_bits(wire.MAX_JOB_WORKERS + 1)


def test_block_exponent_is_floor_log2_of_the_largest_magnitude():
    blocks = np.zeros((5, K), np.float32)
    blocks[0, 3] = -1.0  # 2**0
    blocks[1, :] = 0.75  # in [2**-1, 2**0)
    blocks[1, 7] = -3.5  # largest magnitude, 2**1 <= 3.5 < 2**2
    blocks[2, 0] = F32_MAX
    blocks[3, 9] = SMALLEST_DENORMAL
    # blocks[4] stays zero
    assert qz.block_exponents(blocks).tolist() == [0, 1, 127, qz.EXP_MIN, qz.EXP_NONE]
    assert qz.block_exponents(blocks).dtype == np.int8


@pytest.mark.parametrize(("bad", "flag"), [(np.nan, wire.FLAG_NAN), (np.inf, wire.FLAG_POS_INF),
                                           (-np.inf, wire.FLAG_NEG_INF)])
def test_non_finite_values_are_flagged_per_block_not_refused(bad, flag):
    blocks = np.ones((3, K), np.float32)
    blocks[2, 5] = bad
    blocks[2, 6] = 3.0  # the finite maximum of the block: its exponent ignores the non-finite value
    exponents, flags = qz.inspect(blocks)
    assert exponents.tolist() == [0, 0, 1]
    assert flags.tolist() == [0, 0, flag]
    assert qz.block_exponents(blocks).tolist() == [0, 0, 1]
    finite = qz.finite_blocks(blocks, flags)
    assert finite[2, 5] == 0 and finite[2, 6] == 3.0 and np.isfinite(finite).all()
    assert np.isnan(blocks[2, 5]) or np.isinf(blocks[2, 5])  # the caller's array is not changed


def test_finite_input_has_no_flags_and_is_not_copied():
    blocks = np.ones((4, K), np.float32)
    exponents, flags = qz.inspect(blocks)
    assert exponents.tolist() == [0, 0, 0, 0]
    assert flags.tolist() == [0, 0, 0, 0]
    assert qz.finite_blocks(blocks, flags) is blocks


def test_a_block_of_only_non_finite_values_has_no_exponent():
    blocks = np.full((1, K), -np.inf, np.float32)
    blocks[0, 0] = np.nan
    exponents, flags = qz.inspect(blocks)
    assert exponents.tolist() == [qz.EXP_NONE]
    assert flags.tolist() == [wire.FLAG_NAN | wire.FLAG_NEG_INF]


def test_decoding_follows_ieee_sums_per_block():
    """The table of docs/protocol.md, "Non-finite values": NaN wins, +inf and -inf together make NaN."""
    sums = np.zeros((6, K), qz.WIRE_DTYPE)
    sums[:, 0] = 1 << 20
    exponents = np.zeros(6, np.int8)
    flags = np.array([0, wire.FLAG_NAN, wire.FLAG_POS_INF, wire.FLAG_NEG_INF, wire.FLAG_POS_INF | wire.FLAG_NEG_INF,
                      wire.FLAG_NAN | wire.FLAG_POS_INF | wire.FLAG_OUT_OF_STEP], np.uint8)
    plain = qz.dequantize(sums, exponents, 3)
    out = qz.dequantize(sums, exponents, 3, flags=flags)
    np.testing.assert_array_equal(out[0], plain[0])
    assert np.isnan(out[1]).all() and np.isnan(out[4]).all() and np.isnan(out[5]).all()
    assert (out[2] == np.inf).all() and (out[3] == -np.inf).all()


def test_block_exponents_rejects_wrong_shapes():
    with pytest.raises(TypeError):
        qz.block_exponents(np.zeros((2, K), np.float64))
    with pytest.raises(TypeError):
        qz.block_exponents(np.zeros((2, K + 1), np.float32))
    assert qz.block_exponents(np.zeros((0, K), np.float32)).size == 0


def test_all_zeros_come_back_exactly_zero():
    result = simulate([np.zeros((2, K), np.float32) for _ in range(4)])
    assert (result["exp"] == qz.EXP_NONE).all()
    assert not result["f32"].any()


def test_32_workers_at_float32_max_do_not_overflow():
    n = 32
    blocks = [np.full((1, K), F32_MAX, np.float32) for _ in range(n)]
    for worker in blocks[: n // 2]:
        worker[0, 1::2] = -F32_MAX  # odd columns: 16 positive, 16 negative
    result = simulate(blocks)  # asserts the int64 sum fits int32 and equals the wrapped sum
    assert result["exp"][0] == 127
    assert np.isfinite(result["f64"]).all()
    assert_within_bound(result, n)
    assert result["exact_int"][0, 0] == n * (2 ** qz.scale_bits(n) - 2 ** (qz.scale_bits(n) - 24))
    # float32 overflows only where the exact sum (32 x max) is beyond its range.
    assert np.isinf(result["f32"][0, 0::2]).all()
    assert (result["f32"][0, 1::2] == 0).all()


def test_32_workers_with_mixed_signs_at_the_rounding_edge():
    # The largest float32 below 2**(E+1) scales to 2**P - 2**(P-24): never rounds up to 2**P.
    n = 32
    edge = np.nextafter(np.float32(2.0), np.float32(0.0))
    result = simulate([np.full((1, K), edge, np.float32) for _ in range(n)])
    assert result["exact_int"].max() == n * (2 ** qz.scale_bits(n) - 2 ** (qz.scale_bits(n) - 24))
    assert_within_bound(result, n)


def test_denormals_and_tiny_values():
    n = 3
    rng = np.random.default_rng(1)
    tiny = [(rng.standard_normal((2, K)) * 1e-39).astype(np.float32) for _ in range(n)]  # denormals
    tiny[0][1] = SMALLEST_DENORMAL
    result = simulate(tiny)
    assert (result["exp"] == qz.EXP_MIN).all()
    assert_within_bound(result, n)
    # The quantum at EXP_MIN is 2**(-126-P): far below the smallest denormal, so the sum is exact.
    np.testing.assert_array_equal(result["f64"], result["truth"])


def test_mixed_scales_keep_relative_precision_per_block():
    n = 4
    rng = np.random.default_rng(2)
    scales = np.array([1e30, 1.0, 1e-20, 1e-38])[:, None]
    blocks = [(rng.standard_normal((4, K)) * scales).astype(np.float32) for _ in range(n)]
    result = simulate(blocks)
    assert_within_bound(result, n)
    block_max = np.abs(result["truth"]).max(axis=1, keepdims=True)
    relative = np.abs(result["f64"] - result["truth"]) / block_max
    assert relative.max() < 2.0**-20  # each block is scaled by its own exponent


@st.composite
def worker_arrays(draw) -> list[np.ndarray]:
    """n workers' blocks at one drawn magnitude, optionally with arbitrary float32 bit patterns mixed in."""
    n = draw(st.sampled_from([1, 2, 3, 5, 8, 17, 32]))
    num_blocks = draw(st.integers(1, 3))
    magnitude = draw(st.integers(-150, 127))
    spikes = draw(st.floats(0.0, 1.0))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = rng.uniform(-2, 2, (n, num_blocks, K)) * 2.0**magnitude
    arrays = base.clip(-F32_MAX, F32_MAX).astype(np.float32)
    bits = rng.integers(0, 2**32, arrays.shape, dtype=np.uint64).astype(np.uint32).view(np.float32)
    mask = (rng.random(arrays.shape) < spikes) & np.isfinite(bits)
    arrays[mask] = bits[mask]
    return list(arrays)


@settings(max_examples=300, deadline=None)
@given(worker_arrays())
def test_error_bound_holds_and_never_overflows(arrays):
    result = simulate(arrays)
    assert_within_bound(result, len(arrays))


@settings(max_examples=100, deadline=None)
@given(worker_arrays())
def test_decode_of_the_same_sums_is_deterministic_and_float32_is_the_rounded_float64(arrays):
    result = simulate(arrays)
    again = qz.dequantize(result["sums"].copy(), result["exp"], len(arrays))
    np.testing.assert_array_equal(again, result["f32"])
    # float32 decode == float64 decode rounded to float32, except possibly in the denormal range.
    normal = np.abs(result["f64"]) >= np.finfo(np.float32).tiny
    with np.errstate(over="ignore"):
        rounded = result["f64"][normal].astype(np.float32)
    np.testing.assert_array_equal(result["f32"][normal], rounded)
