"""benchmarks.tcp_share's arithmetic: bytes counted between two moments from the receiver's samples, and
each side's share of the link with its headers counted."""

from __future__ import annotations

import pytest

from benchmarks.cluster_allreduce import E_TCP
from benchmarks.tcp_share import bytes_between, netagg_share, tcp_share
from netagg import wire


def test_bytes_between_interpolates_between_samples_and_clamps_outside() -> None:
    samples = [(10.0, 0), (11.0, 1000), (13.0, 3000)]
    assert bytes_between(samples, 10.5, 12.0) == pytest.approx(1500.0)
    assert bytes_between(samples, 9.0, 10.0) == 0.0
    assert bytes_between(samples, 12.0, 20.0) == pytest.approx(1000.0)


def test_a_flow_at_the_links_rate_has_a_share_of_one() -> None:
    rate_mbit = 100.0
    payload_per_second = rate_mbit * 1e6 / 8 * E_TCP
    samples = [(0.0, 0), (2.0, int(2 * payload_per_second))]
    assert tcp_share(samples, 0.5, 1.5, rate_mbit) == pytest.approx(1.0, rel=1e-6)
    # netagg: a tensor of M bytes takes M / e of wire time per allreduce on each worker's link.
    seconds = 4e6 / wire.payload_efficiency(k=256) / (rate_mbit * 1e6 / 8)
    assert netagg_share(4_000_000, 256, seconds, rate_mbit) == pytest.approx(1.0)
    assert netagg_share(4_000_000, 256, 2 * seconds, rate_mbit) == pytest.approx(0.5)
