"""The controller watches its switch: notices it going away, reconnects, and puts every job back.

A switch reboot or a crashed software target is routine. :class:`SwitchWatch` runs one thread:

* **Watching** (the switch is in sync): it waits on the P4Runtime StreamChannel, which ends at once
  when the switch process dies or closes the connection, and every ``poll_interval`` seconds reads
  the pipeline's cookie (GetForwardingPipelineConfig, COOKIE_ONLY: the cheapest read there is). The
  switch is *lost* when the stream ends, when the read says UNAVAILABLE (or fails ``probe_failures``
  times in a row), or when the cookie is not the one of the pipeline the controller pushed or kept
  (the switch restarted between two polls, or someone replaced the pipeline).
* **Lost**: job requests that need the switch are refused with ``switch_unavailable`` (see
  ``JobService._require_switch``) and lease reaping pauses. The thread reconnects (a fresh channel,
  StreamChannel and arbitration with the same election id) with exponential backoff,
  ``backoff_initial`` doubling to ``backoff_max`` seconds, and once connected and primary runs
  ``JobService.resync`` under the service lock: pipeline re-pushed if it is absent or not ours,
  interrupted deletes finished, every live job's entries and multicast groups re-installed (the same
  reconcile as at start, so a switch that kept everything costs a few reads), counter baselines
  re-read if the switch lost its state, and every job's PS is told the switch is back (a job
  that failed over to its PS returns at its next exchange, hoststack/failover.py). Any failure
  is logged and retried; nothing here can end the daemon.

Figures for the metrics endpoint: ``up``, ``restarts`` (syncs that found the switch had lost the
pipeline it held before: a restart), ``reconnects`` (sessions re-established after a loss, for any
reason) and ``unavailable_seconds`` (total time the switch was not in sync, the ongoing outage
included).
"""

from __future__ import annotations

import logging
import threading
import time

from netagg.controller.p4runtime_client import P4RuntimeError
from netagg.controller.ps_notify import tell_parameter_servers
from netagg.controller.service import JobService, ServiceError, SwitchSync

log = logging.getLogger("netagg.controller")

#: Seconds between two pipeline-cookie reads while the switch is up (the stream reports a dead switch sooner).
POLL_INTERVAL = 1.0
#: Deadline of that read.
PROBE_TIMEOUT = 2.0
#: Consecutive failed reads (other than UNAVAILABLE, which counts at once) that make the switch lost.
PROBE_FAILURES = 3
#: Reconnection backoff: first wait, and the most it grows to (doubling).
BACKOFF_INITIAL = 0.1
BACKOFF_MAX = 5.0
#: How long one reconnection attempt waits for the switch to accept the connection.
CONNECT_TIMEOUT = 1.0
#: While the switch stays away, a reminder in the log this often (each failed attempt is logged at debug level).
STILL_DOWN_LOG_INTERVAL = 30.0


