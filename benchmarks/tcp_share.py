"""One long TCP flow sharing a worker's link with a netagg job: the share of the link each side gets.

On the emulated cluster (``configs/cluster.yaml``'s links), a bulk TCP flow runs from worker host
``h0`` to the PS host, so it shares ``h0``'s link to the switch with the job's packets (and its ACKs
share the way back with the job's results). Measured in one run, at each ``--rate-mbit``:

* TCP alone: its goodput for ``--tcp-seconds``;
* the netagg job alone (``--workers`` workers, ``--size-mb`` tensors, ``--iterations`` allreduces);
* both together: the TCP flow starts first, the job's allreduces run beside it, and the TCP bytes
  counted at the receiver while the job's timed allreduces ran are set against them.

Each side's share is the link time its bytes take on the wire (netagg's packets and TCP's 1,500-byte
segments with all their headers, as ``benchmarks.cluster_allreduce``'s bounds count them) over the
link's rate: ``share = wire bytes / (seconds x rate)``. A fair split of one link is 0.5 each; the
issue's bar is at least 0.4 each. The hosts' TCP congestion control is the machine's default unless
``--tcp-congestion`` names one. Needs root (namespaces); prints why it cannot run otherwise.

    python -m benchmarks.tcp_share --rate-mbit 100 400
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.cluster_allreduce import E_TCP, finish_kind, start_kind
from netagg import dataplane as dp
from netagg import wire
from netagg.bmv2.cluster import ClusterSpec, EmulatedCluster
from netagg.bmv2.netns import can_create_namespaces

#: The TCP flow's port on the PS host (inside the cluster's own namespaces).
TCP_PORT = 29700
#: Seconds the TCP flow runs before the job starts (past slow start).
TCP_HEAD_START = 2.0

_SINK = """
import json, socket, sys, time
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2])))
srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
buf = bytearray(1 << 20)
total, samples, next_at = 0, [[time.time(), 0]], 0.0
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    total += n
    now = time.time()
    if now >= next_at:
        samples.append([now, total])
        next_at = now + 0.02
samples.append([time.time(), total])
print(json.dumps(samples), flush=True)
"""

_SOURCE = """
import socket, sys, time
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])))
chunk = bytes(1 << 20)
end = time.time() + float(sys.argv[3])
while time.time() < end:
    sock.sendall(chunk)
