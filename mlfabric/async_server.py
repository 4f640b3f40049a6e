"""The MLfabric parameter server: ``python -m netagg.mlfabric.async_server --config rank0.yaml``.

One process per node of the job's PS chain (the primary on the config's ``ps``
endpoint, replica ``i`` on ``replicas[i]`` with ``--replica i``), TCP with the framing of
:mod:`netagg.mlfabric.protocol`. It holds one flat float32 model and its **version**:
the number of worker gradients applied so far.

* ``async`` jobs: each push carries the version its gradient was computed on. The PS
  applies pushes in the order it takes them (arrival order; with ``schedule: mlfabric``
  that is the order the scheduler granted) and drops any whose **delay** — the version
  at apply time minus the version it was computed on — exceeds ``delay_bound``: dropped
  updates are counted per rank and reported to the sender. An aggregate (several
  workers' gradients summed by an idle worker) is applied, or dropped, as a whole.
  SGD: ``w -= lr * g`` per gradient.
* ``sync`` jobs: a push waits until every worker pushed for the same version, then the
  mean is applied once (``w -= lr * mean``; the version grows by the number of workers).
* every applied update is logged (update id, rank, version, delay; a ring of the last
  ``log_size``, with exact counters and a delay histogram) and, with replicas, forwarded
  down the chain (:mod:`netagg.mlfabric.replication`) before the push is acknowledged.
  A replica serves workers only once promoted (``promote``), which it accepts only while
  no primary is connected to it and it has caught up with the chain.
* a node that restarted empty, or joins the chain as its new tail (``--join HOST:PORT``,
  the ``join`` op), is brought up to date by a state transfer (``snapshot``) from its
  predecessor, then follows the record stream.
* with a failure timeout (``--peer-timeout``, default 3 s) the chain keeps itself: a
  successor without contact for that long is removed (bypassed to its own successor, or cut
  off), and a node started while the job's chain is running, or a replica left without
  upstream, finds the live chain's tail and joins it (docs/mlfabric.md, "Replication").
* update ids are ``rank:step``; the outcomes of each rank's last ``outcome_window`` steps are
  kept to answer a repeated push (``duplicate: true``); a push of an older step is refused
  (``expired_ids``), never applied twice. Memory stays bounded however long the job runs.

Every request must carry the job's shared secret (``WorkerConfig.secret``, when the job has
one): a request without it is refused before anything else is looked at (``bad_secret``).
Malformed frames close the connection (counted); bad requests (unknown rank, wrong
job, wrong secret, wrong size, NaN) get ``ok: false`` with the reason (counted); the PS never
blocks a request longer than its timeouts.
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import math
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from netagg import jobsecret
from netagg.hoststack.packets import resolve
from netagg.jobconfig import ConfigError, WorkerConfig, endpoint_arg
from netagg.mlfabric import chainctl
from netagg.mlfabric.distribution import ModelSender, rate_of
from netagg.mlfabric.grants import STALE, GrantService
from netagg.mlfabric.protocol import (
    Connection,
    FabricError,
    Frame,
    accept_loop,
    from_blob,
    listen,
)
from netagg.mlfabric.replication import (
    ANOTHER_UPSTREAM,
    PRIMARY_REFUSAL,
    ChainForwarder,
    Endpoint,
    ReplicationStalled,
)
from netagg.mlfabric.scheduler import AGGREGATE, Scheduler, TransferRequest
from netagg.shutdown import stop_event

log = logging.getLogger(__name__)

APPLIED, DROPPED = "applied", "dropped"
#: How often a replica checks whether it has an upstream; the backoff of its tries to rejoin (first, most).
_KEEPER_POLL = 0.1
_REJOIN_BACKOFF = (0.2, 5.0)
_WORKER_OPS = ("hello", "init", "pull", "push", "request", "agg_grant", "outcome", "model_blocks", "halt")


@dataclass
class ServerStats:
    """What the PS did (``stats`` op)."""

    requests: int = 0
    bad_requests: int = 0
    malformed_frames: int = 0
    unknown_workers: int = 0
    #: Requests refused for a wrong or missing job secret (also counted in ``bad_requests``).
    bad_secret: int = 0
    pushes: int = 0
    #: Bytes of models served by pulls (out of the PS) and of updates pushed (into it).
    pulls: int = 0
    pull_bytes: int = 0
    push_bytes: int = 0
    duplicates: int = 0
    #: Gradients applied / dropped (an aggregate of k counts k).
    applied: int = 0
    dropped: int = 0
    #: Model updates (one per push, aggregate or sync round) and how many were aggregates.
    applies: int = 0
    aggregated_applies: int = 0
    partial_rounds: int = 0
    replication_stalls: int = 0
    #: Successors an operator removed from the chain (``unlink``).
    unlinks: int = 0
    #: Successors this node declared dead (no contact for ``peer_timeout``) and removed from the chain by
    #: itself: ``bypasses`` of them by forwarding to the dead node's successor, the others by becoming the tail.
    successors_lost: int = 0
    bypasses: int = 0
    #: Times this node joined a tail by itself (restarted, or left out of the chain while alive).
    rejoins: int = 0
    #: ``promote`` requests refused because another chain node is the primary or is further along.
    promotions_refused: int = 0
    #: Pushes refused because an update id was older than its rank's outcome window.
    expired_ids: int = 0
    #: State transfers this node installed (it restarted empty or joined the chain).
    snapshots_installed: int = 0
    applied_by_rank: Counter = field(default_factory=Counter)
    dropped_by_rank: Counter = field(default_factory=Counter)
    last_error: str = ""


@dataclass(frozen=True)
class LogEntry:
    """One applied gradient: its update id, sender rank, the version it was computed on, its delay."""

    seq: int
    update_id: str
    rank: int
    version: int
    delay: int


def update_step(update_id: str, rank: int) -> int:
    """The step of update id ``rank:step``; ValueError if the id is not that rank's."""
    prefix, sep, step = update_id.partition(":")
    if not sep or prefix != str(rank) or not (step.isascii() and step.isdigit()):
        raise ValueError(f"update id {update_id!r}: expected '{rank}:<step>' (the sender's rank, a step >= 0)")
    return int(step)


