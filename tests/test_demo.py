"""The demo's core as an integration test: switch + controller + 4 workers training through the switch."""

import pytest

from netagg.apps.demo import run_demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_four_workers_train_through_the_switch(tmp_path):
    pytest.importorskip("sklearn", reason="the demo's data set comes with scikit-learn (the demo extra)")
    result = run_demo(tmp_path, num_workers=4, steps=30, slots=32, quiet=True)
    assert len(result.workers) == 4
    assert result.workers_agree, "every worker must apply the same aggregate every step"
    # Identical training up to quantization: the accuracy tracks the float32 reference.
    assert result.accuracy >= result.reference["test_accuracy"] - 0.03
    assert result.workers[0]["loss"] < 1.0
    # The switch really aggregated every block: 4 contributions per completed round.
    assert result.counters["results"] > 0
    assert result.counters["contributions"] == 4 * result.counters["results"]
    assert result.counters["rejects"] == 0
