"""``netagg controller run``: connect, recover, serve the API (and metrics), reclaim expired leases,
and watch the switch (``switch_watch.py``: reconnect and re-install everything when it comes back).
Under a topology (``topology:``, docs/hierarchy.md) every switch of the tree has its own session and
watch; a switch that is away holds up only the jobs whose tree it is in.

The daemon does not need the switch to start: if it cannot be reached (or is not primary), the
daemon says so, serves the API anyway (job requests that need the switch are refused with
``switch_unavailable``) and connects when the switch appears; ``switch.startup_wait_seconds`` bounds
that wait (0: exit at once, status 6, as before the watch existed).
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from netagg.controller.api import ApiServer
from netagg.controller.config import ControllerConfig
from netagg.controller.errors import P4RuntimeError, ServiceError
from netagg.controller.metrics import ControllerCollector
from netagg.controller.service import JobService
from netagg.controller.store import JobStore
from netagg.controller.switch_watch import SwitchWatch
from netagg.controller.worker_api import WorkerApi
from netagg.jobconfig import Endpoint
from netagg.metrics_http import MetricsServer

log = logging.getLogger("netagg.controller")

#: How often expired leases are looked for.
REAP_INTERVAL_SECONDS = 1.0
#: The database's key for the worker endpoint's port when the configuration leaves it to the kernel (port 0).
WORKER_PORT_KEY = "worker_port"
#: How long the first attempt at start waits for the switch to accept the connection.
STARTUP_CONNECT_TIMEOUT = 2.0


def _retryable(err: Exception) -> bool:
    """Whether waiting may help: not a pipeline the switch refuses or a request the client cannot build."""
    return not (isinstance(err, P4RuntimeError) and err.code == "INVALID_ARGUMENT")


class ControllerDaemon:
    """The running controller: P4Runtime session, job service, API socket, metrics endpoint, lease reaper."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.store = JobStore(config.database)
        self.service = JobService(config, self.store)
        #: One watch per switch (the one switch first, or the root first).
        self.watches = [SwitchWatch(self.service, name) for name in self.service.sessions]
        self._started = time.monotonic()
        self.api: ApiServer | None = None
        self.worker_api: WorkerApi | None = None
        self.metrics: MetricsServer | None = None
        #: Jobs reclaimed because their lease ran out (``netagg_lease_expiries_total``).
        self.lease_expiries = 0
        self._stop = threading.Event()

    def start(self) -> None:
        """Load the database, try the switch once, serve; raises ServiceError/P4RuntimeError when that is
        impossible (a bad configuration, a pipeline the switch refuses, an unreachable switch with
        ``switch.startup_wait_seconds: 0``)."""
        self.service.load()
        self._started = time.monotonic()
        for watch in self.watches:
            try:
                watch.sync_first(STARTUP_CONNECT_TIMEOUT)
            except (P4RuntimeError, ServiceError) as err:
                if not _retryable(err) or self.config.startup_wait_seconds == 0:
                    raise
                limit = self.config.startup_wait_seconds
                log.warning("switch %s unavailable at start (%s): serving the API without it, job "
                            "create/delete/show that need it are refused until it is reached; retrying with backoff "
                            "up to %g s%s", watch.label, err, watch.backoff_max,
                            f" for {limit:g} s (switch.startup_wait_seconds)" if limit else "")
        if self.config.metrics_address is not None:
            collector = ControllerCollector(self.service, lambda: self.lease_expiries, watches=self.watches)
            try:
                self.metrics = MetricsServer.at(self.config.metrics_address, collector)
            except OSError as err:
                raise ServiceError("invalid_argument", f"{self.config.source}: controller.metrics_address: cannot "
                                   f"listen on {self.config.metrics_address}: {err.strerror}") from None
            log.info("metrics on http://%s:%d/metrics", *self.metrics.address)
        if self.config.worker_address is not None:
            self._start_worker_api(self.config.worker_address)
        self.api = ApiServer(self.config.api_socket, self.service, self.config.tenants, self.config.admin_token)
        self.api.start()
        for watch in self.watches:
            watch.start()
        log.info("controller ready: api on %s, %d jobs", self.config.api_socket, len(self.store.all()))

    def _start_worker_api(self, address: Endpoint) -> None:
        """Serve the workers' endpoint. Port 0: the port the controller had before (kept in its database, so the
        workers' configs stay right across restarts), else any free one."""
        kept = self.store.meta(WORKER_PORT_KEY) if address.port == 0 else None
        if kept is not None:
            try:
                self.worker_api = WorkerApi(self.service, Endpoint(address.host, kept)).start()
            except OSError as err:
                log.warning("worker endpoint: port %d (kept from before the restart) is taken (%s): the running "
                            "jobs' workers cannot follow moves until they get new configs", kept, err.strerror)
        if self.worker_api is None:
            try:
                self.worker_api = WorkerApi(self.service, address).start()
            except OSError as err:
                raise ServiceError("invalid_argument", f"{self.config.source}: controller.worker_address: cannot "
                                   f"listen on {address.host}:{address.port}: {err.strerror}") from None
        self.service.worker_endpoint = Endpoint(*self.worker_api.address)
        if address.port == 0:
            self.store.set_meta(WORKER_PORT_KEY, self.service.worker_endpoint.port)

    def serve(self) -> None:
        """Reap expired leases until stopped (SIGINT/SIGTERM); give up on a switch never reached within
        ``switch.startup_wait_seconds``."""
        limit = self.config.startup_wait_seconds
        while not self._stop.wait(REAP_INTERVAL_SECONDS):
            never = [w for w in self.watches if not w.ever_synced]
            if limit is not None and never and time.monotonic() - self._started > limit:
                raise P4RuntimeError("UNAVAILABLE", f"the switch {never[0].label} was not reached "
                                     f"within {limit:g} s (switch.startup_wait_seconds)")
            self.service.finish_pending()
            for job_id in self.service.reap_expired():
                self.lease_expiries += 1
                log.info("job %d reclaimed: lease expired", job_id)
            self.service.moves.expire()
            if self.service.switch_available:
                self.service.moves.rebalance()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        for watch in self.watches:
            watch.stop()
        if self.metrics is not None:
            self.metrics.stop()
        if self.api is not None:
            self.api.stop()
        if self.worker_api is not None:
            self.worker_api.stop()
        self.service.fabric.close()
        self.store.close()


def run(config: ControllerConfig) -> None:
    daemon = ControllerDaemon(config)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: daemon.stop())
    try:
        daemon.start()
        daemon.serve()
    finally:
        daemon.close()
