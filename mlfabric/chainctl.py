"""Operator commands for a job's MLfabric PS chain: see every node's state, drop a dead successor.

    python -m netagg.mlfabric.chainctl --config rank0.yaml status [--json]
    python -m netagg.mlfabric.chainctl --config rank0.yaml unlink --node HOST:PORT --successor HOST:PORT

``status`` asks every endpoint of the job's chain (the config's ``ps``, then ``replicas``)
for its role, version, record number, whether it has caught up, and its successor's lag
and last error; a node that does not answer is shown as unreachable. ``unlink`` tells
``--node`` to stop replicating to ``--successor`` (a dead node): with a lag bound, a dead
successor otherwise stops the job (pushes are refused rather than acknowledged unsafely).
The chain continues shorter; restart the dead node with ``async_server --join`` to
lengthen it again. Requests carry the job's secret from the config. Exit codes: 0 done,
1 a node unreachable (status) or the request refused (unlink), 2 bad usage or config.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from netagg.hoststack.packets import resolve
from netagg.jobconfig import ConfigError, WorkerConfig, endpoint_arg
from netagg.mlfabric.protocol import Connection, Refused, Unreachable


def node_status(endpoint: tuple[str, int], config: WorkerConfig, timeout: float = 3.0) -> dict[str, Any]:
    """One node's view of itself (``stats``), or ``{"reachable": False, "error": ...}``."""
    try:
        conn = Connection(endpoint, timeout=timeout, secret=config.secret)
    except Unreachable as err:
        return {"endpoint": list(endpoint), "reachable": False, "error": str(err)}
    try:
        stats, _ = conn.call({"op": "stats", "job_id": config.job_id})
    except (Unreachable, Refused) as err:
        return {"endpoint": list(endpoint), "reachable": False, "error": str(err)}
    finally:
        conn.close()
    replication = stats.get("replication") or {}
    return {"endpoint": list(endpoint), "reachable": True, "role": stats["role"], "version": stats["version"],
            "seq": stats["seq"], "caught_up": stats["caught_up"], "halted": stats["halted"],
            "successor": replication.get("successor"), "lag": replication.get("lag"),
            "last_error": replication.get("last_error") or ""}


def chain_status(config: WorkerConfig, timeout: float = 3.0) -> list[dict[str, Any]]:
    """:func:`node_status` of every endpoint of the job's chain, in chain order."""
    if config.ps is None:
        raise ConfigError("ps: the job has no parameter server")
    return [node_status(resolve(e), config, timeout) for e in (config.ps, *config.replicas)]


def unlink(config: WorkerConfig, node: tuple[str, int], successor: tuple[str, int],
           timeout: float = 10.0) -> dict[str, Any]:
    """Ask ``node`` to drop ``successor`` from the chain; raises Refused or Unreachable."""
    conn = Connection(node, timeout=timeout, secret=config.secret)
    try:
        return conn.call({"op": "unlink", "job_id": config.job_id, "successor": list(successor)})[0]
    finally:
        conn.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="a worker config of the job (any rank)")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="every chain node's role, version and replication state")
    status.add_argument("--json", action="store_true")
    drop = sub.add_parser("unlink", help="drop a dead successor from the chain")
    drop.add_argument("--node", type=endpoint_arg, required=True, help="HOST:PORT of the node that forwards to it")
    drop.add_argument("--successor", type=endpoint_arg, required=True, help="HOST:PORT of the node to drop")
    args = parser.parse_args(argv)
    try:
        config = WorkerConfig.load(args.config)
        if args.command == "status":
            nodes = chain_status(config)
            if args.json:
                print(json.dumps(nodes))
            for n in [] if args.json else nodes:
                where = f"{n['endpoint'][0]}:{n['endpoint'][1]}"
                if not n["reachable"]:
                    print(f"{where:<22} unreachable: {n['error']}")
                    continue
                chain = f" -> {n['successor'][0]}:{n['successor'][1]} lag {n['lag']}" if n["successor"] else ""
                error = f" ({n['last_error']})" if n["last_error"] else ""
                print(f"{where:<22} {n['role']:<8} version {n['version']} record {n['seq']} "
                      f"{'caught up' if n['caught_up'] else 'NOT caught up'}{chain}{error}")
            return 0 if all(n["reachable"] for n in nodes) else 1
        result = unlink(config, resolve(args.node), resolve(args.successor))
        print(f"{args.node.host}:{args.node.port} no longer forwards to {args.successor.host}:{args.successor.port} "
              f"(at record {result['seq']})")
        return 0
    except ConfigError as err:
        print(f"chainctl: {err}", file=sys.stderr)
        return 2
    except (Refused, Unreachable) as err:
        print(f"chainctl: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
