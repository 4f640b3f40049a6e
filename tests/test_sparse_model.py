"""bench-sparse's workload (benchmarks/sparse_model.py): the data are reproducible and the gradients are right."""

from __future__ import annotations

import numpy as np

from benchmarks.sparse_model import ClickData, ClickModel, accuracy


def test_data_are_reproducible_zipf_skewed_and_drift_rotates_the_ranking():
    data = ClickData(num_rows=5_000, fields=4, alpha=1.5, seed=2)
    ids, labels = data.batch(1, 7, 2_000)
    again, labels_again = ClickData(num_rows=5_000, fields=4, alpha=1.5, seed=2).batch(1, 7, 2_000)
    np.testing.assert_array_equal(ids, again)
    np.testing.assert_array_equal(labels, labels_again)
    assert ids.min() >= 0 and ids.max() < 5_000
    _, counts = np.unique(ids, return_counts=True)
    assert np.sort(counts)[-10:].sum() > 0.5 * ids.size  # ten ids carry most lookups
    top = data.ids(np.arange(10))
    shifted, _ = data.batch(1, 7, 2_000, shift=1_000)
    assert np.isin(ids, top).mean() > 0.5 and np.isin(shifted, top).mean() < 0.05
    assert 0.3 < labels.mean() < 0.8


def test_gradients_match_finite_differences():
    rng = np.random.default_rng(0)
    model = ClickModel(fields=3, width=4, hidden=5, seed=1)
    rows = rng.standard_normal((6, 4)).astype(np.float64)
    inverse = rng.integers(0, 6, (10, 3))
    labels = (rng.random(10) < 0.5).astype(np.float64)
    model.w1, model.b1, model.w2, model.b2 = (p.astype(np.float64) for p in model.dense())
    _, d_rows, d_dense = model.gradients(rows, inverse, labels)

    def loss() -> float:
        return model.gradients(rows, inverse, labels)[0]

    eps = 1e-6
    for index in [(0, 0), (3, 2), (5, 3)]:
        saved = rows[index]
        rows[index] = saved + eps
        up = loss()
        rows[index] = saved - eps
        down = loss()
        rows[index] = saved
        assert abs((up - down) / (2 * eps) - d_rows[index]) < 1e-5
    flat = np.concatenate([p.reshape(-1) for p in model.dense()])
    for position in [0, 17, flat.size - 6, flat.size - 1]:
        start = 0
        for param in model.dense():
            if position < start + param.size:
                view = param.reshape(-1)
                saved = view[position - start]
                view[position - start] = saved + eps
                up = loss()
                view[position - start] = saved - eps
                down = loss()
                view[position - start] = saved
                break
            start += param.size
        assert abs((up - down) / (2 * eps) - d_dense[position]) < 1e-5


def test_plain_sgd_learns_the_click_model():
    data = ClickData(num_rows=2_000, fields=4, alpha=1.5, seed=0)
    model = ClickModel(fields=4, width=8, seed=1)
    table = np.random.default_rng(3).uniform(-0.05, 0.05, (2_000, 8)).astype(np.float32)
    test_ids, test_labels = data.batch(99, 0, 2_000)
    keys, inverse = np.unique(test_ids, return_inverse=True)
    before = accuracy(model, table[keys], inverse.reshape(test_ids.shape), test_labels)
    for it in range(60):
        ids, labels = data.batch(0, it, 512)
        batch_keys, batch_inverse = np.unique(ids, return_inverse=True)
        _, d_rows, d_dense = model.gradients(table[batch_keys], batch_inverse.reshape(ids.shape), labels)
        table[batch_keys] -= 20.0 * d_rows
        model.step_dense(d_dense, 0.5)
    after = accuracy(model, table[keys], inverse.reshape(test_ids.shape), test_labels)
    assert after > before + 0.05, (before, after)
