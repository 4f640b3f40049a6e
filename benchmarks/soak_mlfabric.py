"""``make soak-mlfabric``: MLfabric training runs back to back for a bounded time, counting every failure.

Runs ``benchmarks.mlfabric_convergence``'s runs (the emulated cluster, a job created through
the CLI, the MLfabric PS, a monitor and the workers) one after another, cycling over
``--kinds`` (default: async, mlfabric and mlfabric-switch, where a push was once seen cut off
by the PS with every retry for 30 s), in the dynamic cluster of docs/mlfabric.md, until
``--minutes`` have passed. Each run is bounded (``--max-seconds``); a run that fails is
reported with its error and the PS's last log lines, and classified: a worker's push cut off
(the error names a push and a closed or reset connection, or a timeout), or anything else.
Prints one JSON line per run and a summary; exit status 1 if any run failed, 2 where the
emulated cluster cannot run (no root or no namespaces).

    make soak-mlfabric [SOAK_ARGS='--minutes 30 --kinds async mlfabric']
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks import mlfabric_convergence as conv
from netagg.bmv2.cluster import ClusterSpec, EmulatedCluster
from netagg.bmv2.dynamics import make_plan
from netagg.bmv2.netns import can_create_namespaces, ns_exec, run

#: The dynamic cluster of docs/mlfabric.md's evaluation (more rate changes, stragglers, another tenant).
DYNAMIC = ["--max-seconds", "90", "--slots", "64", "--hidden", "4096", "--rate-mbit", "40", "--batch-window", "0.3",
           "--change-every", "4", "--stragglers", "0.25", "--straggler-ms", "100", "--background-mbit", "8"]
_CUT_OFF = re.compile(r"push.*(closed|reset|broken pipe|eof|timed? ?out)|(closed|reset|timed? ?out).*push",
                      re.IGNORECASE | re.DOTALL)


def classify(error: str) -> str:
    """``push cut off`` (the intermittent failure the soak looks for) or ``other``."""
    return "push cut off" if _CUT_OFF.search(error) else "other"


def _link_counters(cluster: EmulatedCluster) -> dict[str, str]:
    """Every host's link queue right after a failed run (``tc -s qdisc``: rate, sent, drops, backlog since
    the cluster began), to tell a dead or overflowing link from a stuck process."""
    namespaces = {host: cluster.namespace_of(host) for host in [*cluster.worker_hosts, cluster.ps_host]}
    namespaces["switch"] = cluster.topology.switch_namespace
    out = {}
    for name, namespace in namespaces.items():
        result = run(ns_exec(namespace, ["tc", "-s", "qdisc", "show"]), check=False)
        out[name] = " ".join(result.stdout.split())[:1500 if name == "switch" else 400]
    return out


def _switch_drops(cluster: EmulatedCluster) -> str:
    """The switch's drop counters by reason (``netagg top --once``), since the switch started."""
    try:
        view = cluster.cli("top", "--once")
    except Exception as err:  # a diagnostic: say why it is missing
        return f"unavailable: {err}"
    return view[view.find("drops"):][:800] if "drops" in view else view[-800:]


def _port_losses(cluster: EmulatedCluster, lines: int = 12) -> list[str]:
    """The switch's last reports of frames its ports lost (softswitch/cli.py: sends refused, receive rings
    full), each port named by its host, to tell which link lost what around the failure."""
    names = {host.switch_port: host.name for host in cluster.topology.hosts}
    log = cluster.workdir / "switch.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    reports = [line for line in text.splitlines() if "raw port losses" in line][-lines:]
    for port, name in names.items():
        reports = [line.replace(f"port {port}:", f"port {port} ({name}):") for line in reports]
    return reports


def _default_congestion() -> str:
    """The machine's default TCP congestion control (what the hosts run when the cluster sets none)."""
    path = Path("/proc/sys/net/ipv4/tcp_congestion_control")
    return f"{path.read_text().strip()} (the machine's default)" if path.exists() else "the machine's default"


