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

This module holds the node's state, lifecycle and dispatch; its concerns are mixed in from
:mod:`~netagg.mlfabric.worker_ops` (the workers' requests), :mod:`~netagg.mlfabric.model_updates`
(applying them), :mod:`~netagg.mlfabric.chain_node` (the chain) and :mod:`~netagg.mlfabric.outcome_window`
(repeated pushes); the command line is :mod:`netagg.mlfabric.cli`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from netagg.framed_server import Frame, FramedServer, Handler, Reply, Session, dispatch, listen
from netagg.jobconfig import ConfigError, WorkerConfig, resolve
from netagg.mlfabric.chain_node import ChainNode
from netagg.mlfabric.distribution import ModelSender
from netagg.mlfabric.grants import SWITCH_DEADLINE, GrantService
from netagg.mlfabric.held_pushes import HeldPushes
from netagg.mlfabric.model_updates import LogEntry, ModelUpdates
from netagg.mlfabric.outcome_window import OutcomeWindow
from netagg.mlfabric.replication import Endpoint
from netagg.mlfabric.scheduler import Scheduler
from netagg.mlfabric.switch_sum import SwitchMember
from netagg.mlfabric.worker_ops import WorkerOps


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
    #: Switch groups whose sum this PS received from the switch itself (a member of the groups: ``ps_members``),
    #: and those whose exchange failed or whose sum it could not apply (their members push their own).
    switch_sums: int = 0
    switch_sum_failures: int = 0
    #: Deadline rounds: updates of a switch group closed at its deadline that were in none of its sum's blocks
    #: (their members push them), in only some (the rest, ``remainders``, applied from the member's push as an
    #: update of its own), and such rests applied and dropped (delay bound).
    switch_left_out: int = 0
    switch_partial: int = 0
    #: Rates the scheduler took from groups closed at their deadline (one per member missing from some blocks).
    switch_rate_samples: int = 0
    remainders_applied: int = 0
    remainders_dropped: int = 0
    #: Rests their members carried into their next update instead of pushing them (``fold``, error feedback).
    remainders_folded: int = 0
    #: Single pushes held for the next switch group (mlfabric/held_pushes.py): of them, those that became a part
    #: of a group's sum (the PS's contribution), and those applied on their own (no group took them in time, or
    #: their group failed).
    held_pushes: int = 0
    held_in_groups: int = 0
    held_alone: int = 0
    applied_by_rank: Counter = field(default_factory=Counter)
    dropped_by_rank: Counter = field(default_factory=Counter)
    last_error: str = ""


class FabricServer(WorkerOps, ChainNode, ModelUpdates):
    """One node of a job's MLfabric PS chain (see the module docstring)."""

    def __init__(self, config: WorkerConfig, *, lr: float = 0.1, replica: int | None = None,
                 bind: tuple[str, int] | None = None, max_lag: int = 1, ack_timeout: float = 10.0,
                 sync_timeout: float = 30.0, gate_timeout: float = 30.0, pull_timeout: float = 30.0,
                 batch_window: float = 0.01, default_bandwidth: float = 1.25e6, scheduler: Scheduler | None = None,
                 frame_timeout: float = 30.0, outcome_window: int = 1024, log_size: int = 100_000,
                 joining: bool = False, chain_members: Sequence[tuple[str, int]] | None = None,
                 distribution: ModelSender | None = None, gang: bool | None = None,
                 peer_timeout: float = 0.0, probe_timeout: float = 1.0,
                 switch_member: WorkerConfig | None = None, switch_deadline: float = SWITCH_DEADLINE,
                 fold_rests: bool = True, hold_pushes: bool = True, **member_options: Any) -> None:
        """``gang``: plan gang rounds (scheduler item 6); default: when this node sends versions (``distribution``).

        ``peer_timeout`` > 0 makes the chain keep itself (docs/mlfabric.md, "Replication"): a successor
        without contact for that long is removed, and a replica without upstream for that long (at once if
        ``joining``) joins the live chain's tail by itself, retrying with backoff. 0: an operator does both.
        ``probe_timeout``: how long to wait for each chain node asked for its status (promote, rejoin).
        ``switch_member``: this node's own rank config in the job's switch groups (a job whose PS chain has ranks
        on the switch, ``ps_members``): the node takes part in every switch group it plans and applies the sum it
        receives from the switch; no member pushes it (``member_options`` go to its transport).
        ``switch_deadline``: such groups close their rounds at this factor times their planned transfer
        (``GrantService``; 0: wait for every member).
        ``fold_rests``: a member of a group closed without some of its values may carry them into its next update
        (``fold``, error feedback) instead of pushing them; False: it pushes them (docs/mlfabric.md).
        ``hold_pushes``: in gang rounds with this node in the switch groups, a worker's own push waits up to the
        scheduler's ``max_defer`` for the next group and joins its sum as the PS's contribution
        (mlfabric/held_pushes.py); False: applied at once.
        """
        if config.ps is None:
            raise ConfigError("ps: an MLfabric job needs the parameter server's endpoint")
        if switch_member is not None and (
                (switch_member.job_id, switch_member.ps_members) != (config.job_id, config.ps_members)
                or not config.ps_members or switch_member.rank < config.training_workers):
            raise ConfigError(f"switch member: job {switch_member.job_id}'s rank {switch_member.rank} is not a "
                              f"PS node's rank of job {config.job_id}'s switch groups (create the job with "
                              "--switch-aggregation --switch-ps; `job config --ps-node N`)")
        if replica is not None and not 0 <= replica < len(config.replicas):
            raise ConfigError(f"replica {replica}: the job has {len(config.replicas)} replica(s)")
        self.config = config
        self.job_id = config.job_id
        self.num_workers = config.training_workers
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
        self.switch_member: SwitchMember | None = None
        if switch_member is not None:
            self.switch_member = SwitchMember(switch_member, self._apply_switch_sum, self._switch_group_failed,
                                              **member_options)
        #: Update ids of switch groups whose sum this node did not apply (its exchange failed): their
        #: members' ``outcome`` says so at once, and they push their own updates.
        self._switch_failed: OrderedDict[str, str] = OrderedDict()
        #: Update ids of switch-group parts whose sum held only some of their values (a deadline closed rounds
        #: without them): the mask of values still to apply from the member's own push of the update.
        self._remainders: OrderedDict[str, np.ndarray] = OrderedDict()
        self.fold_rests = fold_rests
        self.hold_pushes = hold_pushes
        #: Single pushes held for the next switch group (only with ``hold_pushes`` in gang rounds with a PS member).
        self._held = HeldPushes()
        #: Per rank, whether its last request said it receives the versions through the switch (unknown: it does).
        self._receiving: dict[int, bool] = {}
        self.grants: GrantService | None = None
        if config.schedule == "mlfabric":
            self.grants = GrantService(scheduler or Scheduler(self.delay_bound, default_bandwidth=default_bandwidth),
                                       lambda: self.version, batch_window=batch_window,
                                       switch_slots=config.slot_count if config.switch_aggregation else 0,
                                       switch_width=config.width,
                                       switch_floor=lambda: self.switch_floor,
                                       # multicast versions: one switch group per batch serves every worker
                                       gang=distribution is not None if gang is None else gang,
                                       ps_member=None if self.switch_member is None else self.switch_member.rank,
                                       on_switch_group=self._take_part, switch_deadline=switch_deadline,
                                       take_held=self._take_held)
            if distribution is not None and config.switch_aggregation:
                # A switch group's results go to every worker's link; the versions wait for them (HOLD_LIMIT).
                distribution.hold = self.grants.switch_group_in_flight
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
        #: The ops every connection may ask for (the chain ops are added per connection: see _session).
        self._handlers: dict[str, Handler] = {
            **{op: self._primary_only(op, handler) for op, handler in self._worker_handlers().items()},
            "stats": self._op_stats}
        self._server = FramedServer(self.sock, self._session, name="mlfabric-ps", stop=self._stop,
                                    frame_timeout=frame_timeout, on_malformed=self._on_malformed,
                                    on_error=self._on_error)

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> FabricServer:
        if self.forwarder is not None:
            self.forwarder.start()
        self._server.start()
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
        self._server.stop()
        if self.forwarder is not None:
            self.forwarder.stop()
        if self.distribution is not None:
            self.distribution.close()
        if self.switch_member is not None:
            self.switch_member.close()

    # -- the PS as a member of its switch groups ------------------------------------
    def _take_part(self, grant: dict, size: int) -> None:
        """A switch group was planned (the grant service's lock is held): the switch member joins it, with the
        held pushes the group took as its contribution."""
        if self.switch_member is not None and self.role == "primary":
            self.switch_member.submit(grant, size // 4, self._held.contribution(grant.get("held", []), size // 4))

    def _take_held(self, group: int) -> list[tuple[str, int, int]]:
        """The held pushes switch group ``group`` takes as parts (the grant service's lock is held): those whose
        delay still fits the bound with one version to spare (the group is applied as a whole; an update between
        its plan and its apply would raise every part's delay by one)."""
        if not self.hold_pushes or self.role != "primary":
            return []
        version, bound = self.version, self.delay_bound
        return self._held.take(lambda part: bound is None or version + 1 - part[2] <= bound, group)

    def _apply_switch_sum(self, grant: dict, total: np.ndarray, missing: dict[int, np.ndarray] | None = None) -> None:
        """The group's sum arrived from the switch: applied as the leader's push of it would be (once, by ids).

        ``missing``: per rank whose update is not in every block of the sum (rounds closed at the group's
        deadline without it), the values it is missing from. A part in no block is left out of the sum's parts
        (its member pushes its update); a part in some is applied with the sum, and the rest of its values waits
        for its member's push (:meth:`_push_async` applies only them)."""
        missing = missing or {}
        parts = [(str(i), int(r), int(v)) for i, r, v in grant["parts"]]
        held = set(grant.get("held", ()))  # the PS's own contribution: in every block (SwitchMember checks)
        left_out = [p for p in parts if p[0] not in held and p[1] in missing and missing[p[1]].all()]
        checked = [p for p in parts if p not in left_out]
        try:
            with self._cond:
                if self.model is None or total.size != self.model.size:
                    raise ValueError(f"a sum of {total.size} values for a model of "
                                     f"{None if self.model is None else self.model.size}")
                if self.delay_bound is not None and any(self.version - v > self.delay_bound
                                                        for i, _, v in parts if i in held):
                    # A held push's delay grew past the bound since the group took it: its members push their own,
                    # and it is decided alone (dropped), rather than the whole sum with it.
                    raise ValueError("a held push in the group exceeds the delay bound now")
                self.stats.switch_sums += 1  # received (before the apply tells the members: counters first)
                self._switch_sum_will_not_come([i for i, _, _ in left_out], "closed at the group's deadline without it")
                self.stats.switch_left_out += len(left_out)
                for update_id, rank, _ in checked:
                    if update_id not in held and rank in missing:
                        self._remainders[update_id] = missing[rank]
                        self.stats.switch_partial += 1
                while len(self._remainders) > 1024:
                    self._remainders.popitem(last=False)
                self._cond.notify_all()
            self._observe_closed(grant, missing)
            if checked:
                # Its members got the sum from the switch: where it lands on top of their version, they compute the
                # next model themselves, and need no copy of it (ModelUpdates._publish).
                self._push_async(checked, total, holders=frozenset(r for i, r, _ in checked if i not in held))
            if held:
                self._held.done(sorted(held))
        finally:
            if self.grants is not None:
                self.grants.settled([p[0] for p in checked])
                if "group" in grant:
                    # The PS has the sum: the group is over in the switch, whose slots are free for the next
                    # group (its rounds are past this one's), even while a member left out of the sum still pushes
                    # its update to the PS. Measured before: the next group waited 1.5 s for such a push over a
                    # 10 Mbit/s link, the fast workers idle.
                    self.grants.switch_group_over(grant["group"])

    def _observe_closed(self, grant: dict, missing: dict[int, np.ndarray]) -> None:
        """What a group closed at its deadline measured: each member missing from some blocks got the others in
        by the deadline (its exchange began with the PS's), a rate the scheduler plans its next transfers with
        (a member in none: less than one block in that time). Members in every block measured nothing of their
        own (the group's pace was its slowest member's). Nor did a member that got much more in than the slowest
        (a quarter more): a slot's next round waits for every member of the one before, so its count measures the
        slowest one's pace, and only says its own rate is at least that (``at_least``). Measured before this:
        the dynamic cluster's fast h0, held by h1 whose link had fallen, was rated at h1's pace, and the two
        kept being paired with a 1.1 s deadline (1.5 s groups) where h0 alone takes 0.3 s.

        A slowest member's rate that fell is taken at once, not averaged in: it had the whole deadline to send, and
        links fall by steps. Measured before this: h1's link fell from 40 to 10 Mbit/s, its closed groups measured
        1 Mbit/s, and the averaged rate (a third of each sample) kept it fast enough to pair with h0 for three
        more groups of 1.2-1.5 s each (0.36 s before the fall), about 4 s of a 17 s run."""
        deadline = grant.get("deadline")
        if not deadline or not missing or self.grants is None or self.switch_member is None:
            return
        width = self.switch_member.width
        arrived = {rank: max(int(mask.size - np.count_nonzero(mask)), width) for rank, mask in missing.items()}
        slowest = min(arrived.values())
        for rank, count in arrived.items():
            at_least = count > 1.25 * slowest
            self.grants.observe(rank, 4 * count, float(deadline), at_least=at_least, closed=not at_least)
        with self._cond:
            self.stats.switch_rate_samples += len(missing)

    def _switch_group_failed(self, grant: dict, reason: str) -> None:
        held = set(grant.get("held", ()))
        parts = [p for p in grant["parts"] if str(p[0]) not in held]
        if self.grants is not None and "group" in grant:
            self.grants.switch_group_over(grant["group"])
        self._held.free(sorted(held))  # their pushers apply them alone
        with self._cond:
            self.stats.switch_sum_failures += 1
            self._switch_sum_will_not_come([str(i) for i, _, _ in parts], reason)

    def __enter__(self) -> FabricServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- connections -------------------------------------------------------------
    def _session(self) -> Session:
        state = {"upstream": False}
        handlers = {**self._handlers, **self._chain_handlers(state)}

        def handle(frame: Frame) -> Reply:
            with self._chain_lock:  # not the apply lock: chain_state must answer while an apply holds that
                self.stats.requests += 1
            return dispatch(frame, handlers, job_id=self.job_id, secret=self.config.secret,
                            on_bad_secret=self._count_bad_secret, server="this PS")

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

    def _primary_only(self, op: str, handler: Handler) -> Handler:
        """``handler`` served by the primary only and, but for ``halt``, to a rank of the job only."""

        def handle(frame: Frame) -> Reply:
            if self.role != "primary":
                raise ValueError("this node is a replica, not the primary (promote it after the primary failed)")
            if self.forwarder is not None and self.forwarder.superseded:
                raise ValueError("this node is not the primary: its successor took over as primary (this node was "
                                 "restarted in its old role; restart it with --join instead)")
            if op != "halt":
                self._rank(frame.header)
            return handler(frame)

        return handle

    def _rank(self, header: dict[str, Any]) -> int:
        rank = header.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.num_workers:
            with self._cond:
                self.stats.unknown_workers += 1
            raise ValueError(f"unknown worker: rank {rank!r} (job {self.job_id} has ranks 0..{self.num_workers - 1})")
        return rank


if __name__ == "__main__":  # the command line lives in mlfabric/cli.py
    import sys

    from netagg.mlfabric.cli import main

    sys.exit(main())
