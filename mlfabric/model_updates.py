"""How the MLfabric PS changes its model: async and sync pushes, drops, the log, chain records.

:class:`ModelUpdates` is mixed into :class:`~netagg.mlfabric.async_server.FabricServer` and works on
its state (model, version, record number, outcome window, log) under its lock ``_cond``. Every change
is a record handed to the chain's successor (:meth:`ModelUpdates._commit`); a push is acknowledged
only once its record is acknowledged down the chain (:meth:`ModelUpdates._await_safe`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from netagg.mlfabric.outcome_window import update_step
from netagg.mlfabric.replication import ReplicationStalled

APPLIED, DROPPED = "applied", "dropped"


@dataclass(frozen=True)
class LogEntry:
    """One applied gradient: its update id, sender rank, the version it was computed on, its delay."""

    seq: int
    update_id: str
    rank: int
    version: int
    delay: int


class ModelUpdates:
    """The model updates of a :class:`~netagg.mlfabric.async_server.FabricServer` (a mixin)."""

    def _outcome(self, update_id: str, rank: int) -> dict[str, Any] | None:
        return self._outcomes.get(rank, update_step(update_id, rank))

    def _remember(self, parts: Iterable[tuple[str, int, int]], outcome: dict[str, Any]) -> None:
        for update_id, rank, _ in parts:
            self._outcomes.put(rank, update_step(update_id, rank), outcome)

    def _duplicate(self, parts: list[tuple[str, int, int]]) -> dict[str, Any] | None:
        """The stored outcome if every part was seen; None if none was; ValueError if some were or expired."""
        expired = [i for i, rank, _ in parts if self._outcomes.expired(rank, update_step(i, rank))]
        if expired:
            self.stats.expired_ids += 1
            raise ValueError(f"updates {expired} are older than the last {self._outcomes.size} steps of their "
                             f"rank whose outcomes this PS keeps: refused, whether or not they were applied")
        seen = [(i, o) for i, rank, _ in parts if (o := self._outcome(i, rank)) is not None]
        if not seen:
            return None
        if len(seen) != len(parts):
            ids = {i for i, _ in seen}
            raise ValueError(f"updates {sorted(ids)} were already pushed, "
                             f"{sorted(p[0] for p in parts if p[0] not in ids)} were not")
        self.stats.duplicates += 1
        return {**seen[0][1], "duplicate": True}

    def _push_async(self, parts: list[tuple[str, int, int]], grad: np.ndarray, compact: bool = False,
                    holders: frozenset[int] = frozenset()) -> dict[str, Any]:
        """``compact``: ``grad`` holds only the values of a switch group's rest (the member's push of what the sum
        lacked, in the order of the PS's mask); refused unless such a rest waits for it and has as many values.
        ``holders``: ranks that hold ``grad`` (a switch group's members, who got its sum from the switch)."""
        with self._cond:
            if len(parts) == 1 and (rest := self._remainders.pop(parts[0][0], None)) is not None:
                if compact:
                    if grad.size != int(rest.sum()):
                        self._remainders[parts[0][0]] = rest
                        raise ValueError(f"{parts[0][0]}: {grad.size} values for a rest of {int(rest.sum())}: push "
                                         "the whole update")
                    assert self.model is not None
                    full = np.zeros(self.model.size, np.float32)
                    full[rest] = grad
                    grad = full
                return self._push_remainder(parts[0], grad, rest)
            if (previous := self._duplicate(parts)) is not None:
                return previous
            if compact:
                raise ValueError(f"{parts[0][0]}: no rest of a switch group waits for it: push the whole update")
            delays = [self.version - version for _, _, version in parts]
            if self.delay_bound is not None and max(delays) > self.delay_bound:
                return self._drop(parts, delays, f"delay {max(delays)} > bound {self.delay_bound}")
            delta = (-self.lr * grad).astype(np.float32)
            # A holder computes the new model itself where the update lands right on top of its version.
            on_top = frozenset(rank for _, rank, version in parts if rank in holders and version == self.version)
            return self._apply_update(parts, delays, delta, on_top)

    def _push_remainder(self, part: tuple[str, int, int], grad: np.ndarray, rest: np.ndarray) -> dict[str, Any]:
        """A member's push of an update that a switch group's sum held only in part (its rounds closed at the
        deadline without it in the others): the values in ``rest`` are applied as an update of their own (its
        delay checked against the bound; the version moves on by one), the others were applied with the sum."""
        delay = self.version - part[2]
        if self.delay_bound is not None and delay > self.delay_bound:
            self.stats.remainders_dropped += 1
            return self._drop([part], [delay], f"the rest of a switch group's update: delay {delay} > bound "
                                               f"{self.delay_bound}")
        delta = np.where(rest, (-self.lr * grad).astype(np.float32), np.float32(0))
        try:
            outcome = self._apply_update([part], [delay], delta)
        except ValueError:
            self._remainders[part[0]] = rest  # not applied (not replicated): the member's next push tries again
            raise
        self.stats.remainders_applied += 1
        return {**outcome, "remainder": int(rest.sum())}

    def _push_sync(self, rank: int, parts: list[tuple[str, int, int]], grad: np.ndarray) -> dict[str, Any]:
        if len(parts) != 1:
            raise ValueError("a sync job takes one worker's gradient per push, not aggregates")
        update_id, _, version = parts[0]
        deadline = time.monotonic() + self.sync_timeout
        with self._cond:
            if (previous := self._duplicate(parts)) is not None:
                return previous
            if version != self.version:
                return self._drop(parts, [self.version - version], f"sync round {version} is over "
                                  f"(the PS is at version {self.version})")
            if rank in self._round:
                raise ValueError(f"rank {rank} already pushed for version {version}")
            self._round[rank] = (update_id, grad)
            self._round_version = version
            if len(self._round) == self.num_workers:
                self._apply_round()
            while (outcome := self._outcome(update_id, rank)) is None:
                left = deadline - time.monotonic()
                if left <= 0:  # a worker is missing: apply what the round has
                    if self._round.get(rank, ("",))[0] != update_id:
                        raise ValueError(f"sync round {version}: {update_id} was not applied (the round failed)")
                    self.stats.partial_rounds += 1
                    self._apply_round()
                    continue
                self._cond.wait(min(left, 0.5))
            return outcome

    def _apply_round(self) -> None:
        """Apply the buffered sync round (holding the lock): ``w -= lr * mean``."""
        assert self.model is not None
        ranks = sorted(self._round)
        total = np.sum([self._round[r][1] for r in ranks], axis=0, dtype=np.float32)
        delta = (-(self.lr / np.float32(len(ranks))) * total).astype(np.float32)
        parts = [(self._round[r][0], r, self._round_version) for r in ranks]
        self._round = {}
        self._apply_update(parts, [self.version - self._round_version] * len(parts), delta)

    def _drop(self, parts: list[tuple[str, int, int]], delays: list[int], reason: str) -> dict[str, Any]:
        outcome = {"outcome": DROPPED, "reason": reason, "delays": delays, "version": self.version}
        self._remember(parts, outcome)
        for _, rank, _ in parts:
            self.stats.dropped += 1
            self.stats.dropped_by_rank[rank] += 1
        self._cond.notify_all()
        return outcome

    def _apply_update(self, parts: list[tuple[str, int, int]], delays: list[int],
                      delta: np.ndarray, holders: frozenset[int] = frozenset()) -> dict[str, Any]:
        """Apply and log one update (holding the lock); replicated before anyone is told. ``holders``: ranks that
        compute the model after it themselves (see :meth:`_publish`)."""
        meta = {"kind": "update", "parts": [list(p) for p in parts], "delays": delays}
        if self.grants is not None and self.grants.switch_slots:
            meta["switch_next"] = self.grants.switch_next
        try:
            seq = self._commit(meta, delta.tobytes(), lambda: self._apply_delta(parts, delays, delta))
        except ReplicationStalled as err:
            self.stats.replication_stalls += 1
            raise ValueError(f"not applied: {err}") from None
        outcome = {"outcome": APPLIED, "delays": delays, "version": self.version, "seq": seq}
        if self.update_mode == "async":  # the step (w -= lr * g): a switch group's members apply its sum too
            outcome["lr"] = float(self.lr)
        if self.distribution is not None and self.role == "primary":
            outcome["multicast"] = self._publish(seq, holders)
        self._remember(parts, outcome)
        self._cond.notify_all()
        return outcome

    def _publish(self, seq: int, holders: frozenset[int] = frozenset()) -> bool:
        """Hand the model just applied (record ``seq``) to the distribution sender: sent once replicated. Not
        sent where every worker still receiving the versions is among ``holders``, which compute it themselves:
        the copies would only fill the links their next switch group needs. Whether it is sent."""
        if self.distribution is None or self.role != "primary" or self.model is None:
            return False
        if holders and all(rank in holders or not self._receiving.get(rank, True) for rank in range(self.num_workers)):
            self.distribution.supersede(self.version)
            return False
        self.distribution.publish(self.version, self.model, lambda: self._await_safe(seq))
        return True

    def _commit(self, meta: dict[str, Any], blob: bytes, apply: Any) -> int:
        """Reserve room in the chain, apply, hand the record to the successor (holding the lock)."""
        forwarder = self._live_forwarder()
        if forwarder is not None:
            forwarder.reserve(self.ack_timeout)
        apply()
        self.seq += 1
        if forwarder is not None:
            forwarder.submit(self.seq, meta, blob)
        self._cond.notify_all()
        return self.seq

    def _switch_next(self) -> int:
        return self.grants.switch_next if self.grants is not None and self.grants.switch_slots else 0

    def _apply_init(self, values: np.ndarray) -> None:
        self.model = values.astype(np.float32).copy()
        self.version = 0

    def _apply_delta(self, parts: list[tuple[str, int, int]], delays: list[int], delta: np.ndarray) -> None:
        assert self.model is not None
        self.model += delta
        seq = self.seq + 1
        for (update_id, rank, version), delay in zip(parts, delays):
            self.log.append(LogEntry(seq, update_id, rank, version, delay))
            self.delay_histogram[delay] += 1
            self.max_delay = delay if self.max_delay is None else max(self.max_delay, delay)
            self.stats.applied_by_rank[rank] += 1
        self.version += len(parts)
        self.stats.applied += len(parts)
        self.stats.applies += 1
        if len(parts) > 1 and self.update_mode == "async":
            self.stats.aggregated_applies += 1

    def _await_safe(self, seq: int) -> None:
        """Return once record ``seq`` is acknowledged down the chain; ValueError (not acked) otherwise."""
        deadline = time.monotonic() + self.ack_timeout
        while (forwarder := self._live_forwarder()) is not None:
            if forwarder.wait_acked(seq, max(0.0, deadline - time.monotonic())):
                return
            if self.forwarder is forwarder or time.monotonic() >= deadline:
                with self._cond:
                    self.stats.replication_stalls += 1
                raise ValueError(f"applied at the primary but not acknowledged by the replica within "
                                 f"{self.ack_timeout:.1f} s: not safe, push again with the same update id")
        # No successor (any more): applied here is applied by the whole chain. A forwarder replaced meanwhile
        # (an unlink, a join) is asked again by the loop.

    def _apply_halt(self) -> None:
        self.halted = True
