"""A worker's side of MLfabric's aggregation in the switch: its update summed in a subset round.

When the scheduler groups updates in the switch (``switch_aggregation``), each member gets the
group's members, the round base and the leader in its grant. :class:`SwitchSummer` runs the
subset exchange through the job's switch slots (:meth:`KVWorker.allreduce_subset`): every
member gets the sum of the members' updates. A failed exchange (a member or the switch gone
quiet) raises :class:`SwitchAggregationFailed`; the next exchange starts on a fresh transport.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from netagg.hoststack.kv import KVWorker
from netagg.hoststack.transport import SubsetRound, TransportError
from netagg.jobconfig import WorkerConfig


class SwitchAggregationFailed(RuntimeError):
    """The subset exchange did not complete; the member sends its own update instead."""


class SwitchSummer:
    """Subset exchanges of one worker of a ``switch_aggregation`` job."""

    def __init__(self, config: WorkerConfig, *, progress_timeout: float = 5.0, **options: Any) -> None:
        if not config.switch_aggregation:
            raise ValueError(f"job {config.job_id} does not aggregate in the switch (switch_aggregation: false)")
        self.config = config
        self.options = {"progress_timeout": progress_timeout, **options}
        self.exchanges = 0
        self.failures = 0
        self._worker: KVWorker | None = None

    def sum(self, update: np.ndarray, members: int, round_base: int) -> np.ndarray:
        """The sum of the members' updates (this one's included), as float32 of ``update``'s shape."""
        if self._worker is None:
            self._worker = KVWorker(self.config, **self.options)
        try:
            total = self._worker.allreduce_subset(np.ascontiguousarray(update, np.float32),
                                                  SubsetRound(members, round_base))
        except (TransportError, ValueError) as err:
            self.failures += 1
            self.close()
            raise SwitchAggregationFailed(str(err)) from None
        self.exchanges += 1
        return total

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