def main(argv: list[str] | None = None) -> int:
    parser = conv.build_parser()
    parser.description = __doc__
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to keep starting runs")
    parser.set_defaults(kinds=["async", "mlfabric", "mlfabric-switch"])
    args = parser.parse_args([*DYNAMIC, *(argv if argv is not None else sys.argv[1:])])
    ok, why = can_create_namespaces()
    if not ok:
        print(f"soak_mlfabric: the emulated cluster {why}; nothing run")
        return 2
    congestion = args.tcp_congestion.split(",") if args.tcp_congestion else []
    spec = ClusterSpec.load(num_workers=args.workers, rate_mbit=args.rate_mbit, target="soft",
                            tcp_congestion=congestion[0] if congestion else None)
    dynamics = conv.dynamics_spec(args)
    print(f"soak: {args.minutes:g} min of runs of {', '.join(args.kinds)}; {args.workers} workers, "
          f"{args.rate_mbit} Mbit/s, TCP {' then '.join(congestion) or _default_congestion()}, {dynamics}; "
          f"each run at most {args.max_seconds:g} s", flush=True)
    runs: list[dict] = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="netagg-soak-") as tmp, EmulatedCluster(Path(tmp), spec) as cluster:
        plan = make_plan(dynamics, cluster.worker_hosts, cluster.ps_host, spec.rate_mbit, args.max_seconds + 30)
        index = 0
        while time.monotonic() - start < args.minutes * 60:
            kind = args.kinds[index % len(args.kinds)]
            if len(congestion) > 1:  # interleaved: every kind runs under each in turn
                cluster.topology.set_tcp_congestion(congestion[(index // len(args.kinds)) % len(congestion)])
            began = time.monotonic()
            try:
                row = conv.run(cluster, kind, args, plan)
                result = {"kind": kind, "ok": row["time_to_target"] is not None,
                          "time_to_target": row["time_to_target"], "applied": row["applied"],
                          "dropped": row["dropped"]}
                if not result["ok"]:
                    result["failure"] = "did not reach the target loss within --max-seconds"
                    result["class"] = "other"
            except Exception as err:  # a failed run is the finding: report it and go on
                ps_log = cluster.workdir / f"mlfabric-ps-{kind}.log"
                text = str(err)
                result = {"kind": kind, "ok": False, "who": text.split(":", 1)[0][:80], "failure": text[-1500:],
                          "class": classify(text),
                          "ps_log": ps_log.read_text(errors="replace")[-1500:] if ps_log.exists() else "",
                          "links": _link_counters(cluster), "switch_drops": _switch_drops(cluster),
                          "port_losses": _port_losses(cluster)}
            result["tcp"] = cluster.topology.tcp_congestion or _default_congestion()
            result["run"] = index
            result["seconds"] = round(time.monotonic() - began, 1)
            runs.append(result)
            print(json.dumps(result), flush=True)
            index += 1
    elapsed = (time.monotonic() - start) / 60
    failed = [r for r in runs if not r["ok"]]
    print(f"\nsoak: {len(runs)} runs in {elapsed:.1f} min; failed {len(failed)}")
    for kind in args.kinds:
        mine = [r for r in runs if r["kind"] == kind]
        times = [r["time_to_target"] for r in mine if r["ok"]]
        spread = f"{min(times):.1f}-{max(times):.1f} s to the target" if times else "-"
        print(f"  {kind:<16} runs {len(mine):>3}  failed {sum(not r['ok'] for r in mine):>2}  {spread}")
    if len(congestion) > 1:
        for algorithm in congestion:
            mine = [r for r in runs if r["tcp"] == algorithm]
            print(f"  TCP {algorithm:<12} runs {len(mine):>3}  failed {sum(not r['ok'] for r in mine):>2}  "
                  f"pushes cut off {sum(r.get('class') == 'push cut off' for r in mine):>2}")
    classes = Counter(r["class"] for r in failed)
    print(f"  pushes cut off: {classes.get('push cut off', 0)}; other failures: {classes.get('other', 0)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