class OutcomeWindow:
    """The outcomes of each rank's ``size`` most recent steps, for answering a repeated push.

    A rank's window is the steps ``newest - size + 1 .. newest`` (``newest``: the highest step of
    that rank ever recorded); outcomes of older steps are forgotten, and such a step is
    :meth:`expired`: a push of it cannot be told from a new one and must be refused.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("the outcome window must hold at least 1 step per rank")
        self.size = size
        self.newest: dict[int, int] = {}
        self._outcomes: dict[int, dict[int, dict[str, Any]]] = {}
        self._steps: dict[int, list[int]] = {}  # a min-heap of each rank's kept steps

    def __len__(self) -> int:
        return sum(len(o) for o in self._outcomes.values())

    def get(self, rank: int, step: int) -> dict[str, Any] | None:
        return self._outcomes.get(rank, {}).get(step)

    def expired(self, rank: int, step: int) -> bool:
        return step <= self.newest.get(rank, -1) - self.size

    def put(self, rank: int, step: int, outcome: dict[str, Any]) -> None:
        """Record a step's outcome (ignored if it is already outside the window) and forget what falls out."""
        if self.expired(rank, step):
            return
        outcomes = self._outcomes.setdefault(rank, {})
        steps = self._steps.setdefault(rank, [])
        if step not in outcomes:
            heapq.heappush(steps, step)
        outcomes[step] = outcome
        self.newest[rank] = newest = max(step, self.newest.get(rank, step))
        while steps and steps[0] <= newest - self.size:
            del outcomes[heapq.heappop(steps)]

    def to_json(self) -> dict[str, Any]:
        """The window as JSON (for a state transfer)."""
        return {str(rank): {"newest": newest, "outcomes": {str(s): o for s, o in self._outcomes.get(rank, {}).items()}}
                for rank, newest in self.newest.items()}

    @classmethod
    def from_json(cls, size: int, data: dict[str, Any]) -> OutcomeWindow:
        """A window of ``size`` steps per rank filled from :meth:`to_json`'s output; ValueError if malformed."""
        window = cls(size)
        try:
            for rank_text, entry in data.items():
                rank = int(rank_text)
                window.newest[rank] = int(entry["newest"])
                for step_text, outcome in entry["outcomes"].items():
                    if not isinstance(outcome, dict):
                        raise ValueError(f"outcome of {rank}:{step_text} is not an object")
                    window.put(rank, int(step_text), outcome)
        except (AttributeError, KeyError, TypeError) as err:
            raise ValueError(f"outcome window: {type(err).__name__}: {err}") from None
        return window


