"""The MLfabric PS's worker ops: hello, init, pull, push, request, agg_grant, model_blocks, outcome, halt, stats.

:class:`WorkerOps` is mixed into :class:`~netagg.mlfabric.async_server.FabricServer`, whose dispatch
serves the worker ops on the primary only (a replica refuses them until promoted). The ops are
listed in docs/mlfabric.md.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from netagg.framed_server import Frame, Handler
from netagg.mlfabric.held_pushes import FREE
from netagg.mlfabric.model_updates import APPLIED
from netagg.mlfabric.outcome_window import update_step
from netagg.mlfabric.protocol import from_blob
from netagg.mlfabric.scheduler import AGGREGATE, DROP, TransferRequest

#: Update ids whose switch group's sum will not come, kept for their members' ``outcome`` (the oldest go first).
SWITCH_FAILED_KEPT = 4096


class WorkerOps:
    """The worker ops of a :class:`~netagg.mlfabric.async_server.FabricServer` (a mixin)."""

    def _worker_handlers(self) -> dict[str, Handler]:
        """The ops only the primary serves, by name."""
        return {"hello": self._op_hello, "init": self._op_init, "pull": self._op_pull, "push": self._op_push,
                "request": self._op_request, "agg_grant": self._op_agg_grant, "outcome": self._op_outcome,
                "model_blocks": self._op_model_blocks, "fold": self._op_fold, "halt": self._op_halt}

    def _op_hello(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        rank = header["rank"]
        agg = header.get("agg")
        if agg is not None and not (isinstance(agg, list) and len(agg) == 2 and isinstance(agg[0], str)
                                    and isinstance(agg[1], int)):
            raise ValueError(f"agg: expected [host, port], got {agg!r}")
        with self._cond:
            info = self.workers.setdefault(rank, {"agg": None})
            if agg is not None:  # a worker's second connection (its aggregator's) does not unset it
                info["agg"] = agg
            if len(self.workers) == self.num_workers and self.started_at is None:
                self.started_at = time.monotonic()
            self._cond.notify_all()
        if self.grants is not None:
            self.grants.register(rank, can_aggregate=agg is not None)
        return {"ok": True, "role": self.role, "version": self.version, "num_workers": self.num_workers,
                "update_mode": self.update_mode, "delay_bound": self.delay_bound, "schedule": self.config.schedule,
                "initialized": self.model is not None}, b""

    def _op_init(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        values = from_blob(frame.blob)
        if values.size == 0 or not np.isfinite(values).all():
            raise ValueError("init: the model must be non-empty and finite")
        with self._cond:
            if self.model is not None:
                if values.size != self.model.size:
                    raise ValueError(f"init: {values.size} values, the model has {self.model.size}")
                return {"ok": True, "initialized_now": False, "version": self.version}, b""
            seq = self._commit({"kind": "init"}, values.tobytes(), lambda: self._apply_init(values))
        self._await_safe(seq)
        return {"ok": True, "initialized_now": True, "version": 0}, b""

    def _op_pull(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        min_version = int(header.get("min_version", 0))
        timeout = min(float(header.get("timeout", self.pull_timeout)), self.pull_timeout)
        with self._cond:
            self._cond.wait_for(lambda: self.halted or (
                self.model is not None and self.version >= min_version and self._gate_open()), timeout)
            if self.model is None:
                raise ValueError("pull: the model was never initialized")
            if not self.halted and self.version < min_version:
                raise ValueError(f"pull: version {min_version} not reached within {timeout:.1f} s "
                                 f"(at {self.version})")
            self.started_at = self.started_at or time.monotonic()  # waited long enough for the others
            response = {"ok": True, "version": self.version, "halted": self.halted, "size": int(self.model.size)}
            model, seq = self.model.tobytes(), self.seq
            self.stats.pulls += 1
            self.stats.pull_bytes += len(model)
        # Only replicated state is read: a gradient is never computed on a model a failover could lose.
        self._await_safe(seq)
        return response, model

    def _gate_open(self) -> bool:
        if self.started_at is None and time.monotonic() - self._created > self.gate_timeout:
            self.started_at = time.monotonic()
        return self.started_at is not None

    def _op_push(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        rank = header["rank"]
        parts = self._parts(header)
        # ``rest``: the push holds only the values of this update that its switch group's sum did not (the PS's
        # mask of them, in order); see ModelUpdates._push_async.
        rest = header.get("rest")
        if rest is not None and (isinstance(rest, bool) or not isinstance(rest, int) or rest <= 0
                                 or header.get("parts") is not None or self.update_mode == "sync"):
            raise ValueError(f"rest: {rest!r} must be a positive count of values, in a worker's push of its own to "
                             "an async PS (the rest of a switch group)")
        with self._cond:
            self.stats.pushes += 1
            self.stats.push_bytes += len(frame.blob)
            if self.model is None:
                raise ValueError("push before the model was initialized")
            grad = from_blob(frame.blob, self.model.size if rest is None else rest)
        if not np.isfinite(grad).all():
            raise ValueError("push: the update has NaN or Inf values")
        if self.grants is not None:
            self.grants.observe(rank, len(frame.blob), frame.last_byte - frame.first_byte)
            if header.get("parts") is None:
                self._own_push_in_group(str(header["update_id"]), rank)
        ids = [p[0] for p in parts]
        try:
            if self.update_mode == "sync":
                outcome = self._push_sync(rank, parts, grad)
            elif header.get("parts") is None and rest is None and (held := self._hold(parts[0], grad)) is not None:
                outcome = held
            else:
                outcome = self._push_async(parts, grad, compact=rest is not None)
        finally:
            if self.grants is not None:
                self.grants.settled(ids)
        if outcome["outcome"] == APPLIED:
            self._await_safe(outcome["seq"])
        return {"ok": True, **outcome, "halted": self.halted}, b""

    def _hold(self, part: tuple[str, int, int], grad: np.ndarray) -> dict[str, Any] | None:
        """A worker's own push held for the next switch group (mlfabric/held_pushes.py): its outcome once applied
        (or dropped) with a group; None if it is not held, or no group took it within the scheduler's
        ``max_defer``, or its group failed: then it is applied alone."""
        grants = self.grants
        if grants is None or grants.in_switch_group(part[0]):  # a member's own push: its group may still apply it
            return None
        with self._cond:
            if (not self.hold_pushes or self.switch_member is None or not grants.gang
                    or self.role != "primary" or self.model is None or grad.size != self.model.size
                    or part[0] in self._remainders or self._outcome(part[0], part[1]) is not None
                    or (self.delay_bound is not None and self.version - part[2] > self.delay_bound)):
                return None
        entry = self._held.hold(part, grad)
        if entry is None:
            return None
        release_at = time.monotonic() + grants.scheduler.max_defer
        with self._cond:
            self.stats.held_pushes += 1
            while (outcome := self._outcome(part[0], part[1])) is None:
                stopping = self._stop.is_set()
                if entry.state == FREE or ((time.monotonic() >= release_at or stopping) and self._held.release(entry)):
                    if stopping:
                        raise ValueError("push: the PS is stopping (not applied)")
                    self.stats.held_alone += 1
                    return None
                if stopping:  # its group was planned: its outcome comes with the group's
                    raise ValueError("push: the PS is stopping (held for a switch group; push it again)")
                self._cond.wait(0.05)
            self.stats.held_in_groups += 1
        return outcome

    def _own_push_in_group(self, update_id: str, rank: int) -> None:
        """A member of a switch group in flight pushes its own update (its exchange failed or gave up): the
        group's sum, which holds it, can no longer be applied, so the other members waiting for the group's
        outcome learn it at once and push their own (before, they waited out their outcome timeout, 20 s,
        when a leader gave up while the others had the sum)."""
        assert self.grants is not None
        others = self.grants.switch_parts_besides(update_id)
        if not others:
            return
        with self._cond:
            self._switch_sum_will_not_come(others, f"rank {rank}, a member, pushed its own update", replace=False)

    def _switch_sum_will_not_come(self, update_ids: list[str], reason: str, *, replace: bool = True) -> None:
        """(Holding ``self._cond``.) The members of these updates' switch group get no sum for them: ``outcome``
        tells them at once (``reason``; ``replace`` false keeps an earlier one) and they push their own."""
        for update_id in update_ids:
            if replace or update_id not in self._switch_failed:
                self._switch_failed[update_id] = reason
        while len(self._switch_failed) > SWITCH_FAILED_KEPT:
            self._switch_failed.popitem(last=False)
        self._cond.notify_all()

    def _parts(self, header: dict[str, Any]) -> list[tuple[str, int, int]]:
        """The gradients in a push: ``parts`` (an aggregate) or the sender's own update."""
        raw = header.get("parts")
        if raw is None:
            raw = [[header["update_id"], header["rank"], header["version"]]]
        if not isinstance(raw, list) or not raw:
            raise ValueError("parts: expected a non-empty list of [update_id, rank, version]")
        parts = []
        for part in raw:
            if not (isinstance(part, list) and len(part) == 3 and isinstance(part[0], str)
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in part[1:])):
                raise ValueError(f"parts: bad entry {part!r} (expected [update_id, rank, version])")
            update_id, rank, version = part
            if not 0 <= rank < self.num_workers:
                with self._cond:
                    self.stats.unknown_workers += 1
                raise ValueError(f"unknown worker: rank {rank} in parts")
            update_step(update_id, rank)
            if version < 0 or version > self.version:
                raise ValueError(f"update {update_id}: version {version} is not one this PS had "
                                 f"(0..{self.version})")
            parts.append((update_id, rank, version))
        if len({p[0] for p in parts}) != len(parts):
            raise ValueError("parts: an update id appears twice")
        return parts

    def _op_request(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        if self.grants is None:
            raise ValueError(f"this job's schedule is {self.config.schedule}: push without asking")
        arrived = time.monotonic()
        header = frame.header
        request = TransferRequest(rank=header["rank"], update_id=str(header["update_id"]),
                                  version=int(header["version"]), size=int(header["size"]),
                                  norm=float(header.get("norm", 0.0)), arrival=self.grants.clock())
        if request.size <= 0 or not math.isfinite(request.norm):
            raise ValueError(f"request: size {request.size} and norm {request.norm} must be > 0 and finite")
        if "rate" in header:
            rate = header["rate"]
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
                raise ValueError(f"request: rate {rate!r} must be a positive number of bytes/s")
            self.grants.hint(request.rank, float(rate))
        if "receiving" in header:
            if not isinstance(header["receiving"], bool):
                raise ValueError(f"request: receiving {header['receiving']!r} must be true or false")
            with self._cond:
                self._receiving[request.rank] = header["receiving"]
        try:
            decision = self.grants.request(request, timeout=self.pull_timeout)
        except TimeoutError as err:
            raise ValueError(str(err)) from None
        # ``held``: the seconds this request spent at the PS, so that the worker can tell the wire's share of its wait.
        response: dict[str, Any] = {"ok": True, "action": decision.action, "reason": decision.reason,
                                    "predicted_delay": decision.predicted_delay, "halted": self.halted,
                                    "held": round(time.monotonic() - arrived, 6)}
        if decision.action == DROP:
            # The version the next step should start from: a stale gang request's round (``predicted_version``), or
            # at least the PS's own. Without it a worker that takes its models from the switch started again from
            # the same old version it had cached, and was dropped again, every step (measured: the slow worker of
            # the dynamic cluster, 13 steps on version 2, each dropped for its delay).
            response["version"] = max(self.version, decision.predicted_version or 0)
        if decision.action == AGGREGATE and decision.group is not None and self.grants.switch_slots:
            switch = self.grants.switch_grant(decision.group)
            if switch is not None:  # summed in the switch: a subset round of the group's members
                response.update(group=decision.group, aggregator=decision.aggregator,
                                group_size=len(switch["parts"]), switch=switch)
                return response, b""
        if decision.action == AGGREGATE:
            assert decision.aggregator is not None and decision.group is not None
            with self._cond:
                agg = self.workers.get(decision.aggregator, {}).get("agg")
            if agg is None:  # cannot happen: only workers with an aggregation endpoint aggregate
                raise ValueError(f"aggregator {decision.aggregator} has no aggregation endpoint")
            response.update(group=decision.group, aggregator=decision.aggregator, agg=agg,
                            group_size=len(self.grants.group_members(decision.group)))
        return response, b""

    def _op_agg_grant(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        if self.grants is None:
            raise ValueError(f"this job's schedule is {self.config.schedule}: there are no aggregation groups")
        group = self.grants.group_slot(int(frame.header["group"]), timeout=self.pull_timeout)
        return {"ok": True, "members": list(group.members)}, b""

    def _op_model_blocks(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        """Blocks of a version the distribution sender sent lately (a worker repairs its copy)."""
        if self.distribution is None:
            raise ValueError("this PS does not distribute the model through the switch")
        header = frame.header
        version = int(header["version"])
        raw = header.get("ranges")
        if not isinstance(raw, list) or len(raw) > 65536 or not all(
                isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) and 0 <= r[0] < r[1]
                for r in raw):
            raise ValueError("model_blocks: ranges must be a list of [start, end) block numbers")
        if sum(end - start for start, end in raw) > 1 << 16:  # a version has at most 2**16 blocks
            raise ValueError("model_blocks: more blocks asked for than a version has")
        blocks = self.distribution.blocks(version, [(a, b) for a, b in raw])
        if blocks is None:
            return {"ok": True, "found": False}, b""
        return {"ok": True, "found": True, "blocks": int(blocks.shape[0])}, blocks.tobytes()

    def _op_outcome(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        """A member of a switch group waits for its update's outcome (the leader pushed the sum, or the PS
        received it from the switch): ``known`` is false after ``timeout`` seconds without one, or at once when
        the PS's own part in the group failed (the member then pushes its own update)."""
        header = frame.header
        update_id, rank = str(header["update_id"]), int(header["rank"])
        update_step(update_id, rank)
        timeout = min(max(float(header.get("timeout", 10.0)), 0.0), self.pull_timeout)
        deadline = time.monotonic() + timeout
        with self._cond:
            while (outcome := self._outcome(update_id, rank)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"ok": True, "known": False}, b""
                if (failed := self._switch_failed.get(update_id)) is not None:
                    return {"ok": True, "known": False, "reason": f"the PS's part in the switch group: {failed}"}, b""
                self._cond.wait(left)
            rest = self._remainders.get(update_id)
        if outcome.get("outcome") == APPLIED and "seq" in outcome:
            self._await_safe(outcome["seq"])
        # Where nobody pushes a group's sum (the PS received it from the switch), this is how members learn
        # that the job was halted; and a part the sum held only in part, that it pushes its update for the rest.
        extra = {} if rest is None else {"rest": int(rest.sum()), "fold": self.fold_rests}
        return {"ok": True, "known": True, "duplicate": True, **outcome, **extra, "halted": self.halted}, b""

    def _op_fold(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        """A member of a closed switch group carries the rest of its update (the ``rest`` values the sum lacked,
        which it names by their count) into its next update instead of pushing it (error feedback): the PS expects
        no push of it any more. Refused unless such a rest waits for this update and has that many values; a push
        of it afterwards gets the group's outcome again (nothing is applied twice)."""
        header = frame.header
        update_id, rank, count = str(header["update_id"]), int(header["rank"]), header.get("rest")
        update_step(update_id, rank)
        if not self.fold_rests:
            raise ValueError("fold: this PS applies rests from their members' pushes only (--no-fold-rests)")
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise ValueError(f"fold: rest {count!r} must be a positive count of values")
        with self._cond:
            rest = self._remainders.get(update_id)
            if rest is None:
                raise ValueError(f"fold: no rest of a switch group waits for {update_id}")
            if int(rest.sum()) != count:
                raise ValueError(f"fold: {update_id}'s rest has {int(rest.sum())} values, not {count}: push it")
            del self._remainders[update_id]
            self.stats.remainders_folded += 1
            self._cond.notify_all()
        return {"ok": True, "folded": count}, b""

    def _op_halt(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        with self._cond:
            seq = self._commit({"kind": "halt"}, b"", self._apply_halt) if not self.halted else 0
        if seq:
            self._await_safe(seq)
        return {"ok": True}, b""

    def _op_stats(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        with self._cond:
            stats = asdict(self.stats)
            stats["applied_by_rank"] = {str(k): v for k, v in self.stats.applied_by_rank.items()}
            stats["dropped_by_rank"] = {str(k): v for k, v in self.stats.dropped_by_rank.items()}
            forwarder = self.forwarder
            result: dict[str, Any] = {
                "ok": True, "role": self.role, "version": self.version, "seq": self.seq, "halted": self.halted,
                "caught_up": self._caught_up, "upstream": self._upstream,
                "superseded": forwarder is not None and forwarder.superseded,
                "initialized": self.model is not None, "started_at": self.started_at, "stats": stats,
                "max_delay": self.max_delay,
                "delay_histogram": {str(d): n for d, n in sorted(self.delay_histogram.items())},
                "log_size": self.log.maxlen, "logged": len(self.log), "outcomes_kept": len(self._outcomes),
            }
            if frame.header.get("log"):
                result["log"] = [asdict(e) for e in self.log]
            if self.distribution is not None:
                result["distribution"] = asdict(self.distribution.stats)
            if self.switch_member is not None:
                result["switch_member"] = asdict(self.switch_member.stats)
            if (forwarder := self._live_forwarder()) is not None:
                snapshots_sent = forwarder.snapshots_sent  # read first: it counts acknowledged transfers
                result["replication"] = {"successor": list(forwarder.successor), "snapshots_sent": snapshots_sent,
                                         "acked_seq": forwarder.acked_seq, "head": forwarder.head,
                                         "lag": forwarder.lag, "records_sent": forwarder.records_sent,
                                         "last_error": forwarder.last_error}
            model = self.model.tobytes() if frame.header.get("model") and self.model is not None else b""
        if self.grants is not None:
            result["scheduler"] = self.grants.snapshot()
        return result, model
