"""The transport's timeout estimator and congestion window on their own (hoststack/congestion.py): a growing
queue, spurious timeouts and real loss, driven with numbers, no sockets."""

from __future__ import annotations

import numpy as np
import pytest

from netagg.hoststack import congestion
from netagg.hoststack.congestion import CongestionWindow, RtoEstimator


@pytest.mark.parametrize("seed", range(20))
def test_rto_batch_update_equals_one_sample_at_a_time(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    rtts = rng.exponential(0.001, int(rng.integers(0, 60))) * rng.choice([1, 1, 50], 1)
    one = RtoEstimator(initial=0.05)
    for rtt in rtts.tolist():
        one.sample(rtt)
    batched = RtoEstimator(initial=0.05)
    for part in np.array_split(rtts, 3):
        batched.sample_all(part)
    monkeypatch.setattr(congestion, "kernels", None)
    reference = RtoEstimator(initial=0.05)
    for part in np.array_split(rtts, 3):
        reference.sample_all(part)
    for est in (batched, reference):
        assert (est.srtt, est.rttvar, est.rto, est.min_rtt) == (one.srtt, one.rttvar, one.rto, one.min_rtt)


def test_the_timeout_follows_a_growing_queue_and_keeps_the_path_minimum():
    est = RtoEstimator(initial=0.05, minimum=0.001)
    for _ in range(50):
        est.sample(0.002)
    assert est.min_rtt == 0.002 and est.rto < 0.004
    for step in range(1, 60):  # a queue builds: each round trip 1 % longer
        est.sample(0.002 * 1.01 ** step)
    assert est.srtt > 0.002 * 1.01 ** 50 and est.rto > est.srtt  # followed, not clipped away
    assert est.min_rtt == 0.002  # the path without the queue


def test_results_sooner_after_a_resend_than_the_path_allows_answer_the_originals():
    est = RtoEstimator()
    assert not est.spurious(np.array([0.0])).any()  # no sample yet: nothing can be told
    est.sample(0.004)
    verdict = est.spurious(np.array([0.0001, 0.0029, 0.0031, 0.010]))
    assert verdict.tolist() == [True, True, False, False]  # 0.75 x the 4 ms minimum


def test_a_spurious_timeout_undoes_its_cut_and_a_real_loss_keeps_it():
    w = CongestionWindow(64)
    assert w.on_timeout(1.0, srtt=0.01) and w.value == 32
    assert not w.on_timeout(1.005, srtt=0.01) and w.value == 32  # one loss event per round trip
    assert w.on_spurious() and w.value == 64 and w.stats.undone == 1
    assert not w.on_spurious()  # nothing left to undo
    assert w.on_timeout(2.0, srtt=0.01) and w.on_timeout(2.02, srtt=0.01) and w.value == 16
    w.on_loss_confirmed()  # the resend was needed: the cuts stand
    assert not w.on_spurious() and w.value == 16 and w.stats.decreases == 3 and w.stats.smallest == 16
    w.on_results(16)
    assert w.value == 17  # additive increase: one packet per window of results


def test_two_cuts_in_a_row_are_undone_to_the_value_before_the_first():
    w = CongestionWindow(40)
    w.on_timeout(1.0, srtt=0.01)
    w.on_timeout(1.1, srtt=0.01)
    assert w.value == 10
    assert w.on_spurious() and w.value == 40


def test_the_window_never_leaves_one_to_its_limit_and_is_fixed_when_disabled():
    w = CongestionWindow(8)
    for i in range(10):
        w.on_timeout(float(i), srtt=0.01)
    assert w.value == 1 and w.stats.smallest == 1
    for _ in range(200):
        w.on_results(8)
    assert w.value == 8
    fixed = CongestionWindow(8, enabled=False)
    assert not fixed.on_timeout(1.0, srtt=0.01) and fixed.value == 8
    fixed.on_results(100)
    assert fixed.value == 8


def test_congestion_marks_cut_by_alpha_once_per_round_trip_and_are_never_undone():
    """DCTCP's response to ECN CE on results: the first mark halves the window (alpha starts at 1); more marks
    within one round trip do not cut again; alpha follows the marked share per window, so a light, steady marking
    cuts ever less; a timeout's cut followed by marks is not undone by a later spurious verdict."""
    window = CongestionWindow(64)
    assert window.on_marks(8, 1, now=0.0, srtt=0.01) and window.value == 32
    assert not window.on_marks(8, 8, now=0.005, srtt=0.01) and window.value == 32  # same round trip
    assert not window.on_marks(8, 0, now=0.5, srtt=0.01)  # no mark: no cut
    for step in range(400):  # 1 result in 32 marked, for many windows: alpha falls toward 1/32
        window.on_results(32)
        window.on_marks(32, 1 if step % 2 else 0, now=1.0 + step, srtt=0.01)
    assert 0.015 < window.alpha < 0.05
    before = window.value
    assert window.on_marks(32, 1, now=1000.0, srtt=0.01)
    assert before * 0.97 < window.value < before  # a cut of alpha / 2, not a halving
    assert window.stats.ecn_cuts > 2 and window.stats.decreases == 0
    assert window.on_timeout(now=2000.0, srtt=0.01)
    cut = window.value
    window.on_marks(4, 1, now=2000.5, srtt=0.01)
    assert not window.on_spurious() and window.value <= cut  # congestion was seen: nothing to undo
    disabled = CongestionWindow(16, enabled=False)
    assert not disabled.on_marks(16, 16, now=0.0, srtt=0.01) and disabled.value == 16
