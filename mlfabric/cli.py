"""The MLfabric parameter server's command line: ``python -m netagg.mlfabric.async_server --config rank0.yaml``.

One node of a job's PS chain (:class:`~netagg.mlfabric.async_server.FabricServer`) until SIGINT/SIGTERM;
with ``--peer-timeout`` a node whose chain is already running joins its tail (:func:`chain_running`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from netagg.jobconfig import ConfigError, WorkerConfig, endpoint_arg, resolve
from netagg.mlfabric import chainctl
from netagg.mlfabric.async_server import FabricServer
from netagg.mlfabric.distribution import ModelSender, rate_of
from netagg.mlfabric.grants import SWITCH_DEADLINE
from netagg.mlfabric.protocol import FabricError
from netagg.shutdown import stop_event


def chain_running(config: WorkerConfig, replica: int | None, timeout: float = 1.0) -> str:
    """Why the node at chain position ``replica`` (None: the primary's) must join the running chain rather
    than take its configured place: another chain node that answers is the primary or has applied records
    ("" if none does: the job is starting, and every node takes its configured place)."""
    assert config.ps is not None
    chain = [resolve(e) for e in (config.ps, *config.replicas)]
    position = 0 if replica is None else replica + 1
    for i, endpoint in enumerate(chain):
        if i == position:
            continue
        node = chainctl.node_status(endpoint, config, timeout=timeout)
        if node["reachable"] and node["role"] == "primary" and not node["superseded"]:
            return f"{endpoint[0]}:{endpoint[1]} is the primary"
        if node["reachable"] and node["seq"] > 0:
            return f"{endpoint[0]}:{endpoint[1]} has applied {node['seq']} records"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one node of a job's MLfabric PS until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m netagg.mlfabric.async_server",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="the job's worker YAML (any rank's)")
    parser.add_argument("--replica", type=int, help="run replica N of the chain (default: the primary)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    parser.add_argument("--bind", type=endpoint_arg, help="HOST:PORT to listen on instead of the config's")
    parser.add_argument("--max-lag", type=int, default=1, help="records a replica may lag behind (default 1)")
    parser.add_argument("--join", type=endpoint_arg, metavar="HOST:PORT",
                        help="start empty and join the chain as the successor of the node at HOST:PORT (its tail; "
                             "e.g. a replica promoted after a failover); it brings this node up to date")
    parser.add_argument("--peer-timeout", type=float, default=3.0,
                        help="seconds without contact after which a dead successor is removed from the chain, and "
                        "a replica without upstream joins the live chain's tail by itself; at start, a node whose "
                        "chain is already running (another node is the primary or has state) joins its tail "
                        "instead of taking its configured place (default 3; 0: an operator does it: chainctl)")
    parser.add_argument("--outcome-window", type=int, default=1024,
                        help="steps per rank whose outcomes are kept to answer repeated pushes (default 1024)")
    parser.add_argument("--log-size", type=int, default=100_000,
                        help="applied updates kept in the log returned by stats (default 100000)")
    parser.add_argument("--model-config", help="the PS's rank in the job's distribution job on the switch: send "
                        "every new model version through it (docs/mlfabric.md)")
    parser.add_argument("--switch-config", help="this PS node's rank in the job's switch groups (a job created with "
                        "--switch-ps; `netagg job config JOB --ps-node N`): the PS takes part in every switch group "
                        "and receives its sum from the switch (docs/mlfabric.md)")
    parser.add_argument("--model-rate-mbit", type=float, default=10.0,
                        help="pace of those sends (the PS link's rate; default 10)")
    parser.add_argument("--batch-window", type=float, default=0.01,
                        help="scheduler: how long a batch of requests waits for the others after its first")
    parser.add_argument("--gang", action=argparse.BooleanOptionalAction, default=None,
                        help="scheduler: gang rounds, one switch group per batch (default: with --model-config)")
    parser.add_argument("--switch-deadline", type=float, default=SWITCH_DEADLINE,
                        help="with --switch-config: close each switch group's rounds at this factor times its "
                        f"planned transfer; late members push their updates (default {SWITCH_DEADLINE}; 0: wait for "
                        "every member)")
    parser.add_argument("--fold-rests", action=argparse.BooleanOptionalAction, default=True,
                        help="a member of a group closed without some of its values carries them into its next "
                        "update (error feedback; default); --no-fold-rests: it pushes them to the PS")
    parser.add_argument("--hold-pushes", action=argparse.BooleanOptionalAction, default=True,
                        help="gang rounds with --switch-config: a worker's own push waits for the next switch group "
                        "and joins its sum as the PS's contribution (default); --no-hold-pushes: applied at once")
    parser.add_argument("--default-bandwidth", type=float, default=1.25e6,
                        help="scheduler: bytes/s assumed for a sender not measured yet")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("NETAGG_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = WorkerConfig.load(args.config)
        join_target = resolve(args.join) if args.join is not None else None
        if args.peer_timeout < 0:
            raise ValueError(f"--peer-timeout {args.peer_timeout}: must be >= 0")
        running = ""
        if join_target is None and args.peer_timeout > 0 and config.ps is not None:
            running = chain_running(config, args.replica)
        distribution = None
        if args.model_config:
            distribution = ModelSender(WorkerConfig.load(args.model_config), rate_of(args.model_rate_mbit))
        server = FabricServer(config, lr=args.lr, replica=args.replica, distribution=distribution,
                              bind=resolve(args.bind) if args.bind is not None else None, max_lag=args.max_lag,
                              default_bandwidth=args.default_bandwidth, outcome_window=args.outcome_window,
                              batch_window=args.batch_window, gang=args.gang, peer_timeout=args.peer_timeout,
                              log_size=args.log_size, joining=args.join is not None or bool(running),
                              switch_member=WorkerConfig.load(args.switch_config) if args.switch_config else None,
                              switch_deadline=args.switch_deadline, fold_rests=args.fold_rests,
                              hold_pushes=args.hold_pushes)
    except (ConfigError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    stop = stop_event()
    with server:
        if join_target is not None:
            try:
                joined = server.join(join_target)
            except FabricError as err:
                print(f"error: join {args.join.host}:{args.join.port}: {err}", file=sys.stderr)
                return 2
            print(f"joined the chain after {args.join.host}:{args.join.port} (its record {joined['seq']})", flush=True)
        if running:
            print(f"the chain is running ({running}): joining its tail", flush=True)
        print(f"mlfabric PS: job {config.job_id} {server.role} ({config.update_mode}, schedule {config.schedule}, "
              f"delay bound {config.delay_bound}, {len(config.replicas)} replica(s)) on "
              f"{server.address[0]}:{server.address[1]}", flush=True)
        while not stop.wait(0.5):
            pass
    print(f"mlfabric PS: stopped at version {server.version}; {server.stats}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
