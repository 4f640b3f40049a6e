"""Failover to the PS: a job whose switch stays away moves its exchanges to its parameter server, and back.

The rules (docs/protocol.md, "Failover to the PS"):

* **Vote.** A worker whose exchange has had no result for ``failover_after`` seconds stops sending to
  the switch and *votes* at the job's PS: its rank, its address and the index of the exchange it is in
  (every worker counts its whole-job exchanges alike). While the vote is pending it re-votes (the same
  request; idempotent) and, if no decision comes within its wait, withdraws it and goes on waiting for
  the switch (ride-through).
* **Decision.** When every rank has a vote in, the PS decides: ``start`` = the smallest index voted,
  the next epoch. Workers are never more than one exchange apart (an exchange completes for one only
  after every worker sent all of it), so each voter is at ``start`` or ``start + 1``. The PS starts a
  fresh software aggregator (the switch's rules, :class:`~netagg.hoststack.aggregator.SoftAggregator`)
  that knows the voters' addresses; every worker restores its slots' round state to where exchange
  ``start`` began and runs it again there — one that had finished it (and kept its inputs) sends it
  again and drops the identical result — then goes on. Every block of the restarted exchanges is summed
  at the PS from every worker's contribution: the sums are exact and the same on every worker.
* **Return.** While on the PS, a worker asks the PS, before each exchange, where it goes
  (:meth:`FailoverCoordinator.route`). The first question after the retry time (or after the
  controller said the switch is back, :meth:`FailoverCoordinator.switch_back`) fixes a return index
  past every exchange already sent to the PS: exchanges from there go to the switch, earlier ones stay
  at the PS, for every worker alike. If the switch is still away the workers vote again (the retry
  delay doubles when the first exchange back failed).
* **Round-number guard.** A switch that kept its registers while the job ran elsewhere could hold a
  slot's round far enough behind that a new round number reads as SAME again (16-bit round numbers).
  So a worker reports how many rounds a slot ran since the switch last saw it, and beyond
  :data:`ROUND_GUARD` the PS returns only to a switch that the controller reported restarted
  (registers zero: every slot is taken over afresh).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from netagg.psproto import PsClient, PsError

log = logging.getLogger(__name__)

Address = tuple[str, int]

#: Rounds of one slot away from the switch beyond which only a restarted switch is returned to.
ROUND_GUARD = 0x4000
#: First retry of the switch after a decision, and the most the delay grows to (doubling per failed return).
RETRY_INITIAL = 2.0
RETRY_MAX = 60.0
#: Seconds between two re-votes while a decision is pending.
REVOTE_INTERVAL = 0.05
#: Timeout of one failover request (connect included): the PS answers these at once.
REQUEST_TIMEOUT = 2.0


@dataclass(frozen=True)
class Decision:
    """Exchanges from ``start`` on run at the PS; ``epoch`` counts the decisions of the job."""

    epoch: int
    start: int


class FailoverCoordinator:
    """The PS's side: votes, decisions and the return to the switch (thread-safe).

    ``on_decide(epoch, addresses)`` runs under the lock when a decision is made (``addresses``: rank ->
    the voter's UDP address); the PS starts its fresh aggregator there.
    """

    def __init__(self, num_workers: int, on_decide: Callable[[int, dict[int, Address]], None], *,
                 retry_initial: float = RETRY_INITIAL, retry_max: float = RETRY_MAX,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.num_workers = num_workers
        self.on_decide = on_decide
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.clock = clock
        self._lock = threading.Lock()
        self.epoch = 0
        self.decision: Decision | None = None
        self._votes: dict[int, tuple[int, Address]] = {}
        #: On the PS: exchanges below ``return_index`` (None: not fixed yet) stay there.
        self.degraded = False
        self.return_index: int | None = None
        self._highest_ps_index = -1
        self._retry_at = math.inf
        self._retry_delay = retry_initial
        self._switch_back = False
        self._switch_fresh = False
        #: Figures: decisions made, returns to the switch fixed, and the time spent on the PS.
        self.decisions = 0
        self.returns = 0
        self._degraded_since: float | None = None
        self._degraded_total = 0.0

    @property
    def degraded_seconds(self) -> float:
        with self._lock:
            ongoing = self.clock() - self._degraded_since if self._degraded_since is not None else 0.0
            return self._degraded_total + ongoing

    def vote(self, rank: int, known_epoch: int, index: int, address: Address) -> dict[str, Any]:
        """Record ``rank``'s vote (it is in exchange ``index``); the decision once every rank voted."""
        self._check_rank(rank)
        if index < 0:
            raise ValueError(f"exchange index {index} < 0")
        with self._lock:
            if known_epoch > self.epoch:  # this PS restarted since that decision: continue its numbering
                self.epoch = known_epoch
            if known_epoch < self.epoch and self.decision is not None:
                return self._decided()
            self._votes[rank] = (index, address)
            if len(self._votes) < self.num_workers:
                return {"state": "pending", "votes": len(self._votes), "of": self.num_workers}
            self._decide()
            return self._decided()

    def withdraw(self, rank: int, known_epoch: int) -> dict[str, Any]:
        """Take ``rank``'s pending vote back; the decision instead if it was made meanwhile."""
        self._check_rank(rank)
        with self._lock:
            if known_epoch < self.epoch and self.decision is not None:
                return self._decided()
            self._votes.pop(rank, None)
            return {"state": "withdrawn"}

    def route(self, index: int, rounds_away: int) -> dict[str, Any]:
        """Where exchange ``index`` goes: ``{"target": "ps"}`` or ``{"target": "switch"}`` (the same answer
        for every worker asking about the same index)."""
        with self._lock:
            now = self.clock()
            if not self.degraded:
                return {"target": "switch"}
            if self.return_index is None:
                due = self._switch_back or now >= self._retry_at
                safe = rounds_away < ROUND_GUARD or self._switch_fresh
                if due and safe:
                    self.return_index = max(index, self._highest_ps_index + 1)
                    self.returns += 1
                    if self._degraded_since is not None:
                        self._degraded_total += now - self._degraded_since
                        self._degraded_since = None
                    log.info("failover: exchanges from %d go back to the switch", self.return_index)
            if self.return_index is not None and index >= self.return_index:
                return {"target": "switch"}
            self._highest_ps_index = max(self._highest_ps_index, index)
            return {"target": "ps"}

    def switch_back(self, fresh: bool) -> None:
        """The controller (or an operator) says the switch is in sync again; ``fresh``: it restarted."""
        with self._lock:
            self._switch_back = True
            self._switch_fresh = self._switch_fresh or fresh

    def _decide(self) -> None:
        start = min(index for index, _ in self._votes.values())
        spread = max(index for index, _ in self._votes.values()) - start
        if spread > 1:  # cannot happen while every worker runs the same exchanges: say so loudly
            log.error("failover: votes span %d exchanges (%s); workers more than one apart will fail", spread,
                      {rank: index for rank, (index, _) in self._votes.items()})
        now = self.clock()
        first_back_failed = self.return_index is not None and start <= self.return_index
        self._retry_delay = min(self._retry_delay * 2, self.retry_max) if first_back_failed else self.retry_initial
        self._retry_at = now + self._retry_delay
        self.epoch += 1
        self.decisions += 1
        self.decision = Decision(self.epoch, start)
        addresses = {rank: address for rank, (_, address) in self._votes.items()}
        # Voters at start + 1 run that exchange at the PS without asking (after start again).
        self._highest_ps_index = start + spread
        self._votes.clear()
        self.degraded = True
        self.return_index = None
        self._switch_back = self._switch_fresh = False
        if self._degraded_since is None:
            self._degraded_since = now
        log.warning("failover: every worker of the job voted; exchanges from %d run at the PS (epoch %d, "
                    "switch retried in %.0f s)", start, self.epoch, self._retry_delay)
        self.on_decide(self.epoch, addresses)

    def _decided(self) -> dict[str, Any]:
        assert self.decision is not None
        return {"state": "decided", "epoch": self.decision.epoch, "start": self.decision.start}

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_workers:
            raise ValueError(f"rank {rank} not in 0..{self.num_workers - 1}")


class FailoverClient:
    """A worker's side: votes and route questions, over a connection of its own to the job's PS."""

    def __init__(self, ps: Address, job_id: int, rank: int, after: float, wait: float, secret: str = "") -> None:
        self.ps = ps
        self.job_id = job_id
        self.rank = rank
        #: Seconds without a result before voting; the longest wait for a decision after a vote.
        self.after = after
        self.wait = wait
        self.secret = secret
        #: The epoch of the last decision this worker applied.
        self.epoch = 0
        self._client: PsClient | None = None
        self._warned = False

    def vote(self, index: int, address: Address) -> int | None:
        """Vote and wait for the decision: its start index, or None (the PS is unreachable, or not every
        worker voted within ``wait``: the vote is withdrawn and the worker waits for the switch)."""
        header = {"op": "failover_vote", "rank": self.rank, "epoch": self.epoch, "index": index,
                  "host": address[0], "port": address[1]}
        deadline = time.monotonic() + self.wait
        while True:
            response = self._request(header)
            if response is None:
                return None
            if response.get("state") == "decided":
                return self._apply(response)
            if time.monotonic() >= deadline:
                break
            time.sleep(REVOTE_INTERVAL)
        response = self._request({"op": "failover_withdraw", "rank": self.rank, "epoch": self.epoch})
        if response is not None and response.get("state") == "decided":
            return self._apply(response)
        log.warning("job %d rank %d: failover vote withdrawn: not every worker voted within %.1f s",
                    self.job_id, self.rank, self.wait)
        return None

    def on_ps(self, index: int, rounds_away: int) -> bool:
        """Whether exchange ``index`` runs at the PS (True also when the PS cannot be asked: an exchange
        never leaves the PS unless the PS said so, for every worker alike)."""
        response = self._request({"op": "failover_route", "index": index, "rounds_away": rounds_away})
        return response is None or response.get("target") != "switch"

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _apply(self, response: dict[str, Any]) -> int:
        self.epoch = int(response["epoch"])
        return int(response["start"])

    def _request(self, header: dict[str, Any]) -> dict[str, Any] | None:
        try:
            if self._client is None:
                self._client = PsClient(self.ps, timeout=REQUEST_TIMEOUT, secret=self.secret)
            response, _ = self._client.request({**header, "job_id": self.job_id})
        except PsError as err:
            if self._client is not None:
                self._client.close()
                self._client = None
            if not self._warned:
                self._warned = True
                log.warning("job %d rank %d: no failover to the PS at %s:%d (%s); waiting for the switch",
                            self.job_id, self.rank, *self.ps, err)
            return None
        self._warned = False
        return response
