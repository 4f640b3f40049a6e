"""Receivers whose link cannot take the model versions leave the distribution, as a host leaves a multicast group.

The PS sends every version through the switch at its own link's pace, and the switch copies each packet to every
receiver. A receiver whose link is slower (a host at a quarter of the rate, a link cut for a while) gets a fraction
of each version, and the copies it cannot take fill the queue of its link: its pulls, its pushes' answers and its
switch groups' results wait behind them or are dropped (measured: a two-member switch group took 28 s instead of
0.4 s, its member's window down to 2 packets). Such a receiver asks the controller to take it out of the
distribution job's multicast group (``receive`` on the controller's worker endpoint, authenticated with the job's
secret; the controller keeps it in its database and rewrites the group over P4Runtime), pulls its models from the
PS meanwhile, and joins again later to try its link anew.

:class:`ReceiverPolicy` decides (pure, a clock passed in); :class:`ReceiverMembership` asks the controller from a
thread of its own, so the receiving thread never waits on it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from netagg.jobconfig import WorkerConfig, resolve
from netagg.psproto import PsClient, PsError

log = logging.getLogger(__name__)

#: A version of which a receiver got less than this share, while the sender went on to the next, is a strike.
LEAVE_BELOW = 0.5
#: Strikes in a row that make a receiver leave (the first version after a start or a join is not counted: it
#: may have begun before).
STRIKES = 2
#: Seconds out before the first try to join again; doubled after each join that ends in leaving again, up to
#: ``MAX_REJOIN``; back to ``REJOIN`` once a version arrives whole.
REJOIN = 4.0
MAX_REJOIN = 32.0
#: One request's timeout (the controller answers at once).
REQUEST_TIMEOUT = 2.0


@dataclass
class MembershipStats:
    leaves: int = 0
    joins: int = 0
    #: Requests the controller did not answer or refused (the receiver stays as it was).
    failed_requests: int = 0
    #: Versions scored: whole (or nearly) and short.
    versions_scored: int = 0
    versions_short: int = 0


class ReceiverPolicy:
    """When to leave and when to join again (see the module docstring)."""

    def __init__(self, *, leave_below: float = LEAVE_BELOW, strikes: int = STRIKES, rejoin: float = REJOIN,
                 max_rejoin: float = MAX_REJOIN, clock: Callable[[], float] = time.monotonic) -> None:
        self.leave_below, self.strikes, self.rejoin, self.max_rejoin = leave_below, strikes, rejoin, max_rejoin
        self.clock = clock
        self.receiving = True
        self._strikes = 0
        self._skip = True  # the first version seen may have begun before this receiver listened
        self._backoff = rejoin
        self._rejoin_at = 0.0
        self._rejoined = False  # left again soon after a join: the next time out is longer

    def version_over(self, share: float) -> bool:
        """The sender went past a version of which this receiver got ``share`` of the blocks; True: leave now."""
        if not self.receiving:
            return False
        if self._skip:
            self._skip = False
            return False
        if share >= self.leave_below:
            self._strikes = 0
            if share >= 1.0:
                self._backoff, self._rejoined = self.rejoin, False
            return False
        self._strikes += 1
        if self._strikes < self.strikes:
            return False
        if self._rejoined:
            self._backoff = min(self._backoff * 2, self.max_rejoin)
        self.receiving, self._strikes = False, 0
        self._rejoin_at = self.clock() + self._backoff
        return True

    def join_due(self) -> bool:
        """True once a receiver that left has been out long enough to try its link again (it joins then)."""
        if self.receiving or self.clock() < self._rejoin_at:
            return False
        self.receiving, self._skip, self._rejoined = True, True, True
        return True

    def undo(self) -> None:
        """The controller did not take the last change: back to what the switch does (try again later)."""
        self.receiving = not self.receiving
        self._strikes = 0
        self._rejoin_at = self.clock() + self.rejoin


class ReceiverMembership:
    """One receiver's membership of its distribution job's multicast group, kept with the controller.

    ``config``: the receiver's config in the distribution job (its ``controller`` endpoint names where to ask).
    The receiving thread calls :meth:`version_over`; a thread of this object sends the requests."""

    def __init__(self, config: WorkerConfig, policy: ReceiverPolicy | None = None) -> None:
        if config.controller is None:
            raise ValueError("the distribution job's config names no controller endpoint: receivers cannot leave")
        self.config = config
        self.address = resolve(config.controller)
        self.policy = policy or ReceiverPolicy()
        self.stats = MembershipStats()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        #: A change the thread is to ask for (the policy's).
        self._want: bool | None = None
        # First of all a join that registers this receiver (not counted among the joins): one restarted after it
        # left would otherwise wait for versions the switch no longer copies to it (the controller's database
        # keeps it out). When to (re)try it; None once done.
        self._register_at: float | None = 0.0
        self._stop = False
        self._client: PsClient | None = None
        self._thread = threading.Thread(target=self._run, name=f"mlfabric-receiver{config.rank}", daemon=True)
        self._thread.start()

    @property
    def receiving(self) -> bool:
        with self._lock:
            return self.policy.receiving

    def version_over(self, share: float) -> None:
        with self._lock:
            self.stats.versions_scored += 1
            self.stats.versions_short += share < self.policy.leave_below
            if self.policy.version_over(share):
                self._want = False
                self._wake.notify_all()

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        self._thread.join(5)
        if self._client is not None:
            self._client.close()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._wake.wait_for(lambda: self._stop or self._want is not None, timeout=0.25)
                if self._stop:
                    return
                if self._want is None and self.policy.join_due():
                    self._want = True
                want, self._want = self._want, None
                register = self._register_at is not None and time.monotonic() >= self._register_at
            if register:
                self._ask(True, register=True)
            if want is not None:
                self._ask(want)

    def _ask(self, receiving: bool, register: bool = False) -> None:
        header = {"op": "receive", "job_id": self.config.job_id, "rank": self.config.rank, "receiving": receiving}
        try:
            if self._client is None:
                self._client = PsClient(self.address, timeout=REQUEST_TIMEOUT, secret=self.config.secret)
            answer = self._client.request(header)[0]
            if answer.get("receiving") is not receiving:
                raise PsError(f"the controller answered {answer}")
        except (PsError, OSError) as err:
            if self._client is not None:
                self._client.close()
                self._client = None
            with self._lock:
                self.stats.failed_requests += 1
                if register:  # tried again in a while; the policy goes on as if it were in the group
                    self._register_at = time.monotonic() + 1.0
                else:
                    self.policy.undo()
            log.warning("distribution job %d receiver %d: could not %s its group: %s", self.config.job_id,
                        self.config.rank, "join" if receiving else "leave", err)
            return
        with self._lock:
            if register:
                self._register_at = None
                return
            if receiving:
                self.stats.joins += 1
            else:
                self.stats.leaves += 1
        log.info("distribution job %d receiver %d: %s its multicast group", self.config.job_id, self.config.rank,
                 "joined" if receiving else "left (its link cannot take the versions; it pulls meanwhile)")


__all__ = ["MembershipStats", "ReceiverMembership", "ReceiverPolicy"]