class FabricServer:
    """One node of a job's MLfabric PS chain (see the module docstring)."""

    def __init__(self, config: WorkerConfig, *, lr: float = 0.1, replica: int | None = None,
                 bind: tuple[str, int] | None = None, max_lag: int = 1, ack_timeout: float = 10.0,
                 sync_timeout: float = 30.0, gate_timeout: float = 30.0, pull_timeout: float = 30.0,
                 batch_window: float = 0.01, default_bandwidth: float = 1.25e6, scheduler: Scheduler | None = None,
                 frame_timeout: float = 30.0, outcome_window: int = 1024, log_size: int = 100_000,
                 joining: bool = False, chain_members: Sequence[tuple[str, int]] | None = None,
                 distribution: ModelSender | None = None, gang: bool | None = None,
                 peer_timeout: float = 0.0, probe_timeout: float = 1.0) -> None:
        """``gang``: plan gang rounds (scheduler item 6); default: when this node sends versions (``distribution``).

        ``peer_timeout`` > 0 makes the chain keep itself (docs/mlfabric.md, "Replication"): a successor
        without contact for that long is removed, and a replica without upstream for that long (at once if
        ``joining``) joins the live chain's tail by itself, retrying with backoff. 0: an operator does both.
        ``probe_timeout``: how long to wait for each chain node asked for its status (promote, rejoin).
        """
        if config.ps is None:
            raise ConfigError("ps: an MLfabric job needs the parameter server's endpoint")
        if replica is not None and not 0 <= replica < len(config.replicas):
            raise ConfigError(f"replica {replica}: the job has {len(config.replicas)} replica(s)")
        self.config = config
        self.job_id = config.job_id
        self.num_workers = config.num_workers
        #: Sends each new version through the switch (mlfabric/distribution.py) while this node is primary.
        self.distribution = distribution
        self.update_mode = config.update_mode
        self.delay_bound = config.delay_bound
        self.lr = np.float32(lr)
        #: A joining node starts as a replica without successor and waits for a state transfer.
        self.role = "primary" if replica is None and not joining else "replica"
        self.replica_index = replica
        chain = [config.ps, *config.replicas]
        #: The job's PS chain endpoints in configured order: the nodes asked before a promotion or a rejoin.
        self.chain: list[Endpoint] = [resolve(e) for e in chain] if chain_members is None else [
            (str(h), int(p)) for h, p in chain_members]
        #: Endpoints that may join this node as its successor: by default the job config's PS chain.
        self.chain_members = frozenset(self.chain)
        position = 0 if replica is None else replica + 1
        self.endpoint = chain[position]
        successor = chain[position + 1] if position + 1 < len(chain) and not joining else None
        self.max_lag = max_lag
        self.ack_timeout = ack_timeout
        self.sync_timeout = sync_timeout
        self.gate_timeout = gate_timeout
        self.pull_timeout = pull_timeout
        self.frame_timeout = frame_timeout
        if peer_timeout < 0 or probe_timeout <= 0:
            raise ValueError("peer_timeout must be >= 0 and probe_timeout > 0")
        if peer_timeout >= ack_timeout:
            # A node waits up to ack_timeout for its successor: pushes would fail before a dead node is
            # removed, and a predecessor would declare dead a node that only waits for its own dead successor.
            raise ValueError(f"peer_timeout ({peer_timeout} s) must be below ack_timeout ({ack_timeout} s)")
        self.peer_timeout = peer_timeout
        self.probe_timeout = probe_timeout
        self._joining = joining
        self.sock = listen(bind or resolve(self.endpoint))
        self.address: tuple[str, int] = self.sock.getsockname()
        #: This node's endpoints: the configured one (what others know it by) and the bound address.
        self.own: frozenset[Endpoint] = frozenset({resolve(self.endpoint), tuple(self.address)})
        #: Counters the forwarder's thread updates (it must not take ``_cond``: an apply may hold it, waiting).
        self._chain_lock = threading.Lock()
        self.forwarder = self._forwarder(resolve(successor), 0) if successor is not None else None
        self.grants: GrantService | None = None
        if config.schedule == "mlfabric":
            self.grants = GrantService(scheduler or Scheduler(self.delay_bound, default_bandwidth=default_bandwidth),
                                       lambda: self.version, batch_window=batch_window,
                                       switch_slots=config.slot_count if config.switch_aggregation else 0,
                                       switch_floor=lambda: self.switch_floor,
                                       # multicast versions: one switch group per batch serves every worker
                                       gang=distribution is not None if gang is None else gang)
        #: Past the subset rounds of the primary's switch groups, as of the last update it applied (replicated).
        self.switch_floor = 0
        self.model: np.ndarray | None = None
        self.version = 0
        self.seq = 0
        self.halted = False
        self.started_at: float | None = None
        if log_size < 0:
            raise ValueError("log_size must be >= 0")
        #: The most recent ``log_size`` applied gradients (the counters below count all of them).
        self.log: deque[LogEntry] = deque(maxlen=log_size)
        self.delay_histogram: Counter[int] = Counter()
        self.max_delay: int | None = None
        self.stats = ServerStats()
        self.workers: dict[int, dict[str, Any]] = {}
        self._outcomes = OutcomeWindow(outcome_window)
        self._round: dict[int, tuple[str, np.ndarray]] = {}
        self._round_version = 0
        self._upstream = 0
        #: Whether this node has all the state its upstream had when they met: a primary has; a replica once an
        #: upstream found it level (``chain_hello``), sent it a record in sequence, or a snapshot. Only a node that
        #: caught up may be promoted (a replica that restarted empty must not take over before its state transfer).
        self._caught_up = self.role == "primary"
        self._created = time.monotonic()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

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

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> FabricServer:
        if self.forwarder is not None:
            self.forwarder.start()
        thread = threading.Thread(target=accept_loop, args=(self.sock, self._session, self._stop, "mlfabric-ps"),
                                  kwargs={"frame_timeout": self.frame_timeout,
                                          "on_malformed": self._on_malformed, "on_error": self._on_error},
                                  name="mlfabric-accept", daemon=True)
        thread.start()
        self._threads.append(thread)
        if self.peer_timeout > 0:
            keeper = threading.Thread(target=self._keep_in_chain, name="mlfabric-rejoin", daemon=True)
            keeper.start()
            self._threads.append(keeper)
        return self

    def stop(self) -> None:
        with self._cond:
            self._stop.set()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads.clear()
        if self.forwarder is not None:
            self.forwarder.stop()
        if self.distribution is not None:
            self.distribution.close()
        self.sock.close()

    def __enter__(self) -> FabricServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- connections -------------------------------------------------------------
    def _session(self) -> tuple[Any, Any]:
        state = {"upstream": False}

        def handle(frame: Frame) -> tuple[dict[str, Any], bytes]:
            return self._dispatch(frame, state)

        def on_close() -> None:
            if state["upstream"]:
                with self._cond:
                    self._upstream -= 1
                    self._cond.notify_all()

        return handle, on_close

    def _on_malformed(self, message: str) -> None:
        with self._cond:
            self.stats.malformed_frames += 1
            self.stats.last_error = message

    def _on_error(self, message: str) -> None:
        with self._cond:
            self.stats.bad_requests += 1
            self.stats.last_error = message

    def _count_bad_secret(self) -> None:
        with self._cond:
            self.stats.bad_secret += 1

    def _dispatch(self, frame: Frame, state: dict[str, bool]) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        op = header.get("op")
        with self._chain_lock:  # not the apply lock: chain_state must answer while an apply holds that
            self.stats.requests += 1
        if header.get("job_id") != self.job_id:
            raise ValueError(f"request for job {header.get('job_id')!r}; this PS serves job {self.job_id}")
        jobsecret.require(self.config.secret, header, self._count_bad_secret)
        handlers = {"hello": self._op_hello, "init": self._op_init, "pull": self._op_pull, "push": self._op_push,
                    "request": self._op_request, "agg_grant": self._op_agg_grant, "outcome": self._op_outcome,
                    "model_blocks": self._op_model_blocks,
                    "halt": self._op_halt,
                    "stats": self._op_stats, "chain_state": self._op_chain_state,
                    "promote": self._op_promote, "join": self._op_join,
                    "unlink": self._op_unlink}
        if op == "chain_hello":
            return self._op_chain_hello(frame, state)
        if op in ("replicate", "snapshot"):
            if not state["upstream"]:
                raise ValueError(f"{op} without chain_hello on this connection")
            return self._op_replicate(frame) if op == "replicate" else self._op_snapshot(frame)
        handler = handlers.get(str(op))
        if handler is None:
            raise ValueError(f"unknown op {op!r}")
        if op in _WORKER_OPS:
            if self.role != "primary":
                raise ValueError("this node is a replica, not the primary (promote it after the primary failed)")
            if self.forwarder is not None and self.forwarder.superseded:
                raise ValueError("this node is not the primary: its successor took over as primary (this node was "
                                 "restarted in its old role; restart it with --join instead)")
            if op != "halt":
                self._rank(header)
        return handler(frame)

    def _rank(self, header: dict[str, Any]) -> int:
        rank = header.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.num_workers:
            with self._cond:
                self.stats.unknown_workers += 1
            raise ValueError(f"unknown worker: rank {rank!r} (job {self.job_id} has ranks 0..{self.num_workers - 1})")
        return rank

    # -- worker ops ----------------------------------------------------------------
    def _op_hello(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        rank = header["rank"]
        agg = header.get("agg")
        if agg is not None and not (isinstance(agg, list) and len(agg) == 2 and isinstance(agg[0], str)
                                    and isinstance(agg[1], int)):
            raise ValueError(f"agg: expected [host, port], got {agg!r}")
        with self._cond:
            info = self.workers.setdefault(rank, {"agg": None})
            if agg is not None:  # a worker's second connection (its aggregator's) does not unset it
                info["agg"] = agg
            if len(self.workers) == self.num_workers and self.started_at is None:
                self.started_at = time.monotonic()
            self._cond.notify_all()
        if self.grants is not None:
            self.grants.register(rank, can_aggregate=agg is not None)
        return {"ok": True, "role": self.role, "version": self.version, "num_workers": self.num_workers,
                "update_mode": self.update_mode, "delay_bound": self.delay_bound, "schedule": self.config.schedule,
                "initialized": self.model is not None}, b""

    def _op_init(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        values = from_blob(frame.blob)
        if values.size == 0 or not np.isfinite(values).all():
            raise ValueError("init: the model must be non-empty and finite")
        with self._cond:
            if self.model is not None:
                if values.size != self.model.size:
                    raise ValueError(f"init: {values.size} values, the model has {self.model.size}")
                return {"ok": True, "initialized_now": False, "version": self.version}, b""
            seq = self._commit({"kind": "init"}, values.tobytes(), lambda: self._apply_init(values))
        self._await_safe(seq)
        return {"ok": True, "initialized_now": True, "version": 0}, b""

    def _op_pull(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        min_version = int(header.get("min_version", 0))
        timeout = min(float(header.get("timeout", self.pull_timeout)), self.pull_timeout)
        with self._cond:
            self._cond.wait_for(lambda: self.halted or (
                self.model is not None and self.version >= min_version and self._gate_open()), timeout)
            if self.model is None:
                raise ValueError("pull: the model was never initialized")
            if not self.halted and self.version < min_version:
                raise ValueError(f"pull: version {min_version} not reached within {timeout:.1f} s "
                                 f"(at {self.version})")
            self.started_at = self.started_at or time.monotonic()  # waited long enough for the others
            response = {"ok": True, "version": self.version, "halted": self.halted, "size": int(self.model.size)}
            model, seq = self.model.tobytes(), self.seq
            self.stats.pulls += 1
            self.stats.pull_bytes += len(model)
        # Only replicated state is read: a gradient is never computed on a model a failover could lose.
        self._await_safe(seq)
        return response, model

    def _gate_open(self) -> bool:
        if self.started_at is None and time.monotonic() - self._created > self.gate_timeout:
            self.started_at = time.monotonic()
        return self.started_at is not None

    def _op_push(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        rank = header["rank"]
        parts = self._parts(header)
        with self._cond:
            self.stats.pushes += 1
            self.stats.push_bytes += len(frame.blob)
            if self.model is None:
                raise ValueError("push before the model was initialized")
            grad = from_blob(frame.blob, self.model.size)
        if not np.isfinite(grad).all():
            raise ValueError("push: the update has NaN or Inf values")
        if self.grants is not None:
            self.grants.observe(rank, len(frame.blob), frame.last_byte - frame.first_byte)
        ids = [p[0] for p in parts]
        try:
            if self.update_mode == "sync":
                outcome = self._push_sync(rank, parts, grad)
            else:
                outcome = self._push_async(parts, grad)
        finally:
            if self.grants is not None:
                self.grants.settled(ids)
        if outcome["outcome"] == APPLIED:
            self._await_safe(outcome["seq"])
        return {"ok": True, **outcome, "halted": self.halted}, b""

    def _parts(self, header: dict[str, Any]) -> list[tuple[str, int, int]]:
        """The gradients in a push: ``parts`` (an aggregate) or the sender's own update."""
        raw = header.get("parts")
        if raw is None:
            raw = [[header["update_id"], header["rank"], header["version"]]]
        if not isinstance(raw, list) or not raw:
            raise ValueError("parts: expected a non-empty list of [update_id, rank, version]")
        parts = []
        for part in raw:
            if not (isinstance(part, list) and len(part) == 3 and isinstance(part[0], str)
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in part[1:])):
                raise ValueError(f"parts: bad entry {part!r} (expected [update_id, rank, version])")
            update_id, rank, version = part
            if not 0 <= rank < self.num_workers:
                with self._cond:
                    self.stats.unknown_workers += 1
                raise ValueError(f"unknown worker: rank {rank} in parts")
            update_step(update_id, rank)
            if version < 0 or version > self.version:
                raise ValueError(f"update {update_id}: version {version} is not one this PS had "
                                 f"(0..{self.version})")
            parts.append((update_id, rank, version))
        if len({p[0] for p in parts}) != len(parts):
            raise ValueError("parts: an update id appears twice")
        return parts

    def _outcome(self, update_id: str, rank: int) -> dict[str, Any] | None:
        return self._outcomes.get(rank, update_step(update_id, rank))

    def _remember(self, parts: Iterable[tuple[str, int, int]], outcome: dict[str, Any]) -> None:
        for update_id, rank, _ in parts:
            self._outcomes.put(rank, update_step(update_id, rank), outcome)

    def _duplicate(self, parts: list[tuple[str, int, int]]) -> dict[str, Any] | None:
        """The stored outcome if every part was seen; None if none was; ValueError if some were or expired."""
        expired = [i for i, rank, _ in parts if self._outcomes.expired(rank, update_step(i, rank))]
        if expired:
            self.stats.expired_ids += 1
            raise ValueError(f"updates {expired} are older than the last {self._outcomes.size} steps of their "
                             f"rank whose outcomes this PS keeps: refused, whether or not they were applied")
        seen = [(i, o) for i, rank, _ in parts if (o := self._outcome(i, rank)) is not None]
        if not seen:
            return None
        if len(seen) != len(parts):
            ids = {i for i, _ in seen}
            raise ValueError(f"updates {sorted(ids)} were already pushed, "
                             f"{sorted(p[0] for p in parts if p[0] not in ids)} were not")
        self.stats.duplicates += 1
        return {**seen[0][1], "duplicate": True}

    def _push_async(self, parts: list[tuple[str, int, int]], grad: np.ndarray) -> dict[str, Any]:
        with self._cond:
            if (previous := self._duplicate(parts)) is not None:
                return previous
            delays = [self.version - version for _, _, version in parts]
            if self.delay_bound is not None and max(delays) > self.delay_bound:
                return self._drop(parts, delays, f"delay {max(delays)} > bound {self.delay_bound}")
            delta = (-self.lr * grad).astype(np.float32)
            return self._apply_update(parts, delays, delta)

    def _push_sync(self, rank: int, parts: list[tuple[str, int, int]], grad: np.ndarray) -> dict[str, Any]:
        if len(parts) != 1:
            raise ValueError("a sync job takes one worker's gradient per push, not aggregates")
        update_id, _, version = parts[0]
        deadline = time.monotonic() + self.sync_timeout
        with self._cond:
            if (previous := self._duplicate(parts)) is not None:
                return previous
            if version != self.version:
                return self._drop(parts, [self.version - version], f"sync round {version} is over "
                                  f"(the PS is at version {self.version})")
            if rank in self._round:
                raise ValueError(f"rank {rank} already pushed for version {version}")
            self._round[rank] = (update_id, grad)
            self._round_version = version
            if len(self._round) == self.num_workers:
                self._apply_round()
            while (outcome := self._outcome(update_id, rank)) is None:
                left = deadline - time.monotonic()
                if left <= 0:  # a worker is missing: apply what the round has
                    if self._round.get(rank, ("",))[0] != update_id:
                        raise ValueError(f"sync round {version}: {update_id} was not applied (the round failed)")
                    self.stats.partial_rounds += 1
                    self._apply_round()
                    continue
                self._cond.wait(min(left, 0.5))
            return outcome

    def _apply_round(self) -> None:
        """Apply the buffered sync round (holding the lock): ``w -= lr * mean``."""
        assert self.model is not None
        ranks = sorted(self._round)
        total = np.sum([self._round[r][1] for r in ranks], axis=0, dtype=np.float32)
        delta = (-(self.lr / np.float32(len(ranks))) * total).astype(np.float32)
        parts = [(self._round[r][0], r, self._round_version) for r in ranks]
        self._round = {}
        self._apply_update(parts, [self.version - self._round_version] * len(parts), delta)

    def _drop(self, parts: list[tuple[str, int, int]], delays: list[int], reason: str) -> dict[str, Any]:
        outcome = {"outcome": DROPPED, "reason": reason, "delays": delays, "version": self.version}
        self._remember(parts, outcome)
        for _, rank, _ in parts:
            self.stats.dropped += 1
            self.stats.dropped_by_rank[rank] += 1
        self._cond.notify_all()
        return outcome

    def _apply_update(self, parts: list[tuple[str, int, int]], delays: list[int],
                      delta: np.ndarray) -> dict[str, Any]:
        """Apply and log one update (holding the lock); replicated before anyone is told."""
        meta = {"kind": "update", "parts": [list(p) for p in parts], "delays": delays}
        if self.grants is not None and self.grants.switch_slots:
            meta["switch_next"] = self.grants.switch_next
        try:
            seq = self._commit(meta, delta.tobytes(), lambda: self._apply_delta(parts, delays, delta))
        except ReplicationStalled as err:
            self.stats.replication_stalls += 1
            raise ValueError(f"not applied: {err}") from None
        outcome = {"outcome": APPLIED, "delays": delays, "version": self.version, "seq": seq}
        if self.update_mode == "async":  # the step (w -= lr * g): a switch group's members apply its sum too
            outcome["lr"] = float(self.lr)
        self._remember(parts, outcome)
        self._publish(seq)
        self._cond.notify_all()
        return outcome

    def _publish(self, seq: int) -> None:
        """Hand the model just applied (record ``seq``) to the distribution sender: sent once replicated."""
        if self.distribution is not None and self.role == "primary" and self.model is not None:
            self.distribution.publish(self.version, self.model, lambda: self._await_safe(seq))

    def _commit(self, meta: dict[str, Any], blob: bytes, apply: Any) -> int:
        """Reserve room in the chain, apply, hand the record to the successor (holding the lock)."""
        forwarder = self._live_forwarder()
        if forwarder is not None:
            forwarder.reserve(self.ack_timeout)
        apply()
        self.seq += 1
        if forwarder is not None:
            forwarder.submit(self.seq, meta, blob)
        self._cond.notify_all()
        return self.seq

    def _switch_next(self) -> int:
        return self.grants.switch_next if self.grants is not None and self.grants.switch_slots else 0

    def _apply_init(self, values: np.ndarray) -> None:
        self.model = values.astype(np.float32).copy()
        self.version = 0

    def _apply_delta(self, parts: list[tuple[str, int, int]], delays: list[int], delta: np.ndarray) -> None:
        assert self.model is not None
        self.model += delta
        seq = self.seq + 1
        for (update_id, rank, version), delay in zip(parts, delays):
            self.log.append(LogEntry(seq, update_id, rank, version, delay))
            self.delay_histogram[delay] += 1
            self.max_delay = delay if self.max_delay is None else max(self.max_delay, delay)
            self.stats.applied_by_rank[rank] += 1
        self.version += len(parts)
        self.stats.applied += len(parts)
        self.stats.applies += 1
        if len(parts) > 1 and self.update_mode == "async":
            self.stats.aggregated_applies += 1

    def _await_safe(self, seq: int) -> None:
        """Return once record ``seq`` is acknowledged down the chain; ValueError (not acked) otherwise."""
        deadline = time.monotonic() + self.ack_timeout
        while (forwarder := self._live_forwarder()) is not None:
            if forwarder.wait_acked(seq, max(0.0, deadline - time.monotonic())):
                return
            if self.forwarder is forwarder or time.monotonic() >= deadline:
                with self._cond:
                    self.stats.replication_stalls += 1
                raise ValueError(f"applied at the primary but not acknowledged by the replica within "
                                 f"{self.ack_timeout:.1f} s: not safe, push again with the same update id")
        # No successor (any more): applied here is applied by the whole chain. A forwarder replaced meanwhile
        # (an unlink, a join) is asked again by the loop.

    def _op_request(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        if self.grants is None:
            raise ValueError(f"this job's schedule is {self.config.schedule}: push without asking")
        header = frame.header
        request = TransferRequest(rank=header["rank"], update_id=str(header["update_id"]),
                                  version=int(header["version"]), size=int(header["size"]),
                                  norm=float(header.get("norm", 0.0)), arrival=self.grants.clock())
        if request.size <= 0 or not math.isfinite(request.norm):
            raise ValueError(f"request: size {request.size} and norm {request.norm} must be > 0 and finite")
        if "rate" in header:
            rate = header["rate"]
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
                raise ValueError(f"request: rate {rate!r} must be a positive number of bytes/s")
            self.grants.hint(request.rank, float(rate))
        try:
            decision = self.grants.request(request, timeout=self.pull_timeout)
        except TimeoutError as err:
            raise ValueError(str(err)) from None
        response: dict[str, Any] = {"ok": True, "action": decision.action, "reason": decision.reason,
                                    "predicted_delay": decision.predicted_delay, "halted": self.halted}
        if decision.reason.startswith(STALE) and decision.predicted_version is not None:
            response["version"] = decision.predicted_version  # gang round: the next step starts from this
        if decision.action == AGGREGATE and decision.group is not None and self.grants.switch_slots:
            switch = self.grants.switch_grant(decision.group)
            if switch is not None:  # summed in the switch: a subset round of the group's members
                response.update(group=decision.group, aggregator=decision.aggregator,
                                group_size=len(switch["parts"]), switch=switch)
                return response, b""
        if decision.action == AGGREGATE:
            assert decision.aggregator is not None and decision.group is not None
            with self._cond:
                agg = self.workers.get(decision.aggregator, {}).get("agg")
            if agg is None:  # cannot happen: only workers with an aggregation endpoint aggregate
                raise ValueError(f"aggregator {decision.aggregator} has no aggregation endpoint")
            response.update(group=decision.group, aggregator=decision.aggregator, agg=agg,
                            group_size=len(self.grants.group_members(decision.group)))
        return response, b""

    def _op_agg_grant(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        if self.grants is None:
            raise ValueError(f"this job's schedule is {self.config.schedule}: there are no aggregation groups")
        group = self.grants.group_slot(int(frame.header["group"]), timeout=self.pull_timeout)
        return {"ok": True, "members": list(group.members)}, b""

    def _op_model_blocks(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        """Blocks of a version the distribution sender sent lately (a worker repairs its copy)."""
        if self.distribution is None:
            raise ValueError("this PS does not distribute the model through the switch")
        header = frame.header
        version = int(header["version"])
        raw = header.get("ranges")
        if not isinstance(raw, list) or len(raw) > 65536 or not all(
                isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) and 0 <= r[0] < r[1]
                for r in raw):
            raise ValueError("model_blocks: ranges must be a list of [start, end) block numbers")
        if sum(end - start for start, end in raw) > 1 << 16:  # a version has at most 2**16 blocks
            raise ValueError("model_blocks: more blocks asked for than a version has")
        blocks = self.distribution.blocks(version, [(a, b) for a, b in raw])
        if blocks is None:
            return {"ok": True, "found": False}, b""
        return {"ok": True, "found": True, "blocks": int(blocks.shape[0])}, blocks.tobytes()

    def _op_outcome(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        """A member of a switch group waits for its update's outcome (the leader pushed the sum): ``known``
        is false after ``timeout`` seconds without one (the member then pushes its own update)."""
        header = frame.header
        update_id, rank = str(header["update_id"]), int(header["rank"])
        update_step(update_id, rank)
        timeout = min(max(float(header.get("timeout", 10.0)), 0.0), self.pull_timeout)
        deadline = time.monotonic() + timeout
        with self._cond:
            while (outcome := self._outcome(update_id, rank)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"ok": True, "known": False}, b""
                self._cond.wait(left)
        if outcome.get("outcome") == APPLIED and "seq" in outcome:
            self._await_safe(outcome["seq"])
        return {"ok": True, "known": True, "duplicate": True, **outcome}, b""

    def _op_halt(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        with self._cond:
            seq = self._commit({"kind": "halt"}, b"", self._apply_halt) if not self.halted else 0
        if seq:
            self._await_safe(seq)
        return {"ok": True}, b""

    def _apply_halt(self) -> None:
        self.halted = True

    def _op_stats(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        with self._cond:
            stats = asdict(self.stats)
            stats["applied_by_rank"] = {str(k): v for k, v in self.stats.applied_by_rank.items()}
            stats["dropped_by_rank"] = {str(k): v for k, v in self.stats.dropped_by_rank.items()}
            forwarder = self.forwarder
            result: dict[str, Any] = {
                "ok": True, "role": self.role, "version": self.version, "seq": self.seq, "halted": self.halted,
                "caught_up": self._caught_up, "upstream": self._upstream,
                "superseded": forwarder is not None and forwarder.superseded,
                "initialized": self.model is not None, "started_at": self.started_at, "stats": stats,
                "max_delay": self.max_delay,
                "delay_histogram": {str(d): n for d, n in sorted(self.delay_histogram.items())},
                "log_size": self.log.maxlen, "logged": len(self.log), "outcomes_kept": len(self._outcomes),
            }
            if frame.header.get("log"):
                result["log"] = [asdict(e) for e in self.log]
            if self.distribution is not None:
                result["distribution"] = asdict(self.distribution.stats)
            if (forwarder := self._live_forwarder()) is not None:
                snapshots_sent = forwarder.snapshots_sent  # read first: it counts acknowledged transfers
                result["replication"] = {"successor": list(forwarder.successor), "snapshots_sent": snapshots_sent,
                                         "acked_seq": forwarder.acked_seq, "head": forwarder.head,
                                         "lag": forwarder.lag, "records_sent": forwarder.records_sent,
                                         "last_error": forwarder.last_error}
            model = self.model.tobytes() if frame.header.get("model") and self.model is not None else b""
        if self.grants is not None:
            result["scheduler"] = self.grants.snapshot()
        return result, model

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
    parser.add_argument("--model-rate-mbit", type=float, default=10.0,
                        help="pace of those sends (the PS link's rate; default 10)")
    parser.add_argument("--batch-window", type=float, default=0.01,
                        help="scheduler: how long a batch of requests waits for the others after its first")
    parser.add_argument("--gang", action=argparse.BooleanOptionalAction, default=None,
                        help="scheduler: gang rounds, one switch group per batch (default: with --model-config)")
    parser.add_argument("--default-bandwidth", type=float, default=1.25e6,
                        help="scheduler: bytes/s assumed for a sender not measured yet")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
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
                              log_size=args.log_size, joining=args.join is not None or bool(running))
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
