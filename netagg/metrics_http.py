"""One Prometheus HTTP endpoint: a collector in its own registry, served by prometheus_client.

The controller (``controller/metrics.py``) and the workers (``hoststack/metrics.py``) each
serve their collector this way; several endpoints may live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.registry import Collector


class MetricsServer:
    """Serves ``collector`` on http://host:port/metrics until stop() (port 0: a free one)."""

    def __init__(self, host: str, port: int, collector: Collector) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)

    @classmethod
    def at(cls, address: str, collector: Collector) -> MetricsServer:
        """From a ``HOST:PORT`` address (``[v6]:port`` too; an empty host is every address)."""
        host, _, port = address.rpartition(":")
        return cls(host.strip("[]") or "0.0.0.0", int(port), collector)

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound (the port is chosen when the configured one is 0)."""
        return self._server.server_address[:2]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
