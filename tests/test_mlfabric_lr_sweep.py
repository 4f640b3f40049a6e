"""The learning-rate sweep's update rules: what they apply, and the steps they count."""

import numpy as np

from benchmarks import mlfabric_lr_sweep as sweep


class _Quadratic:
    """loss = |w|^2 / 2, gradient w (the same for every worker and step): the rules' arithmetic in closed form."""

    initial = np.full(3, 1.0, np.float32)
    workers = 4

    def grad(self, w, step, rank):
        return w.copy()

    def loss(self, w):
        return float(np.sum(w * w) / 2)


def test_sum_mean_and_delayed_rules_step_as_documented():
    q = _Quadratic()
    # Mean of 4 at lr 0.5 halves w each round: loss 1.5 * 0.25^r; <= 0.1 after 2 rounds (0.094).
    assert sweep.rounds(q, 4, 0.5, True, 0.1, 10) == 2
    # The sum of 2 at lr 0.5 steps w to 0 at once.
    assert sweep.rounds(q, 2, 0.5, False, 1e-9, 10) == 1
    # Delay 0 is plain SGD: w *= 0.75 per gradient, loss 1.5 * 0.5625^t <= 0.1 after 5. With delay 3 the first
    # four gradients are all w0's: w = 0.75, 0.5, 0.25, so the loss (0.094) is under 0.1 after 3.
    assert sweep.stale(q, 0.25, 0, 0.1, 50) == 5
    assert sweep.stale(q, 0.25, 3, 0.1, 50) == 3
    assert sweep.stale(q, 3.0, 3, 0.1, 20) is None  # too large a step with delay: it diverges, never reaches


def test_the_sweep_runs_on_the_real_model_and_prints_every_rule(capsys):
    assert sweep.main(["--hidden", "8", "--target-loss", "2.2", "--cap", "3"]) == 0
    out = capsys.readouterr().out
    for rule in ("sync (mean of 4)", "async (delay 3)", "gang (sum of 2)", "gang (sum of 3)"):
        assert rule in out
