"""MLfabric's aggregation in the switch: a group's updates summed in a subset round of its members.

When the scheduler groups updates in the switch (``switch_aggregation``), each member gets the
group's members, the round base and the leader in its grant. :class:`SwitchSummer` runs the
subset exchange through the job's switch slots (:meth:`KVWorker.allreduce_subset`): every
member gets the sum of the members' updates. A failed exchange (a member or the switch gone
quiet) raises :class:`SwitchAggregationFailed`; the next exchange starts on a fresh transport.

:class:`SwitchMember` is the PS's side in a job whose PS chain has ranks of its own on the switch
(``ps_members``): the primary is a member of every switch group, contributes zeros, and receives
the group's sum from the switch like every other member (a lost result is sent again from the
switch's stored copy when the PS resends), so no worker has to push the sum to it.

Deadline rounds (docs/protocol.md, "Closing a round at a deadline"): a grant with ``deadline`` (seconds) makes
the PS close the group's rounds still open that long after its exchange began; a round then completes with the
members that arrived, and its result says who they are. Members accept such rounds (``partial``) and leave a
slot whose round closed without them. The PS, in every round, is the authority on who is in which block's sum:
:class:`SwitchMember` hands ``apply`` the values each part is missing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from netagg import wire
from netagg.hoststack.kv import KVWorker
from netagg.hoststack.threads import ThreadedTransport
from netagg.hoststack.transport import SubsetRound, Transport, TransportError
from netagg.jobconfig import WorkerConfig

log = logging.getLogger(__name__)


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
        # Made now, not at the first group: a fresh process loads its transport's compiled kernels here (0.5 s
        # idle, more on a busy host), and a member that pays that when its first group begins holds up the
        # group (the PS began its part when the group was planned). After a failure the next one is made lazily.
        self._worker: KVWorker | None = KVWorker(config, **self.options)

    def sum(self, update: np.ndarray, members: int, round_base: int, *, deadline: float | None = None,
            closer: bool = False, give_up: float | None = None) -> np.ndarray:
        """The sum of the members' updates (this one's included), as float32 of ``update``'s shape.

        ``deadline`` (seconds): the group's rounds may close without their slow members (this worker's own
        blocks may then be missing from the sum, see :attr:`last_members`); ``closer``: this worker closes them
        then. A member gives up ``deadline`` + 2 s after it began (:class:`SwitchAggregationFailed`); without a
        deadline, ``give_up`` s after it began (the group's rounds then fail: every member pushes its own)."""
        if self._worker is None:
            self._worker = KVWorker(self.config, **self.options)
        if deadline is None:
            subset = SubsetRound(members, round_base, give_up_after=give_up)
        elif closer:
            subset = SubsetRound(members, round_base, close_after=deadline)
        else:
            subset = SubsetRound(members, round_base, partial=True, give_up_after=deadline + 2.0)
        try:
            total = self._worker.allreduce_subset(np.ascontiguousarray(update, np.float32), subset)
        except (TransportError, ValueError) as err:
            self.failures += 1
            self.close()
            raise SwitchAggregationFailed(str(err)) from None
        self.exchanges += 1
        return total

    @property
    def transport(self) -> Transport | ThreadedTransport | None:
        """The worker's transport (None after a failure, until the next sum makes one): its counters and the last
        exchange's members and close requests."""
        return self._worker.transport if self._worker is not None else None

    @property
    def last_members(self) -> np.ndarray:
        """Per block of the last exchange: the ranks in its sum (bit r: rank r; 0: no sum here)."""
        t = self.transport
        return t.last_members if t is not None else np.zeros(0, np.uint32)

    def missing(self, ranks: list[int], values: int) -> dict[int, np.ndarray]:
        """For each of ``ranks`` whose update is not in every block of the last exchange's sum: a mask of the
        ``values`` it is missing from (blocks of the job's width, in order)."""
        members = self.last_members.astype(np.int64)
        k = self.config.width
        out = {}
        for rank in ranks:
            absent = (members >> rank) & 1 == 0
            if absent.any():
                out[rank] = np.repeat(absent, k)[:values]
        return out

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None


#: Exchanges whose start, duration and members SwitchMemberStats keeps.
EXCHANGES_KEPT = 1000


@dataclass
class SwitchMemberStats:
    """What the PS's switch member did: groups whose sum it received, groups that failed, bytes on its link."""

    groups: int = 0
    failures: int = 0
    #: Groups some of whose rounds closed at the deadline without a member, and the close requests sent.
    closed_groups: int = 0
    closes: int = 0
    #: netagg messages (UDP payloads) the PS sent (its zeros, resends included) and received (results).
    bytes_out: int = 0
    bytes_in: int = 0
    #: Seconds the PS's exchanges of the groups it received took (from its first packet to the last result).
    seconds: float = 0.0
    #: The last EXCHANGES_KEPT of them: [wall-clock start (time.time()), seconds, the members' ranks] (what a
    #: benchmark compares with the group's own links at that time).
    exchanges: list = field(default_factory=list)
    last_error: str = ""


class SwitchMember:
    """The PS as a member of its job's switch groups (``ps_members``): a thread runs each group's subset
    exchange with zeros (closing its rounds at the grant's ``deadline``), then hands the sum to
    ``apply(grant, total, missing)`` (``missing``: per part's rank whose update is not in every block, the mask
    of values it is missing from); a failed exchange calls ``fail(grant, reason)`` (the members then push their
    own updates)."""

    def __init__(self, config: WorkerConfig, apply: Callable[[dict, np.ndarray, dict[int, np.ndarray]], None],
                 fail: Callable[[dict, str], None], **options: Any) -> None:
        if not config.ps_members or config.rank < config.training_workers:
            raise ValueError(f"rank {config.rank} of job {config.job_id} is not a PS node's (the job's last "
                             f"{config.ps_members} ranks are)")
        self.rank = config.rank
        #: Values per block of the job (its packets' width).
        self.width = config.width
        self.stats = SwitchMemberStats()
        # No congestion window: the PS's zeros go out when a round's slot is free and come back when its slowest
        # member arrived, so its timeouts measure the members' lateness, not its path; each one halved its window
        # (a group closed at 0.38 s took 3.1 s with 14 cuts down to 3.5 packets: the whole group then went at the
        # pace of the PS's 3.5 rounds in flight). At most the job's slots are in flight, as in SwitchML.
        self._summer = SwitchSummer(config, **{"congestion_control": False, **options})
        self._apply, self._fail = apply, fail
        self._queue: queue.Queue[tuple[dict, int, np.ndarray | None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="mlfabric-switch-member", daemon=True)
        self._thread.start()

    def submit(self, grant: dict, values: int, contribution: np.ndarray | None = None) -> None:
        """Take part in the switch group ``grant`` (its members, round base and parts) of ``values`` float32s, with
        ``contribution`` (the gradients of the pushes the PS holds for it, the grant's ``held`` parts) or zeros."""
        self._queue.put((grant, values, contribution))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            grant, values, contribution = item
            parts = grant["parts"]
            held = set(grant.get("held", ()))
            before = self._traffic()
            began, began_wall = time.monotonic(), time.time()
            deadline = grant.get("deadline")
            try:
                own = contribution if contribution is not None else np.zeros(values, np.float32)
                total = self._summer.sum(own, int(grant["members"]), int(grant["round"]),
                                         deadline=None if deadline is None else float(deadline), closer=True)
                # The held parts are the PS's own contribution: in a block whose result names the PS (every block:
                # it closes only rounds it is in). Were one without it, those parts would be in the sum in part.
                if held and not bool(((self._summer.last_members >> np.uint32(self.rank)) & 1).all()):
                    raise SwitchAggregationFailed("a block's sum lacks the PS's own contribution (its held pushes)")
                missing = self._summer.missing([int(rank) for i, rank, _ in parts if i not in held], values)
            except SwitchAggregationFailed as err:
                self._count(before, failed=str(err))
                log.warning("switch group %s: the PS's exchange failed (%s); its members push their own", parts, err)
                self._fail(grant, str(err))
                continue
            self._count(before)
            took = time.monotonic() - began
            self.stats.seconds += took
            self.stats.exchanges = [*self.stats.exchanges[1 - EXCHANGES_KEPT:],
                                    [round(began_wall, 3), round(took, 4),
                                     sorted(int(rank) for i, rank, _ in parts if i not in held)]]
            t = self._summer.transport
            closes = t.last_closes if t is not None else 0
            self.stats.closes += closes
            self.stats.closed_groups += bool(missing)
            if missing and t is not None:
                log.info("switch group %s: closed at its deadline (%.3f s; the exchange took %.3f s, %d close "
                         "requests): ranks %s are missing %s of %d values (window %.1f, smallest %.1f, %d cuts, "
                         "%d undone, %d retransmissions so far)", parts, deadline,
                         time.monotonic() - began, closes, sorted(missing),
                         [int(m.sum()) for _, m in sorted(missing.items())], values, t.window,
                         t.stats.smallest_window, t.stats.window_decreases, t.stats.window_undos,
                         t.stats.retransmissions)
            try:
                self._apply(grant, total, missing)
            except Exception as err:
                self.stats.last_error = str(err)
                log.warning("switch group %s: not applied: %s", parts, err)
                self._fail(grant, str(err))

    def _traffic(self) -> tuple[int, int]:
        t = self._summer.transport
        if t is None:
            return 0, 0
        stats = t.stats
        return stats.packets_sent, stats.results_accepted + stats.stale_results

    def _count(self, before: tuple[int, int], failed: str = "") -> None:
        sent, received = self._traffic()
        if failed:  # the transport was closed: its counters went with it
            sent, received = before
            self.stats.failures += 1
            self.stats.last_error = failed
        else:
            self.stats.groups += 1
        message = wire.netagg_bytes(self.width)
        self.stats.bytes_out += max(0, sent - before[0]) * message
        self.stats.bytes_in += max(0, received - before[1]) * message

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
        self._summer.close()