sock.close()
"""


@dataclass
class Share:
    rate_mbit: float
    tcp_alone: float
    netagg_alone: float
    netagg_beside_tcp: float
    tcp_beside_netagg: float
    netagg_seconds_alone: float
    netagg_seconds_beside: float
    identical: bool


class TcpFlow:
    """A bulk TCP flow from ``src`` to ``dst`` for ``seconds`` (or until :meth:`stop`); its receiver's byte counts."""

    def __init__(self, cluster: EmulatedCluster, src: str, dst: str, seconds: float) -> None:
        ip = cluster.ip_of(dst)
        self.sink = subprocess.Popen(cluster.host_command(dst, [sys.executable, "-c", _SINK, ip, str(TCP_PORT)]),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if self.sink.stdout.readline().strip() != "ready":
            raise RuntimeError(f"TCP sink did not start: {self.sink.stderr.read()[-500:]}")
        self.source = subprocess.Popen(cluster.host_command(src, [sys.executable, "-c", _SOURCE, ip, str(TCP_PORT),
                                                                  str(seconds)]),
                                       stderr=subprocess.PIPE, text=True)

    def stop(self) -> list[tuple[float, int]]:
        """End the flow (if still running); the receiver's (time, bytes so far) samples."""
        if self.source.poll() is None:
            self.source.terminate()
        self.source.wait(timeout=30)
        out, err = self.sink.communicate(timeout=30)
        if self.sink.returncode != 0:
            raise RuntimeError(f"TCP sink failed: {err[-500:]}")
        return [(t, n) for t, n in json.loads(out.strip().splitlines()[-1])]


def bytes_between(samples: list[tuple[float, int]], start: float, end: float) -> float:
    """Bytes received between ``start`` and ``end`` (linear between the receiver's samples)."""
    def at(when: float) -> float:
        for (t0, n0), (t1, n1) in itertools.pairwise(samples):
            if t0 <= when <= t1:
                return n0 + (n1 - n0) * ((when - t0) / (t1 - t0) if t1 > t0 else 1.0)
        return float(samples[-1][1] if when > samples[-1][0] else samples[0][1])
    return at(end) - at(start)


def tcp_share(samples: list[tuple[float, int]], start: float, end: float, rate_mbit: float) -> float:
    """The link share of TCP's bytes received between ``start`` and ``end`` (segments' headers counted)."""
    return bytes_between(samples, start, end) / E_TCP / ((end - start) * rate_mbit * 1e6 / 8)


def netagg_share(tensor_bytes: int, width: int, seconds_per_allreduce: float, rate_mbit: float) -> float:
    """The link share of one worker's packets: a tensor's worth of payload each way per allreduce."""
    return tensor_bytes / wire.payload_efficiency(k=width) / (seconds_per_allreduce * rate_mbit * 1e6 / 8)


def measure(cluster: EmulatedCluster, workers: int, size: int, iterations: int, tcp_seconds: float) -> Share:
    rate = cluster.spec.rate_mbit
    src, dst = cluster.worker_hosts[0], cluster.ps_host
    flow = TcpFlow(cluster, src, dst, tcp_seconds)
    time.sleep(tcp_seconds + 0.5)
    samples = flow.stop()
    start, end = samples[0][0] + TCP_HEAD_START, samples[-1][0]
    alone_tcp = tcp_share(samples, start, end, rate)
    alone = finish_kind(cluster, start_kind(cluster, "netagg", workers, size, iterations))
    flow = TcpFlow(cluster, src, dst, 3600)
    try:
        time.sleep(TCP_HEAD_START)
        beside = finish_kind(cluster, start_kind(cluster, "netagg", workers, size, iterations))
    finally:
        samples = flow.stop()
    window_start, window_end = beside.timed_window
    per_allreduce = (window_end - window_start) / iterations
    return Share(rate_mbit=rate, tcp_alone=alone_tcp,
                 netagg_alone=netagg_share(size * 4, alone.width, alone.seconds, rate),
                 netagg_beside_tcp=netagg_share(size * 4, beside.width, per_allreduce, rate),
                 tcp_beside_netagg=tcp_share(samples, window_start, window_end, rate),
                 netagg_seconds_alone=alone.seconds, netagg_seconds_beside=per_allreduce,
                 identical=alone.identical_on_all_workers and beside.identical_on_all_workers
                 and alone.digest == beside.digest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=float, nargs="+", default=[100.0, 400.0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--size-mb", type=float, default=4.0)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--tcp-seconds", type=float, default=5.0, help="TCP alone: how long it runs")
    parser.add_argument("--tcp-congestion", help="the hosts' TCP congestion control (default: the machine's)")
    parser.add_argument("--queue-packets", type=int, help="override configs/cluster.yaml's link queue")
    parser.add_argument("--target-rtt-ms", type=float, help="override the controller's slots.target_rtt_ms")
    parser.add_argument("--out", type=Path, default=dp.REPO_ROOT / "results")
    args = parser.parse_args(argv)
    ok, why = can_create_namespaces()
    if not ok:
        print(f"tcp_share: the emulated cluster {why}; nothing measured")
        return 2
    size = max(1, int(args.size_mb * 1e6 / 4))
    rows = []
    for rate in args.rate_mbit:
        spec = ClusterSpec.load(num_workers=args.workers, rate_mbit=rate, tcp_congestion=args.tcp_congestion,
                                queue_packets=args.queue_packets, target_rtt_ms=args.target_rtt_ms)
        print(f"emulated cluster: {args.workers} workers + PS, {rate} Mbit/s links, queue {spec.queue_packets} "
              f"packets, TCP congestion control {spec.tcp_congestion or 'the machine default'}", flush=True)
        with tempfile.TemporaryDirectory(prefix="netagg-tcp-share-") as tmp, EmulatedCluster(Path(tmp), spec) as c:
            rows.append(measure(c, args.workers, size, args.iterations, args.tcp_seconds))
    print(f"{'Mbit/s':>7} {'TCP alone':>10} {'netagg alone':>13} {'netagg beside TCP':>18} "
          f"{'TCP beside netagg':>18} {'sum':>6} {'netagg s (alone / beside)':>26} identical")
    for r in rows:
        print(f"{r.rate_mbit:>7.0f} {r.tcp_alone:>10.2f} {r.netagg_alone:>13.2f} {r.netagg_beside_tcp:>18.2f} "
              f"{r.tcp_beside_netagg:>18.2f} {r.netagg_beside_tcp + r.tcp_beside_netagg:>6.2f} "
              f"{r.netagg_seconds_alone:>12.3f} / {r.netagg_seconds_beside:<11.3f} {r.identical}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"tcp-share-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    print(f"wrote {path}")
    return 0 if all(r.identical for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