class SwitchWatch:
    """Keeps the controller's session with its switch alive and the switch in sync with the database."""

    def __init__(self, service: JobService, switch: str | None = None, poll_interval: float = POLL_INTERVAL,
                 probe_timeout: float = PROBE_TIMEOUT, probe_failures: int = PROBE_FAILURES,
                 backoff_initial: float = BACKOFF_INITIAL, backoff_max: float = BACKOFF_MAX,
                 connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.service = service
        session = service.session(switch)
        #: The switch's name in the fabric (``fabric.ONE_SWITCH`` without a topology) and its address.
        self.switch = session.name
        self.address = session.address
        self.client = session.client
        #: How the logs name the switch: its address, and its name under a topology.
        self.label = f"{session.name} ({session.address})" if service.fabric.is_tree else session.address
        self.poll_interval = poll_interval
        self.probe_timeout = probe_timeout
        self.probe_failures = probe_failures
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        started = time.monotonic()
        #: monotonic time since when the switch is not in sync (None while it is); at first: since start.
        self._down_since: float | None = started
        self._down_reason = "not connected yet"
        self._unavailable_total = 0.0
        self._attempts = 0
        self._last_error = ""
        self._synced_at = started
        #: Whether the next attempt opens a fresh session (not when only the pipeline's cookie changed).
        self._reconnect = True
        #: Whether the switch was ever in sync (a first sync is not a restart or a reconnect).
        self.ever_synced = False
        self.restarts = 0
        self.reconnects = 0

    # -- figures -------------------------------------------------------------
    @property
    def up(self) -> bool:
        """Connected, primary, and in sync with the database."""
        with self._lock:
            return self._down_since is None

    @property
    def unavailable_seconds(self) -> float:
        """Seconds the switch was not in sync since the controller started (the current outage included)."""
        with self._lock:
            current = time.monotonic() - self._down_since if self._down_since is not None else 0.0
            return self._unavailable_total + current

    @property
    def down_for(self) -> float | None:
        """Seconds since the switch was lost (None while it is up)."""
        with self._lock:
            return None if self._down_since is None else time.monotonic() - self._down_since

    # -- the first contact (daemon start) -------------------------------------
    def sync_first(self, timeout: float) -> SwitchSync:
        """Connect and resync once; raises P4RuntimeError/ServiceError when that fails (the thread retries)."""
        self.service.check_program()
        self.service.reconnect_switch(timeout, self.switch)
        result = self.service.resync(self.switch)
        self._synced(result)
        return result

    # -- the thread ------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"netagg-switch-watch-{self.switch}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        backoff = self.backoff_initial
        failures = 0
        last_reminder = time.monotonic()
        while not self._stop.is_set():
            try:
                if self.up:
                    failures = self._watch(failures)
                    last_reminder = time.monotonic()
                    if not self.up:  # just lost: reconnect at once, unless it keeps going (then back off)
                        if time.monotonic() - self._synced_at < self.backoff_max:
                            self._stop.wait(backoff)
                            backoff = min(backoff * 2, self.backoff_max)
                        else:
                            backoff = self.backoff_initial
                    continue
                self._attempt()
                failures = 0
            except Exception as err:  # never let the watch die: log, back off, try again
                self._failed(err)
                if time.monotonic() - last_reminder >= STILL_DOWN_LOG_INTERVAL:
                    last_reminder = time.monotonic()
                    log.info("switch %s still unavailable after %.0f s (%d attempts; last: %s)", self.label,
                             self.down_for or 0.0, self._attempts, self._last_error)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.backoff_max)

    def _watch(self, failures: int) -> int:
        """One poll of a switch in sync; returns the consecutive failed reads so far."""
        client = self.client
        if client.wait_disconnected(self.poll_interval):
            if not self._stop.is_set():
                error = client.stream_error
                self._lost(f"the StreamChannel ended ({error})" if error else "the StreamChannel ended")
            return 0
        if self._stop.is_set():
            return failures
        try:
            cookie = client.get_pipeline_cookie(timeout=self.probe_timeout)
        except P4RuntimeError as err:
            failures += 1
            if err.code == "UNAVAILABLE" or failures >= self.probe_failures:
                self._lost(f"{err}" + (f" ({failures} reads in a row)" if failures > 1 else ""))
                return 0
            log.debug("switch %s: pipeline read failed (%d in a row): %s", self.label, failures, err)
            return failures
        expected = self.service.expected_cookie(self.switch)
        if cookie != expected:
            self._reconnect = False  # the session is fine: only the switch's state is not ours any more
            self._lost("it has no pipeline" if cookie is None else
                       f"its pipeline's cookie is {cookie:#x}, not {expected:#x}" if expected is not None else
                       "its pipeline changed")
        return 0

    def _attempt(self) -> None:
        """Reconnect if the session is gone, then resync (both raise on failure)."""
        self._attempts += 1
        client = self.client
        if self._reconnect or not (client.connected and client.is_primary):
            self.service.reconnect_switch(self.connect_timeout, self.switch)
        self._synced(self.service.resync(self.switch))

    # -- transitions -------------------------------------------------------------
    def _lost(self, reason: str) -> None:
        self.service.mark_switch_unavailable(reason, self.switch)
        with self._lock:
            if self._down_since is not None:
                return
            self._down_since = time.monotonic()
            self._down_reason = reason
            self._attempts = 0
        log.warning("switch %s lost: %s; reconnecting (backoff %g s to %g s); job create/delete/show are "
                    "refused until it is back", self.label, reason, self.backoff_initial, self.backoff_max)

    def _failed(self, err: Exception) -> None:
        # A failure while up (e.g. the switch died during a reconcile of the resync) is a loss too.
        if isinstance(err, P4RuntimeError | ServiceError):
            text = str(err)
        else:
            text = f"{type(err).__name__}: {err}"
            log.exception("switch %s: unexpected error in the switch watch", self.label)
        self._last_error = text
        self._reconnect = True  # whatever failed, the next attempt starts from a fresh session
        self._lost(text)
        log.debug("switch %s: attempt %d failed: %s", self.label, self._attempts, text)

    def _synced(self, result: SwitchSync) -> None:
        # Jobs that failed over to their PS while the switch was away may come back now (a thread: a PS that
        # does not answer must not hold the watch).
        jobs = self.service.store.all()
        threading.Thread(target=tell_parameter_servers, args=(jobs, result.lost_state), daemon=True,
                         name="netagg-ps-notify").start()
        first = not self.ever_synced
        with self._lock:
            since, reason = self._down_since, self._down_reason
            away = time.monotonic() - since if since is not None else 0.0
            self._unavailable_total += away
            self._down_since = None
            self._synced_at = time.monotonic()
            self._reconnect = True
            self.ever_synced = True
            if not first:
                self.reconnects += 1
                self.restarts += result.lost_state
        report = result.report
        changes = (f"inserted {report.inserted}, modified {report.modified}, deleted {report.deleted} entries, "
                   f"set {report.groups_set} and deleted {report.groups_deleted} groups")
        if first and self._attempts:  # the daemon started without its switch
            log.info("switch %s reached after %.2f s (%d attempts): %s; reconcile %s", self.label, away,
                     self._attempts, result.pipeline, changes)
            return
        if first:
            log.info("switch %s: %s; reconcile %s", self.label, result.pipeline, changes)
            return
        what = "it had lost its state (restarted)" if result.lost_state else "it had kept its state"
        log.info("switch %s back after %.2f s away (lost: %s; %d attempts): %s; %s; reconciled %d jobs: %s",
                 self.label, away, reason, self._attempts, what, result.pipeline, result.jobs, changes)
