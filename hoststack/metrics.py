"""An opt-in Prometheus exporter of one worker's transport counters.

``KVWorker(config, metrics_port=N)`` (or ``NETAGG_METRICS_PORT=N`` in its environment)
serves them on ``http://METRICS_HOST:N/metrics`` (``NETAGG_METRICS_HOST``, default
127.0.0.1; port 0 picks a free one). The collector only reads ``Transport.stats`` and the
window at scrape time; it never touches the data path. See ``docs/operations.md``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from netagg import wire
from netagg.hoststack.transport import Transport
from netagg.metrics_http import MetricsServer

ENV_PORT = "NETAGG_METRICS_PORT"
ENV_HOST = "NETAGG_METRICS_HOST"

_COUNTERS = (
    ("exchanges", "exchanges", "Aggregations (allreduce/push calls) completed"),
    ("blocks", "blocks", "Blocks (packets' worth of the job's width) aggregated"),
    ("packets_sent", "packets_sent", "Packets sent to the aggregator, retransmissions included"),
    ("retransmissions", "retransmissions", "Packets sent again after their timer fired"),
    ("shadow_resends", "shadow_resends", "Previous-round packets resent so a round lost with a switch restart "
                                         "can be re-formed"),
    ("results_accepted", "results_accepted", "Results accepted (one per block and probe)"),
    ("stale_results", "stale_results", "Results that matched no outstanding packet (duplicates, late copies)"),
    ("malformed", "malformed_packets", "Datagrams of the wrong size or version, or not a result of this job"),
    ("foreign", "foreign_packets", "Datagrams from an address that is not the aggregator (or the PS)"),
    ("socket_errors", "socket_errors", "Socket send/receive errors"),
    ("window_decreases", "window_decreases", "Times the congestion window was halved"),
    ("ecn_marked", "ecn_marked_datagrams", "Datagrams received ECN CE-marked (congestion on some member's path)"),
    ("ecn_cuts", "ecn_window_cuts", "Times congestion marks cut the window (DCTCP, at most once per round trip)"),
    ("failovers", "failovers", "Failover decisions applied: the job's exchanges moved to its PS (switch away)"),
    ("failover_returns", "failover_returns", "Returns of the job's exchanges from the PS to the switch"),
    ("replayed_exchanges", "replayed_exchanges", "Finished exchanges sent again at the PS after a failover"),
    ("moves", "slot_moves", "Times the controller moved the job's slots (a new range at an exchange boundary)"),
)


def port_from_env() -> int | None:
    """``NETAGG_METRICS_PORT`` as a port number, or None when unset/empty."""
    text = os.environ.get(ENV_PORT, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) > 65535:
        raise ValueError(f"{ENV_PORT}={text!r} is not a TCP port")
    return int(text)


class TransportCollector(Collector):
    """``netagg_worker_*`` metrics of one transport, labelled with job id, tenant and rank."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        config = transport.config
        self.labels = [str(config.job_id), config.tenant or "", str(config.rank)]

    def collect(self) -> Iterator[object]:
        names = ["job_id", "tenant", "rank"]
        stats = self.transport.stats
        for field_name, metric, help_text in _COUNTERS:
            family = CounterMetricFamily(f"netagg_worker_{metric}", help_text, labels=names)
            family.add_metric(self.labels, getattr(stats, field_name))
            yield family
        goodput = CounterMetricFamily("netagg_worker_goodput_bytes", "Aggregated payload bytes delivered "
                                      "(blocks x width x 4)", labels=names)
        goodput.add_metric(self.labels, stats.blocks * self.transport.config.width * wire.VALUE_BYTES)
        yield goodput
        for metric, value, help_text in (
                ("window", self.transport.window, "Congestion window now (packets outstanding at most)"),
                ("smallest_window", stats.smallest_window, "Smallest congestion window so far"),
                ("slots", self.transport.slot_count, "Slots of the job (the largest window)")):
            gauge = GaugeMetricFamily(f"netagg_worker_{metric}", help_text, labels=names)
            gauge.add_metric(self.labels, float(value))
            yield gauge


class WorkerExporter(MetricsServer):
    """The HTTP endpoint of one worker (its own registry: several workers may share a process)."""

    def __init__(self, transport: Transport, port: int, host: str | None = None) -> None:
        super().__init__(host if host is not None else os.environ.get(ENV_HOST, "127.0.0.1"), port,
                         TransportCollector(transport))
