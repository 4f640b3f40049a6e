"""Operator commands for a job's MLfabric PS chain: see every node's state, drop a dead successor.

    python -m netagg.mlfabric.chainctl --config rank0.yaml status [--json]
    python -m netagg.mlfabric.chainctl --config rank0.yaml unlink --node HOST:PORT --successor HOST:PORT

``status`` asks every endpoint of the job's chain (the config's ``ps``, then ``replicas``)
for its role, version, record number, whether it has caught up, and its successor's lag
and last error; a node that does not answer is shown as unreachable. A last line shows the
live chain, from the primary along each node's successor (:func:`live_chain`, which the
nodes themselves use to find the tail they rejoin). ``unlink`` tells ``--node`` to stop
replicating to ``--successor`` (a dead node): with a lag bound, a dead successor otherwise
stops the job (pushes are refused rather than acknowledged unsafely). The chain continues
shorter; restart the dead node to lengthen it again. Nodes started with a failure timeout
(``async_server --peer-timeout``, on by default) do both by themselves; ``unlink`` is for
nodes run with ``--peer-timeout 0``, or to drop a node before its timeout. Requests carry
the job's secret from the config. Exit codes: 0 done, 1 a node unreachable (status) or the
request refused (unlink), 2 bad usage or config.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from netagg.jobconfig import ConfigError, WorkerConfig, endpoint_arg, resolve
from netagg.mlfabric.protocol import Connection, Refused, Unreachable


def node_status(endpoint: tuple[str, int], config: WorkerConfig, timeout: float = 3.0) -> dict[str, Any]:
    """One node's place in the chain (``chain_state``), or ``{"reachable": False, "error": ...}``.

    Keys: ``endpoint``, ``reachable``, ``role``, ``version``, ``seq``, ``caught_up``, ``halted``,
    ``upstream`` (upstream nodes connected), ``superseded``, ``successor`` ([host, port] or None),
    ``lag``, ``last_error`` (of the replication to the successor), ``successors_lost``, ``bypasses``,
    ``unlinks``, ``rejoins``, ``peer_timeout``.
    """
    try:
        conn = Connection(endpoint, timeout=timeout, secret=config.secret)
    except Unreachable as err:
        return {"endpoint": list(endpoint), "reachable": False, "error": str(err)}
    try:
        state, _ = conn.call({"op": "chain_state", "job_id": config.job_id})
    except (Unreachable, Refused) as err:
        return {"endpoint": list(endpoint), "reachable": False, "error": str(err)}
    finally:
        conn.close()
    state.pop("ok", None)
    return {"endpoint": list(endpoint), "reachable": True, **state}


@dataclass
class ChainView:
    """The live chain as its nodes describe it: from the primary, following each node's successor."""

    #: The primary (None: no node that answers is a primary, e.g. before the workers promote a replica).
    primary: tuple[str, int] | None = None
    #: The nodes from the primary on, as far as the walk got.
    order: list[tuple[str, int]] = field(default_factory=list)
    #: The last node, when the walk ended cleanly at a caught-up node without successor: where to join.
    tail: tuple[str, int] | None = None
    #: Why there is no tail ("" when there is one).
    problem: str = ""


def live_chain(nodes: Mapping[tuple[str, int], dict[str, Any]]) -> ChainView:
    """The chain formed by ``nodes`` (endpoint -> :func:`node_status`): primary, order, tail or the problem."""
    primaries = [e for e, n in nodes.items() if n["reachable"] and n["role"] == "primary" and not n["superseded"]]
    if len(primaries) != 1:
        return ChainView(problem="no node is the primary (a replica takes over when a worker promotes it)"
                         if not primaries else f"{len(primaries)} nodes say they are the primary: {primaries}")
    view = ChainView(primary=primaries[0], order=[primaries[0]])
    while (successor := nodes[view.order[-1]]["successor"]) is not None:
        successor, where = (str(successor[0]), int(successor[1])), _where(view.order[-1])
        node = nodes.get(successor)
        if successor in view.order or node is None or not node["reachable"]:
            view.problem = (f"{where} forwards to {_where(successor)}, " + (
                "already in the chain (a loop)" if successor in view.order else
                "not an endpoint of the job's chain" if node is None else "which does not answer"))
            return view
        view.order.append(successor)
    if not nodes[view.order[-1]]["caught_up"]:
        view.problem = f"the tail {_where(view.order[-1])} has not caught up yet"
        return view
    view.tail = view.order[-1]
    return view


def _where(endpoint: tuple[str, int]) -> str:
    return f"{endpoint[0]}:{endpoint[1]}"


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
            if not args.json:
                view = live_chain({tuple(n["endpoint"]): n for n in nodes})
                walk = " -> ".join(_where(e) for e in view.order)
                print(f"chain: {walk or '-'}" + (f" ({view.problem})" if view.problem else ""))
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
