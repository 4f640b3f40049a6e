"""One MLfabric PS chain node's chain side: its successor, promote, chain_hello, replicate, state
transfer (snapshot), unlink, join, and keeping itself in the chain (``peer_timeout``).

:class:`ChainNode` is mixed into :class:`~netagg.mlfabric.async_server.FabricServer`; the chain's
rules are in docs/mlfabric.md, "Replication".
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter, deque
from typing import Any

import numpy as np

from netagg.framed_server import Frame, Handler, Reply
from netagg.jobconfig import ConfigError, resolve
from netagg.mlfabric import chainctl
from netagg.mlfabric.model_updates import APPLIED, LogEntry
from netagg.mlfabric.outcome_window import OutcomeWindow, update_step
from netagg.mlfabric.protocol import Connection, FabricError, from_blob
from netagg.mlfabric.replication import ANOTHER_UPSTREAM, PRIMARY_REFUSAL, ChainForwarder, Endpoint

log = logging.getLogger(__name__)

#: How often a replica checks whether it has an upstream; the backoff of its tries to rejoin (first, most).
_KEEPER_POLL = 0.1
_REJOIN_BACKOFF = (0.2, 5.0)


class ChainNode:
    """The chain side of a :class:`~netagg.mlfabric.async_server.FabricServer` (a mixin)."""

    def _chain_handlers(self, state: dict[str, bool]) -> dict[str, Handler]:
        """The chain ops for one connection; ``state["upstream"]``: the connection said ``chain_hello``."""

        def from_upstream(op: str, handler: Handler) -> Handler:
            def handle(frame: Frame) -> Reply:
                if not state["upstream"]:
                    raise ValueError(f"{op} without chain_hello on this connection")
                return handler(frame)
            return handle

        return {"chain_hello": lambda frame: self._op_chain_hello(frame, state),
                "replicate": from_upstream("replicate", self._op_replicate),
                "snapshot": from_upstream("snapshot", self._op_snapshot), "chain_state": self._op_chain_state,
                "promote": self._op_promote, "join": self._op_join, "unlink": self._op_unlink}

    def _forwarder(self, successor: tuple[str, int], head: int) -> ChainForwarder:
        return ChainForwarder(successor, self.job_id, head=head, max_lag=self.max_lag, timeout=self.ack_timeout,
                              snapshot_source=self._snapshot, secret=self.config.secret,
                              peer_timeout=self.peer_timeout, own=self.own, on_lost=self._successor_lost)

    def _successor_lost(self, dead: Endpoint, new: Endpoint | None) -> None:
        """The forwarder removed a dead successor (its thread; see ChainForwarder's ``on_lost``)."""
        with self._chain_lock:
            self.stats.successors_lost += 1
            self.stats.bypasses += new is not None
            self.stats.last_error = f"successor {dead[0]}:{dead[1]} declared dead" + (
                f", bypassed to {new[0]}:{new[1]}" if new is not None else ", this node is the tail")

    def _live_forwarder(self) -> ChainForwarder | None:
        """The forwarder to this node's successor; None if there is none (or it detached: this node is the tail)."""
        forwarder = self.forwarder
        return None if forwarder is None or forwarder.detached else forwarder

    def _successor(self) -> list[Any] | None:
        """The successor as [host, port] (in answers upstream: the node to bypass to if this one dies)."""
        forwarder = self._live_forwarder()
        return list(forwarder.successor) if forwarder is not None else None

    # -- chain ops -----------------------------------------------------------------
    def _op_promote(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        """A worker asks this node to take over as primary (see :meth:`_promotable` for the rules)."""
        with self._cond:
            if self.role == "primary":
                return {"ok": True, "role": self.role, "promoted": False}, b""
            self._promotable()
            seq = self.seq
        # Ask the other chain nodes (outside the lock: network round trips) ...
        blocker = self._promotion_blocker(seq)
        with self._cond:
            if self.role == "primary":  # another worker's promote got here first
                return {"ok": True, "role": self.role, "promoted": False}, b""
            if blocker:
                self.stats.promotions_refused += 1
                raise ValueError(f"not promoted: {blocker}")
            self._promotable()  # ... and check again: an upstream may have connected meanwhile
            if self.seq != seq:
                raise ValueError("not promoted: this replica applied records while it was asking the chain")
            self.role = "primary"
            self.started_at = self.started_at or time.monotonic()
            log.warning("promoted to primary at version %d (record %d)", self.version, self.seq)
            self._cond.notify_all()
        return {"ok": True, "role": self.role, "promoted": True}, b""

    def _promotable(self) -> None:
        """ValueError unless this replica may take over, as far as it knows itself (holding the lock)."""
        if self._upstream > 0:
            raise ValueError("not promoted: the primary is still connected to this replica")
        if not self._caught_up:
            raise ValueError("not promoted: this replica has not caught up with the chain (it restarted empty or "
                             "joined and its state transfer has not arrived)")

    def _promotion_blocker(self, seq: int) -> str:
        """Why another chain node, not this one, is or should be the primary ("" if none that answers is).

        Every other configured chain node that answers is asked for its state: one that is a primary (and
        not superseded) blocks the promotion; so does another candidate — a caught-up replica without
        upstream, like this one — that is further along: more records, or as many and an earlier place in
        the configured chain. So of two candidates asked at once only one accepts (their records do not
        change: neither has an upstream), and the one accepting has every record the others have.
        """
        mine = (seq, -self._chain_index(self.own))
        for endpoint in self.chain:
            if endpoint in self.own:
                continue
            node = chainctl.node_status(endpoint, self.config, timeout=self.probe_timeout)
            if not node["reachable"]:
                continue
            where = f"{endpoint[0]}:{endpoint[1]}"
            if node["role"] == "primary" and not node.get("superseded"):
                return f"{where} is the primary (this replica is not in its chain any more: it rejoins as a tail)"
            if (node["role"] == "replica" and node["caught_up"] and not node.get("upstream")
                    and (node["seq"], -self._chain_index({endpoint})) > mine):
                return (f"{where} has no upstream either and is further along (record {node['seq']}, this "
                        f"replica {seq}): it takes over")
        return ""

    def _chain_index(self, endpoints: frozenset[Endpoint] | set[Endpoint]) -> int:
        return next((i for i, e in enumerate(self.chain) if e in endpoints), len(self.chain))

    def _op_chain_hello(self, frame: Frame, state: dict[str, bool]) -> tuple[dict[str, Any], bytes]:
        head = frame.header.get("head")
        with self._cond:
            if self.role == "primary":
                raise ValueError(PRIMARY_REFUSAL)
            if not state["upstream"]:
                if self._upstream > 0:  # a chain has one predecessor per node (the other one reconnects later)
                    raise ValueError(ANOTHER_UPSTREAM)
                state["upstream"] = True
                self._upstream += 1
            if head == self.seq:  # level with the upstream: nothing it had is missing here
                self._caught_up = True
            return {"ok": True, "seq": self.seq, "successor": self._successor()}, b""

    def _op_replicate(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        seq, kind = int(header["seq"]), header.get("kind")
        with self._cond:
            if self.role == "primary":
                raise ValueError("this node was promoted; it takes no more replication records")
            if seq <= self.seq:  # a resend after a reconnect
                return {"ok": True, "seq": self.seq, "successor": self._successor()}, b""
            if seq != self.seq + 1:
                raise ValueError(f"record {seq} after {self.seq}: a record is missing")
            if kind == "init":
                values = from_blob(frame.blob)
                committed = self._commit({"kind": "init"}, frame.blob, lambda: self._apply_init(values))
            elif kind == "update":
                if self.model is None:
                    raise ValueError("update record before the init record")
                delta = from_blob(frame.blob, self.model.size)
                parts = [(str(p[0]), int(p[1]), int(p[2])) for p in header["parts"]]
                delays = [int(d) for d in header["delays"]]
                for update_id, rank, _ in parts:
                    update_step(update_id, rank)
                switch_next = int(header.get("switch_next", 0))
                meta = {"kind": "update", "parts": [list(p) for p in parts], "delays": delays}
                if switch_next:
                    meta["switch_next"] = switch_next
                    self.switch_floor = max(self.switch_floor, switch_next)
                committed = self._commit(meta, bytes(frame.blob), lambda: self._apply_delta(parts, delays, delta))
                self._remember(parts, {"outcome": APPLIED, "delays": delays, "version": self.version,
                                       "seq": committed})
            elif kind == "halt":
                committed = self._commit({"kind": "halt"}, b"", self._apply_halt)
            else:
                raise ValueError(f"unknown record kind {kind!r}")
            self._caught_up = True  # the record follows on what this node had: it is in sequence
        self._await_safe(committed)
        return {"ok": True, "seq": committed, "successor": self._successor()}, b""

    # -- state transfer and joining the chain ----------------------------------------
    def _snapshot(self, wait: float) -> tuple[dict[str, Any], bytes] | None:
        """This node's state after record ``seq`` (the forwarder's ``snapshot_source``): None if the lock is busy."""
        if not (self._cond.acquire(timeout=wait) if wait > 0 else self._cond.acquire(blocking=False)):
            return None
        try:
            model = self.model.tobytes() if self.model is not None else b""
            header = {"seq": self.seq, "version": self.version, "halted": self.halted,
                      "initialized": self.model is not None, "started": self.started_at is not None,
                      "model_bytes": len(model), "switch_floor": max(self.switch_floor, self._switch_next())}
            state = {"outcomes": self._outcomes.to_json(),
                     "log": [[e.seq, e.update_id, e.rank, e.version, e.delay] for e in self.log],
                     "counters": {"applied": self.stats.applied, "applies": self.stats.applies,
                                  "aggregated_applies": self.stats.aggregated_applies,
                                  "applied_by_rank": {str(k): v for k, v in self.stats.applied_by_rank.items()},
                                  "delay_histogram": {str(k): v for k, v in self.delay_histogram.items()},
                                  "max_delay": self.max_delay}}
        finally:
            self._cond.release()
        return header, model + json.dumps(state, separators=(",", ":")).encode()

    def _op_snapshot(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        """Install a state transfer from upstream atomically; acknowledged once down the chain too."""
        header, blob = frame.header, frame.blob
        seq, version, model_bytes = int(header["seq"]), int(header["version"]), int(header["model_bytes"])
        if seq < 0 or version < 0 or not 0 <= model_bytes <= len(blob):
            raise ValueError(f"snapshot: bad seq {seq}, version {version} or model size {model_bytes}")
        model = None
        if header.get("initialized"):
            model = from_blob(blob[:model_bytes])
            if model.size == 0 or not np.isfinite(model).all():
                raise ValueError("snapshot: the model must be non-empty and finite")
        state = json.loads(bytes(blob[model_bytes:]))
        if not isinstance(state, dict):
            raise ValueError("snapshot: the state is not a JSON object")
        outcomes = OutcomeWindow.from_json(self._outcomes.size, state["outcomes"])
        entries = deque((LogEntry(int(s), str(u), int(r), int(v), int(d)) for s, u, r, v, d in state["log"]),
                        maxlen=self.log.maxlen)
        counters = state["counters"]
        max_delay = None if counters["max_delay"] is None else int(counters["max_delay"])
        histogram = Counter({int(k): int(n) for k, n in counters["delay_histogram"].items()})
        by_rank = Counter({int(k): int(n) for k, n in counters["applied_by_rank"].items()})
        with self._cond:
            if self.role == "primary":
                raise ValueError("this node was promoted; it takes no state transfer")
            if seq < self.seq:
                raise ValueError(f"snapshot at record {seq} is older than this node's record {self.seq}")
            self.model, self.version, self.seq, self.halted = model, version, seq, bool(header.get("halted"))
            self.switch_floor = max(self.switch_floor, int(header.get("switch_floor", 0)))
            if header.get("started") and self.started_at is None:
                self.started_at = time.monotonic()
            self._outcomes, self.log = outcomes, entries
            self.delay_histogram, self.max_delay = histogram, max_delay
            self.stats.applied, self.stats.applied_by_rank = int(counters["applied"]), by_rank
            self.stats.applies = int(counters["applies"])
            self.stats.aggregated_applies = int(counters["aggregated_applies"])
            self.stats.snapshots_installed += 1
            self._caught_up = True
            if (forwarder := self._live_forwarder()) is not None:  # its successor must now reach the same state
                forwarder.reset(seq)
            self._cond.notify_all()
        log.warning("installed a state transfer: record %d, version %d", seq, version)
        self._await_safe(seq)
        return {"ok": True, "seq": seq, "successor": self._successor()}, b""

    def _op_unlink(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        """An operator removes this node's (dead) successor from the chain: the chain gets shorter.

        Replication to that node stops; updates applied from now on are acknowledged without it
        (a weaker guarantee, chosen by the operator, instead of a job that stands still). Records
        applied before and not yet acknowledged count as acknowledged by the shorter chain (pushes
        still waiting for them are answered; those that already failed are recognised by id when
        the workers push them again). A fresh node can later ``join`` this node, now the tail.
        With ``peer_timeout`` the node does this by itself (ChainForwarder's failure detection).
        """
        successor = _endpoint_field(frame.header, "successor", "unlink")
        with self._cond:
            forwarder = self._live_forwarder()
            if forwarder is None:
                raise ValueError("unlink: this node has no successor (it is the tail of the chain)")
            if forwarder.successor != successor:
                raise ValueError(f"unlink: this node's successor is {forwarder.successor[0]}:"
                                 f"{forwarder.successor[1]}, not {successor[0]}:{successor[1]}")
        forwarder.detach()  # outside the lock: it wakes pushes waiting (holding it) for room or acknowledgements
        forwarder.stop()
        with self._cond:
            if self.forwarder is forwarder:
                self.forwarder = None
                self.stats.unlinks += 1
            self._cond.notify_all()
        log.warning("unlinked successor %s:%d at record %d: the chain continues without it", *successor, self.seq)
        return {"ok": True, "role": self.role, "seq": self.seq, "unlinked": list(successor)}, b""

    def _op_join(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        """A (restarted, empty) node asks to become this node's successor: the chain's new tail."""
        successor = _endpoint_field(frame.header, "endpoint", "join")
        if successor not in self.chain_members:
            # Anyone who can reach the PS could otherwise have the model streamed to an address of its
            # choosing, or stall the job behind a successor that never acknowledges.
            with self._cond:
                self.stats.bad_requests += 1
            raise ValueError(f"join refused: {successor[0]}:{successor[1]} is not an endpoint of this job's PS "
                             f"chain (ps and replicas in the job's config)")
        with self._cond:
            if self._stop.is_set():
                raise ValueError("join: this node is stopping")
            if successor in self.own:
                raise ValueError(f"join: {successor[0]}:{successor[1]} is this node's own endpoint")
            if (forwarder := self._live_forwarder()) is not None:
                if forwarder.successor == successor:  # the successor restarted: its forwarder catches it up
                    return {"ok": True, "role": self.role, "seq": self.seq, "rejoined": True}, b""
                raise ValueError(f"join refused: this node is not the tail of the chain (it forwards to "
                                 f"{forwarder.successor[0]}:{forwarder.successor[1]}); join the tail")
            if not self._caught_up:
                raise ValueError("join refused: this node has not caught up with the chain itself yet (its state "
                                 "transfer has not arrived); join it once it has")
            if self.forwarder is not None:  # detached from a dead successor: its thread has ended
                self.forwarder.stop()
            self.forwarder = self._forwarder(successor, self.seq).start()
            seq = self.seq
        log.warning("%s:%d joined the chain as this node's successor at record %d", *successor, seq)
        return {"ok": True, "role": self.role, "seq": seq, "rejoined": False}, b""

    # -- keeping this node in the chain by itself (peer_timeout > 0) -------------------
    def _keep_in_chain(self) -> None:
        """A replica without upstream for ``peer_timeout`` (at once if it started joining) joins the tail.

        A replica whose upstream is gone either is the next primary (the workers promote it) or was
        left out of the chain (its predecessor died and the node before that detached), or it just
        restarted. Every try asks the chain (:meth:`_rejoin`); while the answer is "wait" (no primary
        yet, the chain still being repaired, a node forwarding to this one) it tries again with
        backoff, 0.2 s doubling up to 5 s. A primary, or a replica with an upstream, does nothing.
        """
        alone_since = -math.inf if self._joining else None
        backoff, next_try, waiting = _REJOIN_BACKOFF[0], 0.0, ""
        while not self._stop.wait(_KEEPER_POLL):
            settled = self.role == "primary" or self._upstream > 0  # no lock: an apply may hold it, waiting
            now = time.monotonic()
            if settled:
                alone_since, backoff, waiting = None, _REJOIN_BACKOFF[0], ""
                continue
            alone_since = now if alone_since is None else alone_since
            if now - alone_since < self.peer_timeout or now < next_try:
                continue
            try:
                why = self._rejoin()
            except (FabricError, ConfigError, KeyError, TypeError, ValueError) as err:
                why = f"{type(err).__name__}: {err}"
            if not why:  # joined: the tail's forwarder connects and brings this node up to date
                backoff, next_try, waiting = _REJOIN_BACKOFF[0], now + self.peer_timeout, ""
                continue
            if why != waiting:  # once per distinct reason, not once per try
                log.warning("not in the chain yet: %s; asking again (backoff %.1f s to %.0f s)", why,
                            _REJOIN_BACKOFF[0], _REJOIN_BACKOFF[1])
            waiting, next_try = why, time.monotonic() + backoff
            backoff = min(backoff * 2, _REJOIN_BACKOFF[1])

    def _chain_state(self) -> dict[str, Any]:
        """This node's place in the chain, read without the lock (see :meth:`_op_chain_state`)."""
        forwarder, live = self.forwarder, self._live_forwarder()
        return {"role": self.role, "version": self.version, "seq": self.seq, "caught_up": self._caught_up,
                "halted": self.halted, "upstream": self._upstream,
                "superseded": forwarder is not None and forwarder.superseded,
                "successor": list(live.successor) if live is not None else None,
                "lag": live.lag if live is not None else None,
                "last_error": live.last_error if live is not None else "",
                "successors_lost": self.stats.successors_lost, "bypasses": self.stats.bypasses,
                "unlinks": self.stats.unlinks, "rejoins": self.stats.rejoins, "peer_timeout": self.peer_timeout}

    def _op_chain_state(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        """Role, record number, upstream, successor, ...: what chain nodes ask each other before a promotion
        or a rejoin (and ``chainctl status``). Answered without the apply lock, which an apply holds while it
        waits for a slow or dead successor: a live primary must never look dead to a node deciding to take
        over. The fields are each current but not read at one instant."""
        return {"ok": True, **self._chain_state()}, b""

    def _rejoin(self) -> str:
        """One try at joining the live chain's tail: "" if joined, else why not (yet)."""
        nodes = {e: chainctl.node_status(e, self.config, timeout=self.probe_timeout)
                 for e in self.chain if e not in self.own}
        me = resolve(self.endpoint)
        with self._cond:
            if self.role == "primary" or self._upstream > 0:
                return ""
            nodes[me] = {"endpoint": list(me), "reachable": True, **self._chain_state()}
        view = chainctl.live_chain(nodes)
        if me in view.order:  # its predecessor still forwards to this endpoint: it reconnects and catches it up
            before = view.order[view.order.index(me) - 1]
            return f"{before[0]}:{before[1]} forwards to this node (it reconnects)"
        if view.tail is None:
            return view.problem
        with self._cond:
            if self.role == "primary" or self._upstream > 0:
                return ""
            # Left out of the live chain: records acknowledged since may be missing here. Only the tail's
            # forwarder (a level chain_hello, a record in sequence or a snapshot) makes it caught up again.
            self._caught_up = False
            seq = self.seq
        response = self.join(view.tail, timeout=self.probe_timeout * 5)
        with self._chain_lock:
            self.stats.rejoins += 1
        log.warning("joined the chain as the successor of its tail %s:%d (the tail at record %d, this node at %d; "
                    "chain %s)", *view.tail, int(response.get("seq", -1)), seq,
                    " -> ".join(f"{h}:{p}" for h, p in view.order))
        return ""

    def join(self, target: tuple[str, int], timeout: float = 10.0) -> dict[str, Any]:
        """Ask ``target`` (the chain's tail) to take this node as its successor; raises Refused or Unreachable.

        This node joins under its endpoint in the config (``ps``, or ``replicas[i]`` with ``replica=i``),
        the address workers fail over to; ``target`` then brings it up to date by a state transfer.
        """
        if self.role == "primary":
            raise ValueError("a primary does not join a chain (start the node with joining=True)")
        conn = Connection(target, timeout=timeout, secret=self.config.secret)
        try:
            response, _ = conn.call({"op": "join", "job_id": self.job_id, "endpoint": list(resolve(self.endpoint))})
        finally:
            conn.close()
        return response


def _endpoint_field(header: dict[str, Any], key: str, op: str) -> tuple[str, int]:
    """``header[key]`` as ``(host, port)``: a JSON ``[host, port]`` with a port in 1..65535; ValueError otherwise."""
    endpoint = header.get(key)
    if not (isinstance(endpoint, list) and len(endpoint) == 2 and isinstance(endpoint[0], str)
            and isinstance(endpoint[1], int) and not isinstance(endpoint[1], bool) and 0 < endpoint[1] < 65536):
        raise ValueError(f"{op}: {key}: expected [host, port], got {endpoint!r}")
    return endpoint[0], endpoint[1]
