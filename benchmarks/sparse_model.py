"""A sparse click-through workload for ``make bench-sparse``: Zipf feature ids, an embedding table and an MLP.

Each example has ``fields`` categorical features. A feature's id is a Zipf(``alpha``)
popularity rank mapped through a fixed random permutation of the ``num_rows`` ids
(``shift`` rotates the ranking: the drift experiment). Its label is drawn from
``sigmoid(scale * sum of the ids' hidden weights)``, so the ids carry the signal and a
model must learn their embeddings. The model (numpy only): embeddings of width ``width``,
concatenated, one ReLU layer of ``hidden`` units, a sigmoid output; plain SGD.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from netagg.hoststack.sparse_store import initial_rows


@dataclass(frozen=True)
class ClickData:
    """The synthetic data set (see the module docstring); every worker makes the same one from the seed."""

    num_rows: int = 100_000
    fields: int = 8
    alpha: float = 1.2
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "_perm", np.random.default_rng(self.seed).permutation(self.num_rows))

    def ids(self, ranks: np.ndarray, shift: int = 0) -> np.ndarray:
        return self._perm[(ranks + shift) % self.num_rows]  # type: ignore[attr-defined]

    def batch(self, stream: int, index: int, size: int, shift: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Examples ``(ids (size, fields), labels (size,))`` of one stream (a worker, or the test set)."""
        rng = np.random.default_rng([self.seed, stream, index])
        ranks = rng.zipf(self.alpha, (size, self.fields)) - 1
        ids = self.ids(ranks, shift)
        hidden = initial_rows(ids.reshape(-1), 1, 1.0, self.seed + 7).reshape(size, self.fields)
        logit = 1.25 * hidden.sum(axis=1, dtype=np.float64)
        labels = (rng.random(size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return ids, labels


class ClickModel:
    """The MLP over concatenated embeddings; the embedding rows live outside (a sparse table)."""

    def __init__(self, fields: int, width: int, hidden: int = 32, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.fields, self.width, self.hidden = fields, width, hidden
        self.w1 = (rng.standard_normal((fields * width, hidden)) / np.sqrt(fields * width)).astype(np.float32)
        self.b1 = np.zeros(hidden, np.float32)
        self.w2 = (rng.standard_normal(hidden) / np.sqrt(hidden)).astype(np.float32)
        self.b2 = np.zeros(1, np.float32)

    def dense(self) -> list[np.ndarray]:
        return [self.w1, self.b1, self.w2, self.b2]

    def flat_size(self) -> int:
        return sum(p.size for p in self.dense())

    def step_dense(self, flat_grad: np.ndarray, lr: float) -> None:
        start = 0
        for param in self.dense():
            param -= np.float32(lr) * flat_grad[start:start + param.size].reshape(param.shape)
            start += param.size

    def predict(self, rows: np.ndarray, inverse: np.ndarray) -> np.ndarray:
        x = rows[inverse].reshape(inverse.shape[0], -1)
        h = np.maximum(x @ self.w1 + self.b1, 0)
        return 1.0 / (1.0 + np.exp(-(h @ self.w2 + self.b2[0])))

    def gradients(self, rows: np.ndarray, inverse: np.ndarray, labels: np.ndarray
                  ) -> tuple[float, np.ndarray, np.ndarray]:
        """(mean log loss, gradient of the mean loss for each of ``rows``, flat gradient of the dense parameters)."""
        size = labels.size
        x = rows[inverse].reshape(size, -1)
        z1 = x @ self.w1 + self.b1
        h = np.maximum(z1, 0)
        p = 1.0 / (1.0 + np.exp(-(h @ self.w2 + self.b2[0])))
        eps = 1e-7
        loss = float(-np.mean(labels * np.log(p + eps) + (1 - labels) * np.log(1 - p + eps)))
        d_out = ((p - labels) / size).astype(np.float32)
        d_h = np.outer(d_out, self.w2) * (z1 > 0)
        flat = np.concatenate([(x.T @ d_h).reshape(-1), d_h.sum(axis=0), h.T @ d_out, [d_out.sum()]])
        d_x = (d_h @ self.w1.T).reshape(size * self.fields, self.width)
        d_rows = np.zeros_like(rows)
        np.add.at(d_rows, inverse.reshape(-1), d_x)
        return loss, d_rows, flat.astype(np.float32)


def accuracy(model: ClickModel, rows: np.ndarray, inverse: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean((model.predict(rows, inverse) > 0.5) == (labels > 0.5)))
