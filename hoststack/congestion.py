"""The transport's timers and window: the RFC 6298 retransmission timeout and an AIMD congestion window that
tells a spurious timeout from a loss.

Both are pure bookkeeping on numbers the transport hands them (round trips, results, timeouts): no socket, no
clock of their own, so ``tests/test_congestion.py`` drives them through queueing, spurious timeouts and real
loss directly.

A round of netagg completes only when the job's slowest worker's packet arrived, so a timeout often means a
slow peer or a grown queue, not a lost packet. The transport resends anyway (its packet may be lost), but the
window is cut only for a *loss*: a result that comes back sooner after the resend than the path's shortest
round trip cannot be the answer to the resend, so the original made it and the timeout was spurious
(Linux's and RFC 3522's undo, with the minimum round trip standing in for timestamps); the cut it caused is
undone and the original's round trip becomes a sample, so the estimate follows a growing queue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

try:  # the compiled batch update when numba is installed; same results
    from netagg.hoststack import transport_kernels as kernels
except ImportError:
    kernels = None

#: Smallest retransmission timeout (s). ``make bench``, 8 workers at 40 Mbit/s on 2 busy cores: a 2 ms floor
#: gave 1.32x the bound with 7,389 retransmissions (nearly all spurious), 10 ms 1.00x with 222.
RTO_FLOOR = 0.010
#: A result this soon after a packet's resend (a share of the minimum round trip) answers its original.
SPURIOUS_SHARE = 0.75
#: DCTCP's gain: the weight of the last window's share of CE-marked results in the running estimate ``alpha``.
ECN_GAIN = 1 / 16


@dataclass
class RtoEstimator:
    """RFC 6298's retransmission timeout from round-trip samples, clamped to [minimum, maximum].

    A round completes only when the slowest worker's packet arrived, so one worker's loss
    inflates everyone's round trip; samples are therefore clipped to twice the smoothed RTT
    (a real increase still raises SRTT by up to 12.5 % per sample) so that RTTVAR does not
    explode under loss. ``min_rtt`` is the smallest sample seen (the path without queues).
    """

    initial: float = 0.05
    minimum: float = RTO_FLOOR
    maximum: float = 1.0
    granularity: float = 0.0005
    #: Doublings of one packet's timeout before it plateaus: a failed retransmission here mostly
    #: means another worker's packet was lost (the round was incomplete), not congestion ...
    max_backoff: int = 2
    #: ... for this many more retries; after them doubling resumes (a straggler or dead peer).
    plateau: int = 2
    srtt: float | None = None
    rttvar: float = 0.0
    min_rtt: float = math.inf
    rto: float = field(init=False)

    def __post_init__(self) -> None:
        self.rto = min(max(self.initial, self.minimum), self.maximum)

    def sample(self, rtt: float) -> None:
        """Feed one round trip of a packet whose result answered the packet itself (Karn)."""
        self.min_rtt = min(self.min_rtt, rtt)
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            rtt = min(rtt, 2 * self.srtt)
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.rto = min(max(self.srtt + max(self.granularity, 4 * self.rttvar), self.minimum), self.maximum)

    def sample_all(self, rtts: np.ndarray) -> None:
        """:meth:`sample` for each round trip of ``rtts`` (float64), in order."""
        if not rtts.shape[0]:
            return
        self.min_rtt = min(self.min_rtt, float(rtts.min()))
        if kernels is None:
            for rtt in rtts.tolist():
                self.sample(rtt)
            return
        srtt, self.rttvar, rto = kernels.rto_samples(np.nan if self.srtt is None else self.srtt, self.rttvar,
                                                      self.granularity, self.minimum, self.maximum, rtts)
        if not math.isnan(rto):
            self.srtt, self.rto = srtt, rto

    def backoff(self, retries: int) -> float:
        """Timeout after ``retries`` retransmissions of the same packet.

        ``rto * 2**e`` with e = 1, 2, .., max_backoff, then ``plateau`` times max_backoff,
        then increasing by one per retry again; at most ``maximum``.
        """
        doublings = max(min(retries, self.max_backoff), retries - self.plateau)
        return min(self.rto * (2 ** min(doublings, 40)), self.maximum)

    def spurious(self, since_resend: np.ndarray) -> np.ndarray:
        """Which of the results that came ``since_resend`` seconds after their packet's last resend answer the
        original: sooner than the shortest round trip seen could bring back an answer to the resend."""
        if not math.isfinite(self.min_rtt):
            return np.zeros(since_resend.shape[0], bool)
        return since_resend < SPURIOUS_SHARE * self.min_rtt


@dataclass
class WindowStats:
    """What the window did: cuts (one per loss event), cuts undone (spurious timeouts), the smallest value."""

    decreases: int = 0
    undone: int = 0
    smallest: float = math.inf
    #: Cuts for congestion marks (ECN CE on results), at most one per round trip; not counted in ``decreases``.
    ecn_cuts: int = 0


class CongestionWindow:
    """Packets a transport keeps outstanding: additive increase per window of results, up to ``limit`` (the
    transport's slots); halved at most once per smoothed round trip on a timeout; a cut undone when the
    timeout that caused it proves spurious; cut by ``alpha / 2`` at most once per round trip while results come
    back CE-marked (DCTCP: ``alpha`` follows the share of marked results per window). ``enabled`` False: fixed
    at ``limit``."""

    def __init__(self, limit: int, enabled: bool = True) -> None:
        self.limit = float(limit)
        self.enabled = enabled
        self.value = self.limit
        self.stats = WindowStats(smallest=self.value)
        self._last_cut = -math.inf
        #: The value before the last cut and when the cut happened (None: nothing to undo).
        self._before_cut: float | None = None
        #: DCTCP's estimate of the share of results marked CE (starts at 1: the first mark halves the window).
        self.alpha = 1.0
        self._window_results = 0
        self._window_marked = 0
        self._last_ecn_cut = -math.inf

    def resize(self, limit: int) -> None:
        """A new limit (the transport's slots after a move): the window keeps its value up to it."""
        self.limit = float(limit)
        self.value = self.limit if not self.enabled else min(self.value, self.limit)
        self._before_cut = None if self._before_cut is None else min(self._before_cut, self.limit)

    def on_results(self, count: int) -> None:
        """Additive increase: one packet per window of ``count`` accepted results, up to the limit."""
        if self.enabled and self.value < self.limit:
            self.value = min(self.value + count / self.value, self.limit)

    def on_timeout(self, now: float, srtt: float) -> bool:
        """Multiplicative decrease, at most once per smoothed round trip ``srtt`` (one loss event); returns
        whether it cut."""
        if not self.enabled or now - self._last_cut < srtt:
            return False
        self._before_cut = self.value if self._before_cut is None else max(self._before_cut, self.value)
        self._last_cut = now
        self.value = max(1.0, self.value / 2)
        self.stats.decreases += 1
        self.stats.smallest = min(self.stats.smallest, self.value)
        return True

    def on_spurious(self) -> bool:
        """A timeout since the last cut was spurious: back to the value before the cut (Eifel's response);
        returns whether there was a cut to undo."""
        if self._before_cut is None:
            return False
        self.value = max(self.value, self._before_cut)
        self._before_cut = None
        self.stats.undone += 1
        return True

    def on_marks(self, results: int, marked: int, now: float, srtt: float) -> bool:
        """``results`` received, ``marked`` of them ECN CE (a queue on some member's way is filling: the switch
        copies a contribution's mark into its round's result). Once per window of results ``alpha`` moves
        toward the window's marked share; while marks come, the window is cut by ``alpha / 2`` at most once per
        smoothed round trip ``srtt``. A mark is congestion, not loss: such a cut is never undone. Returns
        whether it cut."""
        if not self.enabled or results <= 0:
            return False
        self._window_results += results
        self._window_marked += min(marked, results)
        if self._window_results >= self.value:
            share = self._window_marked / self._window_results
            self.alpha = (1 - ECN_GAIN) * self.alpha + ECN_GAIN * share
            self._window_results = self._window_marked = 0
        if marked <= 0 or now - self._last_ecn_cut < srtt:
            return False
        self._last_ecn_cut = now
        self._before_cut = None  # congestion seen: a timeout's cut before it is not undone either
        self.value = max(1.0, self.value * (1 - self.alpha / 2))
        self.stats.ecn_cuts += 1
        self.stats.smallest = min(self.stats.smallest, self.value)
        return True

    def on_loss_confirmed(self) -> None:
        """A result answered a resend (the original was lost): the last cut stands."""
        self._before_cut = None
