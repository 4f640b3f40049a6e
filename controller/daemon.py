"""``netagg controller run``: connect, recover, serve the API (and metrics), reclaim expired leases."""

from __future__ import annotations

import logging
import signal
import threading

from netagg.controller.api import ApiServer
from netagg.controller.config import ControllerConfig
from netagg.controller.metrics import ControllerCollector
from netagg.controller.p4runtime_client import P4RuntimeClient
from netagg.controller.service import JobService, ServiceError
from netagg.controller.store import JobStore
from netagg.metrics_http import MetricsServer

log = logging.getLogger("netagg.controller")

#: How often expired leases are looked for.
REAP_INTERVAL_SECONDS = 1.0


class ControllerDaemon:
    """The running controller: P4Runtime session, job service, API socket, metrics endpoint, lease reaper."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.store = JobStore(config.database)
        self.client = P4RuntimeClient(config.grpc_address, device_id=config.device_id,
                                      election_id=(0, config.election_id))
        self.service = JobService(config, self.store, self.client)
        self.api: ApiServer | None = None
        self.metrics: MetricsServer | None = None
        #: Jobs reclaimed because their lease ran out (``netagg_lease_expiries_total``).
        self.lease_expiries = 0
        self._stop = threading.Event()

    def start(self) -> None:
        """Connect and recover; raises ServiceError/P4RuntimeError when that is impossible."""
        pipeline = self.service.connect_switch()
        report = self.service.recover()
        log.info("switch %s: %s; reconcile inserted %d, modified %d, deleted %d entries, "
                 "set %d and deleted %d groups", self.config.grpc_address, pipeline, report.inserted,
                 report.modified, report.deleted, report.groups_set, report.groups_deleted)
        if self.config.metrics_address is not None:
            collector = ControllerCollector(self.service, lambda: self.lease_expiries)
            try:
                self.metrics = MetricsServer.at(self.config.metrics_address, collector)
            except OSError as err:
                raise ServiceError("invalid_argument", f"{self.config.source}: controller.metrics_address: cannot "
                                   f"listen on {self.config.metrics_address}: {err.strerror}") from None
            log.info("metrics on http://%s:%d/metrics", *self.metrics.address)
        self.api = ApiServer(self.config.api_socket, self.service, self.config.tenants, self.config.admin_token)
        self.api.start()
        log.info("controller ready: api on %s, %d jobs", self.config.api_socket, len(self.store.all()))

    def serve(self) -> None:
        """Reap expired leases until stopped (SIGINT/SIGTERM)."""
        while not self._stop.wait(REAP_INTERVAL_SECONDS):
            for job_id in self.service.reap_expired():
                self.lease_expiries += 1
                log.info("job %d reclaimed: lease expired", job_id)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()
        if self.api is not None:
            self.api.stop()
        self.client.close()
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
