"""The digits MLP the examples and the MLfabric benchmarks train: its loss alone and its gradients."""

from __future__ import annotations

import numpy as np

from examples.mlp_digits import init_params, loss, loss_and_grads


def _batch(n: int = 40, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 64)).astype(np.float32), rng.integers(0, 10, n)


def test_the_loss_alone_is_the_loss_of_loss_and_grads() -> None:
    """The benchmarks' monitor evaluates the forward pass alone: it must report the training loss bit for bit."""
    params = init_params(3, hidden=32)
    x, y = _batch()
    assert loss(params, x, y) == loss_and_grads(params, x, y)[0]
    assert loss(params, x[:1], y[:1]) == loss_and_grads(params, x[:1], y[:1])[0]


def test_the_gradients_are_the_loss_s_slope() -> None:
    """Central differences of the loss (float64) match the analytic gradient of each parameter array."""
    params = [p.astype(np.float64) for p in init_params(5, hidden=8)]
    x, y = _batch(12, seed=2)
    _, grads = loss_and_grads(params, x.astype(np.float64), y)
    h = 1e-6
    for array, grad in zip(params, grads):
        index = np.unravel_index(int(np.argmax(np.abs(grad))), array.shape)
        saved = array[index]
        array[index] = saved + h
        up = loss(params, x.astype(np.float64), y)
        array[index] = saved - h
        down = loss(params, x.astype(np.float64), y)
        array[index] = saved
        assert np.isclose((up - down) / (2 * h), grad[index], rtol=1e-3, atol=1e-6)
