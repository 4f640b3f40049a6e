"""``netagg``: the operator's command line (controller daemon, one command per job action, the switch shell).

Exit status: 0 ok, 1 internal error, 2 bad usage/argument/config, 3 unknown job,
4 permission denied, 5 capacity exhausted, 6 switch error (or the switch is away: the
controller is reconnecting), 7 controller unreachable.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from netagg import dataplane as dp
from netagg import wire
from netagg.controller.admission import JobRequest
from netagg.controller.api import ApiClient, ApiError
from netagg.controller.config import load_config
from netagg.controller.errors import P4RuntimeError, ServiceError
from netagg.jobconfig import ConfigError, write_private

EXIT_CODES = {
    "ok": 0, "internal": 1, "invalid_argument": 2, "not_found": 3, "permission_denied": 4,
    "capacity_exhausted": 5, "quota_exceeded": 5, "switch_error": 6, "switch_unavailable": 6, "unreachable": 7,
}
DEFAULT_CONFIG = dp.REPO_ROOT / "configs" / "controller.yaml"


def _width(text: str) -> int:
    """``--width``: values per packet, 64 or 256 (a usage error otherwise)."""
    widths = sorted(wire.WIDTH_CODES)
    if not text.strip().isdigit() or int(text) not in widths:
        raise argparse.ArgumentTypeError(f"values per packet must be one of {', '.join(map(str, widths))}, "
                                         f"got {text!r}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="netagg", description="netagg controller and job CLI")
    parser.add_argument("--config", type=Path, default=Path(os.environ.get("NETAGG_CONFIG", DEFAULT_CONFIG)),
                        help="controller YAML (for the API socket path; default %(default)s)")
    parser.add_argument("--socket", type=Path, default=os.environ.get("NETAGG_SOCKET"),
                        help="controller API socket (overrides the config's)")
    parser.add_argument("--token", default=os.environ.get("NETAGG_TOKEN"),
                        help="tenant or admin token (or NETAGG_TOKEN)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    top = parser.add_subparsers(dest="area", required=True)

    ctl = top.add_parser("controller", help="the controller daemon").add_subparsers(dest="action", required=True)
    run = ctl.add_parser("run", help="connect to the switch and serve the job API")
    run.add_argument("-v", "--verbose", action="store_true")

    switch = top.add_parser("switch", help="the switch itself").add_subparsers(dest="action", required=True)
    shell = switch.add_parser("shell", help="p4runtime-shell on the switch, read only (a backup client: the "
                              "controller stays primary)")
    shell.add_argument("--election-id", type=int, help="the shell's election id, below the controller's "
                       "(default: the controller's minus 1)")

    topo = top.add_parser("topology", help="a tree of switches (docs/hierarchy.md): check a topology file, plan a "
                          "job's tree").add_subparsers(dest="action", required=True)
    check = topo.add_parser("check", help="validate a topology file (configs/topology.yaml) and summarize it")
    check.add_argument("file", type=Path)
    plan = topo.add_parser("plan", help="the tree a job over these hosts would use: its segments and their members")
    plan.add_argument("file", type=Path)
    plan.add_argument("--hosts", required=True, help="the workers' hosts in rank order, comma-separated")
    job = top.add_parser("job", help="tenant jobs").add_subparsers(dest="action", required=True)
    create = job.add_parser("create", help="admit a job and program the switch")
    create.add_argument("--name", default="job")
    create.add_argument("--workers", required=True,
                        help="comma-separated HOST:UDP_PORT per rank (HOST: configured name or IPv4)")
    create.add_argument("--slots", type=int,
                        help="aggregation slots wanted = packets in flight per worker (of the job's width: a slot of "
                        "width 256 takes 4 cells of the switch's memory); default: the controller chooses them from "
                        "the links of the job's hosts (hosts' link_mbit, slots.target_rtt_ms; docs/controller.md)")
    create.add_argument("--width", type=_width, metavar="64|256",
                        help="values per packet, the job's one width (default: the switch target's, "
                        "switch.target: 256 on the software targets and BMv2, 64 on Tofino; docs/controller.md)")
    create.add_argument("--mode", choices=("allreduce", "ps", "fallback"), default="allreduce")
    create.add_argument("--ps", help="parameter server: a configured name or HOST:UDP_PORT")
    create.add_argument("--lease", type=float, help="lease in seconds (renew with `job renew`)")
    create.add_argument("--tenant", help="owner (admin token only)")
    create.add_argument("--sync", choices=("sync", "async"), default="sync", dest="update_mode",
                        help="how the PS applies updates (MLfabric, docs/mlfabric.md; default sync)")
    create.add_argument("--delay-bound", type=int, help="async: drop updates older than this many versions")
    create.add_argument("--schedule", choices=("fifo", "mlfabric"), default="fifo",
                        help="async: arrival order, or transfers granted by the MLfabric scheduler")
    create.add_argument("--switch-aggregation", action="store_true",
                        help="mlfabric, mode allreduce: sum the scheduler's groups of updates in the job's switch "
                        "slots (subset rounds) instead of at an idle worker")
    create.add_argument("--senders", type=int, default=0,
                        help="mode allreduce, a one-way job: the last N workers only send (e.g. a PS distributing "
                        "the model through the switch), the others only receive")
    create.add_argument("--threads", type=int, default=1,
                        help="mode allreduce: processes per worker, each over its share of the job's slots "
                        "(every worker's config says so; docs/hoststack.md)")
    create.add_argument("--deadline-ms", type=float, default=0.0, metavar="MS",
                        help="mode allreduce, opt-in: the job's gradient allreduces (the DDP hook's buckets) do not "
                        "wait for a late worker more than MS; its values join the next step's sum (docs/hoststack.md, "
                        "'Deadline allreduce'). Default 0: exact")
    create.add_argument("--replicas", type=int, help="PS replicas (chain replication); default: as many as named")
    create.add_argument("--replica-ps", help="comma-separated replica endpoints: configured names or HOST:UDP_PORT "
                        "(default: the first configured parameter servers other than --ps)")
    create.add_argument("--distribution", metavar="ENDPOINTS",
                        help="async with --ps: also create the job's model distribution job (the PS chain sends "
                        "every version once through the switch): comma-separated HOST:UDP_PORT per worker, in rank "
                        "order, where it receives the versions (docs/mlfabric.md)")
    create.add_argument("--distribution-ps", metavar="ENDPOINTS",
                        help="with --distribution: comma-separated HOST:UDP_PORT per PS node, the primary first, "
                        "then the replicas in order, where it sends the versions from")
    create.add_argument("--distribution-slots", type=int,
                        help="with --distribution: the distribution job's slots (default: the job's slots)")
    create.add_argument("--switch-ps", metavar="ENDPOINTS",
                        help="with --switch-aggregation: comma-separated HOST:UDP_PORT per PS node (the primary "
                        "first, then the replicas), where it takes part in the switch groups: the PS receives each "
                        "group's sum from the switch, no worker pushes it (its config: `job config --ps-node N`)")
    job.add_parser("list", help="jobs you can see")
    for name, text in (("show", "a job with its live counters"), ("delete", "remove a job, free its slots"),
                       ("renew", "extend a job's lease")):
        job.add_parser(name, help=text).add_argument("job_id", type=int)
    watch = top.add_parser("top", help="live view of jobs, their counters and rates, and the switch's drops")
    watch.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    watch.add_argument("--once", action="store_true", help="print one view and exit")
    config = job.add_parser("config", help="write a worker's configuration (YAML)")
    config.add_argument("job_id", type=int)
    config.add_argument("--rank", type=int, help="the worker's rank (with --distribution the same rank; or --ps-node)")
    config.add_argument("--distribution", action="store_true",
                        help="the config of the job's distribution job (--model-config of the worker or PS)")
    config.add_argument("--ps-node", type=int, help="instead of --rank: PS node N's config (0: the primary, then "
                        "the replicas in order): of the distribution job with --distribution (its rank workers + N), "
                        "else of the job's switch groups (a job created with --switch-ps; --switch-config of the PS)")
    config.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    return parser


def _format_job(job: dict[str, Any]) -> str:
    workers = ", ".join(f"{w['rank']}={w['ip']}:{w['udp_port']}" for w in job["workers"])
    width = job.get("width", wire.K)  # a controller from before wide packets: narrow
    cells = width // wire.K
    if cells == 1 or not job["slot_count"]:  # a narrow job's slots are cells; a fallback job holds none
        held = f"  slots {job['slots']} ({job['slot_count']} of {job['slots_wanted']} wanted)"
    else:
        held = (f"  cells {job['slots']} ({job['slot_count']} of {job['slots_wanted']} slots wanted, "
                f"{cells} cells each)")
    lines = [
        f"job {job['job_id']} ({job['name']}) tenant={job['tenant']} mode={job['mode']} state={job['state']}",
        f"{held}, width {width}, generation {job['generation']}",
    ]
    if job.get("tenant_limit_cells") is not None:
        lines.append(f"  tenant {job['tenant']} holds {job['tenant_cells']} of its {job['tenant_limit_cells']} cells "
                     f"({job['tenant_limit']})")
    lines += _format_moves(job)
    chosen_by = job.get("slots_chosen_by", "asked")  # a controller from before the choice: asked
    if chosen_by != "asked":
        lines.append(f"  slots chosen by the controller: {chosen_by}")
    if job.get("deadline_ms"):
        lines.append(f"  deadline allreduce: rounds close {job['deadline_ms']:g} ms after a rank began its call")
    lines.append(f"  workers {workers}")
    if job.get("left_receivers"):
        lines.append(f"  receivers out of the group (their links cannot take the versions): {job['left_receivers']}")
    if job.get("ps"):
        lines.append(f"  ps {job['ps']['ip']}:{job['ps']['udp_port']}")
    if job.get("update_mode", "sync") != "sync" or job.get("replicas"):
        bound = job.get("delay_bound")
        replicas = ", ".join(f"{r['ip']}:{r['udp_port']}" for r in job.get("replicas", [])) or "none"
        lines.append(f"  updates {job.get('update_mode', 'sync')} schedule={job.get('schedule', 'fifo')} "
                     f"delay_bound={'-' if bound is None else bound} replicas {replicas}"
                     + (" switch-aggregation" if job.get("switch_aggregation") else ""))
    if job.get("ps_members"):
        lines.append(f"  its last {job['ps_members']} rank(s) the PS chain, in every switch group "
                     "(the sums reach the PS from the switch)")
    if job.get("distribution") is not None:
        lines.append(f"  distribution job {job['distribution']} (model versions through the switch)")
    if job.get("distribution_of") is not None:
        lines.append(f"  distribution job of job {job['distribution_of']} (its last {job.get('senders', 1)} "
                     "rank(s) the PS chain)")
    if job.get("segments"):  # over a tree of switches: its slots on each
        lines.append("  switches " + ", ".join(f"{switch} {base}..{base + count * cells - 1}"
                                               for switch, (base, count) in job["segments"].items()))
    if job.get("note"):
        lines.append(f"  admitted {job['note']}")
    if "counters" in job:
        lines.append("  counters " + " ".join(f"{k}={v}" for k, v in job["counters"].items()))
    for switch, counters in job.get("switch_counters", {}).items():
        lines.append(f"    on {switch}: " + " ".join(f"{k}={v}" for k, v in counters.items()))
    return "\n".join(lines)


def _print(result: Any, args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return
    if args.action == "create":
        print(f"created job {result['job']['job_id']}: admission {result['admission']} ({result['reason']})")
        print(_format_job(result["job"]))
        print(f"worker configs: netagg job config {result['job']['job_id']} --rank R")
        if result["job"].get("ps_members"):
            print(f"PS configs (--switch-config): netagg job config {result['job']['job_id']} --ps-node N")
        if "distribution" in result:
            dist = result["distribution"]
            print(f"created its distribution job {dist['job']['job_id']}: admission {dist['admission']} "
                  f"({dist['reason']})")
            print(_format_job(dist["job"]))
            print(f"distribution configs: netagg job config {result['job']['job_id']} --distribution "
                  "--rank R (a worker) or --ps-node N (0: the primary PS, then the replicas)")
    elif args.action == "list":
        if not result:
            print("no jobs")
        print("\n".join(_format_job(job) for job in result))
    elif args.action in ("show",):
        print(_format_job(result))
    elif args.action == "delete":
        print(f"deleted job {result['job_id']} ({result['reason']}); released {result['released_slots']} slots")
        if "distribution" in result:
            dist = result["distribution"]
            print(f"deleted its distribution job {dist['job_id']}; released {dist['released_slots']} slots")
    elif args.action == "renew":
        print(f"renewed job{'s' if len(result.get('renewed', [])) > 1 else ''} "
              + ", ".join(str(i) for i in result.get("renewed", [result["job_id"]])))
    else:
        print(result)


_TOP_COUNTERS = ("contributions", "results", "duplicates", "retransmit_results", "rejects")


def _share(job: dict[str, Any]) -> str:
    """The job's fair share in its slots (``-``: the controller moves no jobs, or none is computed)."""
    share = job.get("fair_share_cells")
    return "-" if share is None else str(share // (job.get("width", wire.K) // wire.K))


def _switch_drops(args: argparse.Namespace) -> dict[tuple[str, int], int] | None:
    """The switch's drop counters (under a topology, every switch's, summed), read over P4Runtime (read only, no
    arbitration); None if one is unreachable."""
    import grpc
    from p4.v1 import p4runtime_pb2_grpc

    from netagg.controller.metrics import SWITCH_READ_TIMEOUT, read_switch_counters
    from netagg.p4info import P4InfoIndex, load_p4info

    try:
        config = load_config(args.config)
        index = P4InfoIndex(load_p4info(config.p4info))
    except (ConfigError, OSError):
        return None
    switches = [(s.grpc_address, s.device_id) for s in config.topology.switches.values()] \
        if config.topology is not None else [(config.grpc_address, config.device_id)]
    total: dict[tuple[str, int], int] = {}
    for address, device_id in switches:
        channel = grpc.insecure_channel(address)
        try:
            stub = p4runtime_pb2_grpc.P4RuntimeStub(channel)
            for key, value in read_switch_counters(stub, device_id, index, [], SWITCH_READ_TIMEOUT).drops.items():
                total[key] = total.get(key, 0) + value
        except Exception:  # unreachable or refusing: the view says so
            return None
        finally:
            channel.close()
    return total


def _format_moves(job: dict[str, Any]) -> list[str]:
    """Where the controller moves jobs (docs/controller.md, "Fair shares that move"): the job's fair share in cells,
    a move under way and the last one."""
    if "fair_share_cells" not in job:
        return []
    share = job["fair_share_cells"]
    movable = job.get("movable", "yes")
    lines = [f"  fair share {'-' if share is None else share} cells; "
             + ("moves with its share" if movable == "yes" else f"not moved: {movable}")]
    moving = job.get("moving")
    if moving:
        at = moving["switch_at"]
        lines.append(f"  moving to {moving['slot_count']} slots (generation {moving['generation']}), "
                     + ("waiting for every rank to ask" if at is None else f"switching at exchange {at}")
                     + f": {moving['reason']}")
    if job.get("last_move"):
        lines.append(f"  last move: {job['last_move']}")
    return lines


def _render_top(jobs: list[dict[str, Any]], previous: dict[int, dict[str, int]], elapsed: float | None,
                drops: dict[tuple[str, int], int] | None) -> str:
    """The `netagg top` screen: one line per job (counters and per-second rates), what each tenant holds of switch
    memory against its quota or fair share, then drops by reason."""
    from netagg.controller.metrics import drop_reason_name

    lines = [f"netagg top  {time.strftime('%H:%M:%S')}  {len(jobs)} job(s)",
             f"{'JOB':>4} {'TENANT':<10} {'NAME':<12} {'MODE':<9} {'SLOTS':>5} {'SHARE':>5} {'WKR':>3} "
             f"{'CONTRIB':>10} {'RESULTS':>10} {'RES/S':>8} {'DUPS':>7} {'RETX-RES':>8} {'REJECTS':>7} LEASE"]
    now = time.time()
    for job in jobs:
        counters = job.get("counters", {})
        before = previous.get(job["job_id"])
        rate = "-"
        if before is not None and elapsed and "results" in counters:
            rate = f"{(counters['results'] - before.get('results', 0)) / elapsed:.1f}"
        shown = [str(counters.get(k, "-")) for k in _TOP_COUNTERS]
        lease = max(0.0, job.get("lease_expires", now) - now)
        lines.append(f"{job['job_id']:>4} {job['tenant'][:10]:<10} {job['name'][:12]:<12} {job['mode']:<9} "
                     f"{job['slot_count']:>5} {_share(job):>5} {len(job['workers']):>3} {shown[0]:>10} {shown[1]:>10} "
                     f"{rate:>8} "
                     f"{shown[2]:>7} {shown[3]:>8} {shown[4]:>7} {lease:.0f}s")
    held: dict[str, str] = {}  # per tenant: the cells its jobs hold against its limit (job show's view)
    for job in jobs:
        if "tenant_cells" in job and job["tenant"] not in held:
            limit = job.get("tenant_limit_cells")
            held[job["tenant"]] = (f"{job['tenant_cells']} cells" if limit is None else
                                   f"{job['tenant_cells']} of {limit} cells ({job.get('tenant_limit')})")
    moving = [f"{job['job_id']} {job['slot_count']}->{job['moving']['slot_count']}" for job in jobs
              if job.get("moving")]
    if moving:
        lines.append("moving (job slots): " + ", ".join(moving))
    if held:
        lines.append("tenants: " + ", ".join(f"{tenant} {text}" for tenant, text in sorted(held.items())))
    if drops is None:
        lines.append("switch drops: switch unreachable")
    else:
        nonzero = [(stage, reason, n) for (stage, reason), n in sorted(drops.items()) if reason and n]
        text = ", ".join(f"{stage}/{drop_reason_name(reason)}={n}" for stage, reason, n in nonzero)
        lines.append(f"switch drops: {text or 'none'}")
    return "\n".join(lines)


def _top(args: argparse.Namespace, client: ApiClient) -> int:
    """`netagg top`: redraw every ``--interval`` seconds until Ctrl-C (or once with ``--once``)."""
    previous: dict[int, dict[str, int]] = {}
    last: float | None = None
    try:
        while True:
            jobs = []
            for job in client.call("list"):
                try:
                    jobs.append(client.call("show", job_id=job["job_id"]))
                except ApiError as err:
                    if err.code in ("switch_error", "switch_unavailable"):  # no counters: the job without them
                        jobs.append(job)
                    elif err.code != "not_found":  # not_found: deleted between list and show
                        raise
            now = time.monotonic()
            screen = _render_top(jobs, previous, None if last is None else now - last, _switch_drops(args))
            previous = {job["job_id"]: job.get("counters", {}) for job in jobs}
            last = now
            if args.once:
                print(screen)
                return 0
            print("\x1b[H\x1b[2J" + screen, flush=True)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def _socket_path(args: argparse.Namespace) -> Path:
    if args.socket:
        return Path(args.socket)
    return load_config(args.config).api_socket


def _split(text: str) -> list[str]:
    """A comma-separated list of endpoints."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _switch_shell(args: argparse.Namespace) -> int:
    """`netagg switch shell`: p4runtime-shell as a read-only backup client (controller/switch_shell.py)."""
    from netagg.controller.switch_shell import run_shell, shell_settings

    run_shell(shell_settings(load_config(args.config), args.election_id))
    return 0


def _job_command(args: argparse.Namespace) -> int:
    if not args.token:
        print("netagg: no token (use --token or NETAGG_TOKEN)", file=sys.stderr)
        return EXIT_CODES["invalid_argument"]
    client = ApiClient(_socket_path(args), args.token)
    if args.area == "top":
        return _top(args, client)
    if args.action == "create":
        request = JobRequest(
            name=args.name, workers=_split(args.workers), slots=args.slots, mode=args.mode, ps=args.ps,
            lease_seconds=args.lease, tenant=args.tenant, update_mode=args.update_mode, delay_bound=args.delay_bound,
            schedule=args.schedule, replicas=args.replicas, switch_aggregation=args.switch_aggregation,
            senders=args.senders, threads=args.threads, replica_ps=_split(args.replica_ps) if args.replica_ps else None,
            distribution=None if args.distribution is None else _split(args.distribution),
            distribution_ps=None if args.distribution_ps is None else _split(args.distribution_ps),
            distribution_slots=args.distribution_slots,
            switch_ps=None if args.switch_ps is None else _split(args.switch_ps), width=args.width,
            deadline_ms=args.deadline_ms)
        # Only what is not the default is sent, so an older controller still accepts a plain create.
        result = client.call("create", **request.to_args())
    elif args.action == "list":
        result = client.call("list")
    elif args.action == "config":
        request = {"job_id": args.job_id}
        if args.rank is not None:
            request["rank"] = args.rank
        if args.distribution:
            request["distribution"] = True
        if args.ps_node is not None:
            request["ps_node"] = args.ps_node
        text = client.call("config", **request)
        if args.output:
            write_private(args.output, text)  # owner-only: it holds the job's secret
            print(f"wrote {args.output}")
        else:
            print(text, end="")
        return 0
    else:
        result = client.call(args.action, job_id=args.job_id)
    _print(result, args)
    return 0


def _topology_command(args: argparse.Namespace) -> int:
    """``topology check`` and ``topology plan``: read the file, no switch or daemon needed."""
    from netagg.controller.topology import TreeWorker, load_topology, plan_tree

    topo = load_topology(args.file)
    if args.action == "check":
        print(f"{args.file}: {len(topo.switches)} switch(es), {len(topo.hosts)} host(s)")
        for switch in sorted(topo.switches.values(), key=lambda s: (len(topo.path_to_root(s.name)), s.name)):
            hosts = sum(1 for h in topo.hosts.values() if h.switch == switch.name)
            up = (f", up port {switch.up_port} to {switch.parent} port {switch.parent_port}"
                  if switch.parent else " (root)")
            print(f"  {switch.name}: {switch.grpc_address}, aggregator {switch.aggregator_ip}, {hosts} host(s){up}")
        return 0
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    plan = plan_tree(topo, [TreeWorker(rank, host, 0) for rank, host in enumerate(hosts)])
    print(f"{len(hosts)} worker(s), {len(plan.segments)} segment(s), root {plan.root}")
    for name, segment in plan.segments.items():
        members = ", ".join(f"{m.local_rank}=" + (f"switch {m.switch}" if m.switch else f"rank {m.rank} ({m.host})")
                            for m in segment.members)
        parent = f", rank {plan.rank_at_parent(name)} in {segment.parent}" if segment.parent else ""
        print(f"  {name}{parent}: {members}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.area == "controller":
            from netagg.controller.daemon import run

            logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                                format="%(asctime)s %(name)s %(levelname)s %(message)s")
            run(load_config(args.config))
            return 0
        if args.area == "switch":
            return _switch_shell(args)
        if args.area == "topology":
            return _topology_command(args)
        return _job_command(args)
    except ApiError as err:
        print(f"netagg: {err}", file=sys.stderr)
        return EXIT_CODES.get(err.code, 1)
    except ConfigError as err:
        print(f"netagg: {err}", file=sys.stderr)
        return EXIT_CODES["invalid_argument"]
    except P4RuntimeError as err:  # the daemon's start-up: switch unreachable, pipeline refused
        print(f"netagg: switch error: {err}", file=sys.stderr)
        return EXIT_CODES["switch_error"]
    except ServiceError as err:
        print(f"netagg: {err}", file=sys.stderr)
        return EXIT_CODES.get(err.code, 1)


if __name__ == "__main__":
    sys.exit(main())
