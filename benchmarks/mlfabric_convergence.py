"""Time to a target training loss on the emulated cluster: sync PS vs plain async vs MLfabric-scheduled async.

Four workers (hosts h0..h3) train examples/mlp_digits.py's MLP against the MLfabric PS
on the PS host, in a dynamic cluster (netagg/bmv2/dynamics.py, seeded by ``--seed``): by
default one worker host's link (both directions) runs at ``--slow-fraction`` of the
others' rate; ``--slow-hosts``, ``--change-every``, ``--stragglers``/``--straggler-ms`` and
``--background-mbit`` add more slow hosts, link-rate changes during each run, compute
stragglers and another tenant's TCP flow (each run sees the same schedule). Each run
is one job created through the CLI (``netagg job create ... --sync async --delay-bound B
[--schedule mlfabric]``), the PS and a monitor run on the PS host (the monitor reads the
model locally, off the shaped links, and halts the job once the loss over the whole
training set reaches ``--target-loss``).

Prints, per run: seconds to the target (from the moment all workers joined),
gradients applied and dropped, the largest applied delay, the scheduler's decisions;
then the time ratios. Needs root (namespaces); prints why it cannot run otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from examples.mlp_digits import init_params
from netagg import dataplane as dp
from netagg import wire
from netagg.bmv2.cluster import ClusterSpec, EmulatedCluster
from netagg.bmv2.deployment import DeploymentError, json_result
from netagg.bmv2.dynamics import ClusterDynamics, DynamicsSpec, Plan, make_plan
from netagg.bmv2.netns import can_create_namespaces
from netagg.jobconfig import WorkerConfig
from netagg.testing.mlfabric import PS_COMMAND, WORKER_COMMAND, stop

KINDS = {
    "sync": ["--sync", "sync"],
    "async": ["--sync", "async"],
    "mlfabric": ["--sync", "async", "--schedule", "mlfabric"],
    # The scheduler's groups summed in the switch (subset rounds): the job's group is its workers.
    "mlfabric-switch": ["--sync", "async", "--schedule", "mlfabric", "--switch-aggregation"],
    # And every model version sent once through the switch (a distribution job: mlfabric/distribution.py).
    "mlfabric-mcast": ["--sync", "async", "--schedule", "mlfabric", "--switch-aggregation"],
    # Gang rounds (one switch group per batch, the scheduler's item 6) without sending the versions: members
    # compute the next model from their group's sum, the others pull.
    "mlfabric-gang": ["--sync", "async", "--schedule", "mlfabric", "--switch-aggregation"],
}
# The same with the PS as a member of every switch group (``--switch-ps``): it receives each group's sum from
# the switch, so no worker pushes it over TCP (docs/mlfabric.md, "The PS in the switch groups").
for _kind in ("mlfabric-switch", "mlfabric-mcast", "mlfabric-gang"):
    KINDS[f"{_kind}-ps"] = KINDS[_kind]
#: Kinds whose PS plans gang rounds (with MULTICAST: by default).
GANG = {"mlfabric-gang", "mlfabric-gang-ps"}
#: Kinds whose PS sends the model through the switch.
MULTICAST = {"mlfabric-mcast", "mlfabric-mcast-ps"}
#: Kinds whose PS takes part in the switch groups.
PS_MEMBER = {kind for kind in KINDS if kind.endswith("-ps")}


def create_job(cluster: EmulatedCluster, hosts: list[str], options: list[str], name: str,
               slots: int = 4) -> tuple[int, list[Path]]:
    """``netagg job create`` with MLfabric options (PS ps0; mode ps, or allreduce for switch aggregation)."""
    ports = cluster.worker_ports(hosts)
    mode = "allreduce" if "--switch-aggregation" in options else "ps"
    created = json.loads(cluster.cli("--json", "job", "create", "--name", name, "--slots", str(slots), "--mode", mode,
                                     "--ps", "ps0", "--workers", ",".join(f"{h}:{p}" for h, p in zip(hosts, ports)),
                                     *options))
    job_id = created["job"]["job_id"]
    paths = []
    for rank in range(len(hosts)):
        path = cluster.workdir / f"mlfabric-job{job_id}-rank{rank}.yaml"
        cluster.cli("job", "config", str(job_id), "--rank", str(rank), "-o", str(path))
        WorkerConfig.load(path)
        paths.append(path)
    return job_id, paths


def run(cluster: EmulatedCluster, kind: str, args: argparse.Namespace, plan: Plan) -> dict:
    """One run of ``kind``; ``plan``'s other tenant starts with it, and its rate changes count from the workers'
    start (the same for every run: the job's creation and the PS's start, which take longer for some kinds, do not
    use up the plan's first seconds)."""
    with ClusterDynamics(cluster, plan, deferred=True) as dynamics:
        row = _run(cluster, kind, args, plan, dynamics.start)
    row["dynamics_lead_s"] = round(dynamics.lead, 2)
    exchanges = row.pop("ps_exchanges")
    if exchanges:
        # Each group's exchange against its own link time: one model's frames at the slowest link its packets cross
        # when it starts (its members' and the PS host's, as the dynamics set them; the other tenant's share of a
        # link is not taken off, so a group on that link looks slower than it is).
        hosts = cluster.worker_hosts[:args.workers]
        ratios = [seconds / (row["link_s"] * args.rate_mbit / min(dynamics.rate_at(h, start) for h in
                                                                   [cluster.ps_host, *(hosts[r] for r in ranks)]))
                  for start, seconds, ranks in exchanges]
        row["ps_exchange_group_link"] = round(float(np.mean(ratios)), 2)
        row["ps_exchange_group_link_p90"] = round(float(np.percentile(ratios, 90)), 2)
    row["rate_changes"] = len(dynamics.applied)
    row["background_bytes"] = sum(flow["received"] for flow in dynamics.background_bytes)
    return row


def _run(cluster: EmulatedCluster, kind: str, args: argparse.Namespace, plan: Plan,
         start_changes: Callable[[], None] = lambda: None) -> dict:
    hosts = cluster.worker_hosts[:args.workers]
    options = KINDS[kind] + (["--delay-bound", str(args.delay_bound)] if kind != "sync" else [])
    if kind in MULTICAST:  # the job's distribution job: receivers on other ports of the worker hosts, the PS
        # sending from another port of its host (the controller creates it with the job, and deletes it with it)
        receivers = cluster.worker_ports(hosts, offset=100)
        sender = cluster.worker_ports([cluster.ps_host], offset=200)[0]
        options += ["--distribution", ",".join(f"{h}:{p}" for h, p in zip(hosts, receivers)),
                    "--distribution-ps", f"{cluster.ps_host}:{sender}"]
    if kind in PS_MEMBER:  # the PS's rank in the job's switch groups: another UDP port of its host
        options += ["--switch-ps", f"{cluster.ps_host}:{cluster.worker_ports([cluster.ps_host], offset=300)[0]}"]
    job_id, paths = create_job(cluster, hosts, options, f"mlfabric-{kind}", args.slots)
    width = WorkerConfig.load(paths[0]).width  # the job's packet width: the link time below counts its frames
    member_args: list[str] = []
    if kind in PS_MEMBER:
        member = cluster.workdir / f"mlfabric-job{job_id}-ps-member.yaml"
        cluster.cli("job", "config", str(job_id), "--ps-node", "0", "-o", str(member))
        member_args = ["--switch-config", str(member)]
        if args.switch_deadline is not None:
            member_args += ["--switch-deadline", str(args.switch_deadline)]
    dist_paths: list[Path] = []
    if kind in MULTICAST:  # each worker's rank, then the PS's (the last rank)
        for rank in range(len(hosts) + 1):
            path = cluster.workdir / f"mlfabric-job{job_id}-distribution-rank{rank}.yaml"
            which = ["--rank", str(rank)] if rank < len(hosts) else ["--ps-node", "0"]
            cluster.cli("job", "config", str(job_id), "--distribution", *which, "-o", str(path))
            dist_paths.append(path)
    log = cluster.workdir / f"mlfabric-ps-{kind}.log"
    # One BLAS thread per process (unless the caller says otherwise): the PS, the monitor and four workers share
    # the machine's cores, and BLAS's own threads only spin against them.
    env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen] = []
    try:
        with open(log, "wb") as out:
            model_args = ["--model-config", str(dist_paths[-1]), "--model-rate-mbit",
                          str(args.rate_mbit)] if dist_paths else []
            if kind.startswith("mlfabric"):  # an unmeasured sender is assumed at the link's rate
                model_args += ["--batch-window", str(args.batch_window), "--default-bandwidth",
                               str(args.rate_mbit * 1e6 / 8), *(["--gang"] if kind in GANG else [])]
            lr = args.lr if kind != "sync" else args.sync_lr if args.sync_lr is not None else args.lr * args.workers
            ps = subprocess.Popen(cluster.host_command(cluster.ps_host, [*PS_COMMAND, "--config", str(paths[0]),
                                                                         "--lr", str(lr), *model_args,
                                                                         *member_args]),
                                  stdout=out, stderr=subprocess.STDOUT, env=env, cwd=dp.REPO_ROOT)
        procs.append(ps)
        deadline = time.monotonic() + 30
        while "mlfabric PS:" not in log.read_text(errors="replace"):
            if ps.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PS did not start:\n{log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        monitor = subprocess.Popen(cluster.host_command(cluster.ps_host, [
            *WORKER_COMMAND, "--monitor", "--config", str(paths[0]), "--target-loss", str(args.target_loss),
            "--hidden", str(args.hidden),
            "--max-seconds", str(args.max_seconds), "--interval", "0.1"]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=dp.REPO_ROOT)
        procs.append(monitor)
        start_changes()
        worker_logs = [open(cluster.workdir / f"mlfabric-worker{rank}-{kind}.log", "w")  # noqa: SIM115
                       for rank in range(len(hosts))]
        workers = [subprocess.Popen(cluster.host_command(host, [
            *WORKER_COMMAND, "--config", str(path), "--steps", str(args.max_steps), "--hidden", str(args.hidden),
            "--compute-delay", str(plan.compute_delay_ms.get(host, 0.0) / 1e3),
            *(["--model-config", str(dist_paths[rank]), "--local-wait", str(args.local_wait)] if dist_paths else [])]),
                                    stdout=subprocess.PIPE, stderr=worker_logs[rank], text=True, env=env,
                                    cwd=dp.REPO_ROOT)
                   for rank, (host, path) in enumerate(zip(hosts, paths))]
        procs.extend(workers)
        final, curve = _monitor_result(monitor, timeout=args.max_seconds + 120)
        reports = []
        for rank, proc in enumerate(workers):
            try:
                reports.append(json_result(proc, f"worker {rank}", timeout=60))
            except DeploymentError as err:  # its stderr went to its log: say what it said last
                tail = (cluster.workdir / f"mlfabric-worker{rank}-{kind}.log").read_text(errors="replace")[-2000:]
                raise DeploymentError(f"{err}{tail}") from None
    finally:
        for proc in procs:
            stop(proc)
        for out in locals().get("worker_logs", []):
            out.close()
        cluster.cli("job", "delete", str(job_id))  # and its distribution job
    stats = final["stats"]
    scheduler = final.get("scheduler") or {}
    return {"curve": curve,
        "kind": kind, "time_to_target": final["time_to_target"], "loss": final.get("loss"),
        "accuracy": final.get("accuracy"), "version": final.get("version"),
        "applied": stats["applied"], "dropped": stats["dropped"], "max_delay": final["max_delay"],
        "applied_by_rank": stats["applied_by_rank"], "dropped_by_rank": stats["dropped_by_rank"],
        "scheduler_dropped": sum(r.get("scheduler_dropped", 0) for r in reports),
        "aggregated_members": scheduler.get("aggregated", 0), "groups": scheduler.get("groups", 0),
        "switch_aggregated": sum(r.get("switch_aggregated", 0) for r in reports),
        "switch_fallbacks": sum(r.get("switch_fallbacks", 0) for r in reports),
        "local_models": sum(r.get("local_models", 0) for r in reports),
        "applied_locally": sum(r.get("applied_locally", 0) for r in reports),
        # Closed groups' rests: pushed to the PS, or carried into the member's next update (folded).
        "rests_pushed": stats.get("remainders_applied", 0) + stats.get("remainders_dropped", 0),
        "rests_folded": stats.get("remainders_folded", 0),
        # The PS's link: model bytes out (pulls, versions sent through the switch, a switch member's zeros) and
        # update bytes in (pushes, the sums a switch member received).
        "ps_out_mb": round((stats.get("pull_bytes", 0) + (final.get("distribution") or {}).get("bytes_sent", 0)
                            + (final.get("switch_member") or {}).get("bytes_out", 0)) / 1e6, 1),
        "ps_in_mb": round((stats.get("push_bytes", 0) + (final.get("switch_member") or {}).get("bytes_in", 0))
                          / 1e6, 1),
        "switch_sums": stats.get("switch_sums", 0), "switch_sum_failures": stats.get("switch_sum_failures", 0),
        # The PS's exchange per group it received (a switch member), against one model's frames at the link rate.
        "ps_exchange_s": round(member["seconds"] / member["groups"], 3) if (member := final.get("switch_member"))
        and member.get("groups") else None,
        "ps_exchanges": (final.get("switch_member") or {}).get("exchanges", []),
        "link_s": round(-(-_model_values(args.hidden) // width) * wire.frame_bytes(width) * 8 / (args.rate_mbit * 1e6),
                        3),
        "pulls": sum(r.get("pulls", 0) for r in reports),
        # Receivers that left the distribution's multicast group (their link could not take it) and joined again.
        "receiver_leaves": sum(r.get("distribution_leaves", 0) for r in reports),
        "receiver_joins": sum(r.get("distribution_joins", 0) for r in reports),
        # Per worker: seconds getting models, computing, waiting for grants, sending (training.PHASES).
        "phases": [{k: round(v, 1) for k, v in (r.get("phase_seconds") or {}).items()} for r in reports],
        "steps": [r.get("steps", 0) for r in reports],
        "grant_wire": [round(r.get("grant_wire_seconds", 0.0), 2) for r in reports],
        "bandwidth": {k: round(v / 1e3, 1) for k, v in (scheduler.get("bandwidth") or {}).items()},
        "hints": {k: round(v / 1e3, 1) for k, v in (scheduler.get("hints") or {}).items()},
        "deferred": scheduler.get("deferred", 0),
    }


def _model_values(hidden: int) -> int:
    """Values of examples/mlp_digits.py's MLP with ``hidden`` units."""
    return sum(a.size for a in init_params(hidden=hidden))


def _monitor_result(monitor: subprocess.Popen, timeout: float) -> tuple[dict, list[dict]]:
    """The monitor's final line and its (t, version, loss, accuracy) lines before it."""
    out, err = monitor.communicate(timeout=timeout)
    lines = [json.loads(line) for line in (out or "").splitlines() if line.startswith("{")]
    if monitor.returncode != 0 or not lines or "final" not in lines[-1]:
        raise RuntimeError(f"monitor failed (exit {monitor.returncode}):\n{(err or '')[-2000:]}")
    return lines[-1]["final"], lines[:-1]


def build_parser() -> argparse.ArgumentParser:
    """The options of a run (also the soak's, benchmarks/soak_mlfabric.py)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rate-mbit", type=float, default=4.0, help="every host's link (default 4)")
    parser.add_argument("--slow-fraction", type=float, default=0.25, help="the slow hosts' share of that rate")
    parser.add_argument("--slow-hosts", type=float, default=0.25, help="share of the worker hosts that are slow")
    parser.add_argument("--change-every", type=float, default=0.0, help="seconds between link-rate changes (0: none)")
    parser.add_argument("--change-low", type=float, default=0.25, help="a change sets a rate of low..1 x its own")
    parser.add_argument("--stragglers", type=float, default=0.0, help="share of workers with extra compute")
    parser.add_argument("--straggler-ms", type=float, default=0.0, help="their extra compute per step")
    parser.add_argument("--background-mbit", type=float, default=0.0, help="another tenant's flow to the PS host")
    parser.add_argument("--seed", type=int, default=0, help="seed of the cluster's dynamics")
    parser.add_argument("--delay-bound", type=int, default=4)
    parser.add_argument("--target-loss", type=float, default=0.2)
    parser.add_argument("--lr", type=float, default=0.0125,
                        help="the PS's step per gradient (async kinds: w -= lr * g; default 0.0125)")
    parser.add_argument("--sync-lr", type=float, help="sync's step on the mean of a round (default: --lr x workers, "
                        "the same step per gradient)")
    parser.add_argument("--local-wait", type=float, default=1.0, help="multicast kinds: how long a worker waits for "
                        "a version through the switch before it pulls")
    parser.add_argument("--max-seconds", type=float, default=90.0, help="give up on a run after this long")
    parser.add_argument("--max-steps", type=int, default=400, help="steps per worker at most")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--slots", type=int, default=4, help="the job's switch slots")
    parser.add_argument("--setting", default="", help="a name for the cluster setting, kept with the curves")
    parser.add_argument("--keep-logs", type=Path, help="copy each run's PS and worker logs into this directory")
    parser.add_argument("--switch-deadline", type=float, help="-ps kinds: the PS's --switch-deadline (its switch "
                        "groups close at this times their planned transfer; 0: they wait for every member; default: "
                        "the PS's own default)")
    parser.add_argument("--curves", type=Path, help="append each run's loss and accuracy over time to this JSON-lines "
                        "file (plot it with benchmarks/plot_curves.py)")
    parser.add_argument("--batch-window", type=float, default=0.01,
                        help="the scheduler's batch window: longer batches gather more requests to aggregate")
    parser.add_argument("--hidden", type=int, default=64,
                        help="hidden units of the MLP: 64 is 4,874 values (19.5 kB); 8192 is 606k (2.4 MB)")
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    parser.add_argument("--tcp-congestion", help="TCP congestion control in the hosts (default: configs/cluster.yaml's "
                        "tcp_congestion, or the machine's default where it has none); the soak also takes a "
                        "comma-separated list and alternates them run by run")
    return parser


def dynamics_spec(args: argparse.Namespace) -> DynamicsSpec:
    return DynamicsSpec(seed=args.seed, slow_fraction=args.slow_hosts, slow_factor=args.slow_fraction,
                        change_every=args.change_every, change_low=args.change_low,
                        straggler_fraction=args.stragglers, straggler_ms=args.straggler_ms,
                        background_mbit=args.background_mbit)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ok, why = can_create_namespaces()
    if not ok:
        print(f"mlfabric_convergence: the emulated cluster {why}; nothing measured")
        return 2
    spec = ClusterSpec.load(num_workers=args.workers, rate_mbit=args.rate_mbit, target="soft",
                            tcp_congestion=args.tcp_congestion)
    dynamics = dynamics_spec(args)
    print(f"emulated cluster: {args.workers} workers + PS host, soft switch, {spec.rate_mbit} Mbit/s and "
          f"{spec.delay_ms} ms per link, TCP {spec.tcp_congestion or 'the machine default'}, {dynamics}; "
          f"MLP hidden {args.hidden}, delay bound {args.delay_bound}, lr {args.lr} per gradient "
          f"(sync: {args.sync_lr or args.lr * args.workers} on the mean), target loss {args.target_loss}; "
          f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="netagg-mlfabric-") as tmp, EmulatedCluster(Path(tmp), spec) as cluster:
        plan = make_plan(dynamics, cluster.worker_hosts, cluster.ps_host, spec.rate_mbit, args.max_seconds + 30)
        print(f"plan: rates {plan.rates}, changes {list(plan.changes)[:6]}{' ...' if len(plan.changes) > 6 else ''}, "
              f"compute delays {plan.compute_delay_ms}, other tenant {list(plan.background)}", flush=True)
        for repeat in range(args.repeats):
            for kind in args.kinds:
                try:
                    row = run(cluster, kind, args, plan)
                except Exception as err:  # one failed run is reported (with the PS's last words), the sweep goes on
                    ps_log = cluster.workdir / f"mlfabric-ps-{kind}.log"
                    ps_tail = ps_log.read_text(errors="replace")[-1500:] if ps_log.exists() else ""
                    row = {"kind": kind, "time_to_target": None, "error": str(err)[-600:], "ps_log": ps_tail,
                           "applied": 0,
                           "dropped": 0, "scheduler_dropped": 0, "aggregated_members": 0, "switch_aggregated": 0,
                           "max_delay": None}
                row["repeat"] = repeat
                if args.keep_logs is not None:  # the PS's and workers' logs of every run, to see what went wrong
                    args.keep_logs.mkdir(parents=True, exist_ok=True)
                    for log in [cluster.workdir / f"mlfabric-ps-{kind}.log",
                                *cluster.workdir.glob(f"mlfabric-worker*-{kind}.log")]:
                        shutil.copy(log, args.keep_logs / f"{log.stem}-{repeat}.log")
                curve = row.pop("curve", [])
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.curves is not None:
                    with args.curves.open("a") as out:
                        out.write(json.dumps({"kind": kind, "repeat": repeat, "setting": args.setting,
                                              "curve": curve}) + "\n")
    print()
    print(f"{'kind':<15} {'rep':>3} {'s to loss':>9} {'applied':>7} {'dropped':>7} {'sched drop':>10} "
          f"{'aggregated':>10} {'in switch':>9} {'max delay':>9}")
    for r in rows:
        t = "-" if r["time_to_target"] is None else f"{r['time_to_target']:.2f}"
        print(f"{r['kind']:<15} {r['repeat']:>3} {t:>9} {r['applied']:>7} {r['dropped']:>7} "
              f"{r['scheduler_dropped']:>10} {r['aggregated_members']:>10} {r['switch_aggregated']:>9} "
              f"{r['max_delay']!s:>9}")
    means = {}
    for kind in args.kinds:
        times = [r["time_to_target"] for r in rows if r["kind"] == kind]
        if times and all(t is not None for t in times):
            means[kind] = sum(times) / len(times)
    for fabric in [k for k in KINDS if k.startswith("mlfabric")]:
        if fabric not in means:
            continue
        for other in ("sync", "async"):
            if other in means:
                print(f"time to loss {args.target_loss}: {other} / {fabric} = {means[other] / means[fabric]:.2f}x")
        baselines = [means[k] for k in ("sync", "async") if k in means]
        if baselines:
            print(f"time to loss {args.target_loss}: best of sync and async / {fabric} = "
                  f"{min(baselines) / means[fabric]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
