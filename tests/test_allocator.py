"""SlotAllocator: first fit, best effort, coalescing — and a property test of random sequences."""

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netagg.controller.allocator import AllocationError, SlotAllocator, SlotRange


def test_first_fit_and_coalescing():
    alloc = SlotAllocator(100)
    a, b, c = alloc.allocate(10), alloc.allocate(20), alloc.allocate(30)
    assert (a, b, c) == (SlotRange(0, 10), SlotRange(10, 20), SlotRange(30, 30))
    alloc.release(b)
    assert alloc.allocate(5) == SlotRange(10, 5)  # first fit reuses the hole
    alloc.release(SlotRange(10, 5))
    alloc.release(a)
    assert alloc.free_ranges[0] == SlotRange(0, 30)  # a and b's holes merged
    alloc.release(c)
    assert alloc.free_ranges == (SlotRange(0, 100),)


def test_best_effort_partial_then_none():
    alloc = SlotAllocator(16)
    assert alloc.allocate(12) == SlotRange(0, 12)
    assert alloc.allocate(8, minimum=4) == SlotRange(12, 4)  # partial: the largest free range
    assert alloc.allocate(4, minimum=1) is None
    assert alloc.free_slots == 0


def test_largest_range_wins_when_nothing_fits():
    alloc = SlotAllocator(20)
    ranges = [alloc.allocate(4) for _ in range(5)]
    alloc.release(ranges[0])
    alloc.release(ranges[2])
    alloc.release(ranges[3])
    assert alloc.allocate(10, minimum=2) == SlotRange(8, 8)


def test_reserve_and_errors():
    alloc = SlotAllocator(10)
    alloc.reserve(SlotRange(3, 4))
    assert alloc.free_ranges == (SlotRange(0, 3), SlotRange(7, 3))
    with pytest.raises(AllocationError, match="overlaps"):
        alloc.reserve(SlotRange(5, 4))
    with pytest.raises(AllocationError, match="free already"):
        alloc.release(SlotRange(0, 2))
    with pytest.raises(AllocationError, match="outside"):
        alloc.release(SlotRange(8, 5))
    with pytest.raises(AllocationError):
        alloc.allocate(0)


operations = st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 1000)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 200), ops=operations)
def test_random_sequences_never_overlap_leak_or_fragment(capacity, ops):
    alloc = SlotAllocator(capacity)
    used: list[SlotRange] = []
    for is_alloc, size, pick in ops:
        if is_alloc or not used:
            minimum = max(1, size // 2)
            largest_before = alloc.largest_free()
            got = alloc.allocate(size, minimum)
            if got is None:
                assert largest_before < minimum
            else:
                assert minimum <= got.count <= size
                assert got.count == size or got.count == largest_before
                used.append(got)
        else:
            alloc.release(used.pop(pick % len(used)))
        # No overlap between used ranges, nor between used and free.
        spans = sorted([(r.base, r.end, "u") for r in used] + [(r.base, r.end, "f") for r in alloc.free_ranges])
        for (_, end, _), (start, _, _) in pairwise(spans):
            assert end <= start
        # No leak: used + free cover the capacity exactly.
        assert sum(r.count for r in used) + alloc.free_slots == capacity
        # Coalesced: free ranges never touch.
        free = alloc.free_ranges
        assert all(a.end < b.base for a, b in pairwise(free))
