"""Fragmentation: several keys of any shape and float dtype to K-value blocks and back."""

from __future__ import annotations

import numpy as np
import pytest

from netagg import wire
from netagg.hoststack import blocks as blk

K = wire.K


@pytest.mark.parametrize("shape", [(), (1,), (K - 1,), (K,), (K + 1,), (3, 5, 7), (2, K, 3), (0,), (4, 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_round_trip_keeps_shape_dtype_and_values(shape, dtype):
    rng = np.random.default_rng(0)
    value = rng.standard_normal(shape).astype(dtype)
    layout, blocks = blk.pack([7], [value])
    assert blocks.dtype == np.float32 and blocks.shape == (blk.blocks_for(value.size), K)
    (back,) = blk.unpack(layout, blocks)
    assert back.shape == value.shape and back.dtype == value.dtype
    np.testing.assert_array_equal(back, value.astype(np.float32).astype(dtype))


def test_several_keys_start_on_block_boundaries_and_pads_are_zero():
    values = [np.full(70, 1.0, np.float32), np.full((2, 3), 2.0, np.float16), np.full(K, 3.0, np.float64)]
    layout, blocks = blk.pack([5, 1, 9], values)
    assert layout.keys == [5, 1, 9] and layout.sizes == [70, 6, K]
    assert [(s.first_block, s.num_blocks) for s in layout.segments] == [(0, 2), (2, 1), (3, 1)]
    assert layout.num_blocks == 4
    np.testing.assert_array_equal(blocks[0], 1.0)
    np.testing.assert_array_equal(blocks[1, :6], 1.0)
    np.testing.assert_array_equal(blocks[1, 6:], 0.0)
    np.testing.assert_array_equal(blocks[2, :6], 2.0)
    np.testing.assert_array_equal(blocks[2, 6:], 0.0)
    np.testing.assert_array_equal(blocks[3], 3.0)
    out = blk.unpack(layout, blocks * 2)
    assert [o.dtype for o in out] == [np.float32, np.float16, np.float64]
    assert [o.shape for o in out] == [(70,), (2, 3), (K,)]
    assert [float(o.reshape(-1)[0]) for o in out] == [2.0, 4.0, 6.0]


def test_pack_copies_so_the_caller_may_reuse_its_array():
    value = np.ones(10, np.float32)
    _layout, blocks = blk.pack([0], [value])
    value[:] = 5
    assert blocks[0, 0] == 1.0


def test_bfloat16_as_uint16_round_trips_exactly():
    rng = np.random.default_rng(1)
    as_f32 = rng.standard_normal(300).astype(np.float32)
    bits = blk.float32_to_bfloat16(as_f32)
    layout, blocks = blk.pack([3], [bits.reshape(10, 30)])
    np.testing.assert_array_equal(blocks.reshape(-1)[:300], blk.bfloat16_to_float32(bits))
    (back,) = blk.unpack(layout, blocks)
    assert back.dtype == np.uint16 and back.shape == (10, 30)
    np.testing.assert_array_equal(back.reshape(-1), bits)


def test_float32_to_bfloat16_rounds_to_nearest_even():
    def f32(bits: int) -> np.ndarray:
        return np.array([bits], np.uint32).view(np.float32)

    assert blk.float32_to_bfloat16(f32(0x3F808000))[0] == 0x3F80  # tie, even stays
    assert blk.float32_to_bfloat16(f32(0x3F818000))[0] == 0x3F82  # tie, odd rounds up
    assert blk.float32_to_bfloat16(f32(0x3F808001))[0] == 0x3F81  # above the tie
    assert blk.float32_to_bfloat16(np.array([np.inf], np.float32))[0] == 0x7F80
    assert blk.float32_to_bfloat16(np.array([np.nan], np.float32))[0] == 0x7FC0


@pytest.mark.parametrize("value", [np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int64),
                                   np.array([True]), np.array(["a"])])
def test_non_float_values_are_rejected(value):
    with pytest.raises(TypeError, match="float32, float16, float64 or bfloat16"):
        blk.pack([0], [value])


def test_bad_keys_are_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        blk.pack([1, 1], [np.ones(2, np.float32)] * 2)
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        blk.pack([1, 2], [np.ones(2, np.float32)])
    with pytest.raises(TypeError, match="integers"):
        blk.pack(["w"], [np.ones(2, np.float32)])
    with pytest.raises(TypeError, match="integers"):
        blk.pack([True], [np.ones(2, np.float32)])


def test_unpack_checks_the_size():
    layout, blocks = blk.pack([0], [np.ones(65, np.float32)])
    with pytest.raises(ValueError, match="expected 128 values"):
        blk.unpack(layout, blocks[:1])


def test_torch_tensors_round_trip():
    torch = pytest.importorskip("torch")
    values = [torch.randn(3, 70), torch.randn(5).to(torch.bfloat16), torch.randn(2, 2).half()]
    layout, blocks = blk.pack([0, 1, 2], values)
    back = blk.unpack(layout, blocks)
    for original, restored in zip(values, back, strict=True):
        assert isinstance(restored, torch.Tensor)
        assert restored.dtype == original.dtype and restored.shape == original.shape
        assert torch.equal(restored, original)
