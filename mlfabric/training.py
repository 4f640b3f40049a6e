"""A worker's training loop against the MLfabric PS: pull, compute, (ask,) push — sync or async.

``run_worker(client, grad_fn, initial, steps=...)`` works for any model given as one
flat float32 vector: ``grad_fn(params, step) -> (loss, gradient)``. In an async job a
worker pulls the current model and version, computes, and pushes the gradient tagged
with that version; with ``schedule: mlfabric`` it first asks the scheduler, then sends
when granted — to the PS, to the idle worker it was told to aggregate at, or into a subset
round in the switch with the other members of its group (``switch``: a :class:`SwitchSummer`;
the group's leader pushes the sum, the others wait for its outcome and push their own update
if none comes or the exchange failed, which the PS recognises by update id) — or drops the
update when the scheduler predicts it would exceed the delay bound. In a sync job
the push returns once the round of all workers was applied. The loop ends after
``steps`` steps, when the PS says the job is halted, or after ``max_seconds``.

With ``distribution`` (the worker's rank in the job's distribution job), the PS sends each new
model version through the switch once, and a step after the first starts from the newest
version the worker received instead of pulling the model over the PS's link: at once if that
version is at most ``local_slack`` behind the newest the PS reported (in a push's outcome) and
not older than the worker's last; otherwise it waits up to ``local_wait`` seconds for that one
(:class:`ModelCache`, repairing a nearly complete one over TCP), then takes any newer than its
last, and else pulls as before.

A member of a switch group whose sum the PS applied right on top of the version it computed on
starts its next step from the model it computes itself: that version plus ``-lr * sum`` in
float32, the PS's own arithmetic (``applied_locally``; the outcome carries ``lr``). Where the group
closed without some of its values and the PS allows it (``fold``), the member adds those values to its
next update instead of pushing them (error feedback), so that no version of their own comes between
the group and the next one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from netagg.jobconfig import WorkerConfig
from netagg.mlfabric.distribution import ModelCache
from netagg.mlfabric.protocol import Connection, FabricError, Unreachable, to_blob
from netagg.mlfabric.receivers import ReceiverMembership
from netagg.mlfabric.switch_sum import SwitchAggregationFailed, SwitchSummer
from netagg.mlfabric.worker import FabricClient, Unavailable

log = logging.getLogger(__name__)

#: Where a worker's time goes (:attr:`WorkerReport.phase_seconds`).
PHASES = ("model", "compute", "grant", "send")

GradFn = Callable[[np.ndarray, int], tuple[float, np.ndarray]]


@dataclass
class WorkerReport:
    """What one worker did; ``acked`` lists the update ids the PS acknowledged as applied."""

    rank: int
    steps: int = 0
    pushed: int = 0
    applied: int = 0
    dropped: int = 0
    scheduler_dropped: int = 0
    aggregated: int = 0
    #: Updates summed in the switch; of them, pushed by this worker as the group's leader.
    switch_aggregated: int = 0
    switch_led: int = 0
    #: Subset exchanges that failed, and times no outcome came for the group: own update pushed instead.
    switch_fallbacks: int = 0
    #: Updates a switch group closed at its deadline held only in part: this worker pushed the rest (of them, the
    #: values it sent alone, without the rest of its update).
    switch_partial: int = 0
    switch_rest_values: int = 0
    #: Of them, rests carried into this worker's next update instead (``fold``: error feedback), their values, and
    #: values so carried that were dropped with the update that carried them (scheduler or delay bound) or never
    #: sent (the run ended first).
    switch_folded: int = 0
    folded_values: int = 0
    folded_values_dropped: int = 0
    errors: int = 0
    #: Steps that started from a version received through the switch, and from a pull over TCP.
    local_models: int = 0
    #: Steps that started from a version this worker computed itself: its switch group's sum applied to the
    #: model the group's updates were computed on, when the PS applied the group right on top of it.
    applied_locally: int = 0
    pulls: int = 0
    #: Times this worker left its distribution job's multicast group (its link could not take the versions) and
    #: joined it again (mlfabric/receivers.py).
    distribution_leaves: int = 0
    distribution_joins: int = 0
    #: The newest PS version this worker heard of (pulls, push outcomes).
    ps_version: int = -1
    failovers: int = 0
    halted: bool = False
    seconds: float = 0.0
    last_loss: float = float("nan")
    #: Seconds spent getting models (pull or delivered version), computing, waiting for grants, sending.
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    #: Of the grant waits, the seconds not spent at the PS (the request's and the answer's way through the
    #: network: queues of the links it shares with the models and gradients); the PS says how long it held each.
    grant_wire_seconds: float = 0.0
    acked: list[str] = field(default_factory=list)
    delays: list[int] = field(default_factory=list)
    error_messages: list[str] = field(default_factory=list)


def run_worker(client: FabricClient, grad_fn: GradFn, initial: np.ndarray, *, steps: int, schedule: str = "fifo",
               compute_delay: float = 0.0, max_seconds: float | None = None,
               on_step: Callable[[int, dict[str, Any]], None] | None = None,
               switch: SwitchSummer | None = None, distribution: WorkerConfig | None = None,
               local_wait: float = 0.05, local_slack: int = 0, init_wait: float = 10.0) -> WorkerReport:
    """Train until ``steps``, a halt, or ``max_seconds``; returns the report (raises Unavailable).

    The model is initialised by rank 0; another rank offers its own (the first offer wins) only if the PS
    still has none after ``init_wait`` seconds (rank 0 is gone): N workers starting at once do not all send
    the whole model into the PS's link."""
    report = WorkerReport(rank=client.rank)
    started = time.monotonic()
    if not _initialized(client, 0.0 if client.rank == 0 else init_wait):
        client.init(np.asarray(initial, np.float32))
    membership = ReceiverMembership(distribution) if distribution is not None and distribution.controller \
        is not None else None
    cache = ModelCache(distribution, int(np.asarray(initial).size), membership=membership) \
        if distribution is not None else None
    version = -1
    #: (version, model) the last switch group's outcome lets this worker compute (see _switch_aggregate).
    ahead: tuple[int, np.ndarray] | None = None
    #: Bytes/s of this worker's last pull: its rate hint while no versions reach it through the switch (it left the
    #: distribution, or has none). Without one a batch would wait for it as if it were as fast as the others.
    pull_rate: float | None = None
    #: Values of this worker's last update that its closed switch group's sum lacked (zeros elsewhere), and how
    #: many: added to its next update.
    carry: tuple[np.ndarray, int] | None = None
    #: Whether the PS sends the version of this worker's last outcome through the switch: it does not where every
    #: receiver computes it from its switch group's sum, and then a worker that could not waits for nothing.
    coming = True
    try:
        for step in range(steps):
            if max_seconds is not None and time.monotonic() - started > max_seconds:
                break
            phase_start = time.monotonic()
            floor = max(version, report.ps_version - local_slack)
            if ahead is not None and ahead[0] >= floor:  # computed from the last switch group's sum
                (version, params), ahead = ahead, None
                report.applied_locally += 1
            elif (local := _delivered(client, cache, step, version, floor, local_wait, coming)) is not None:
                version, params = local
                report.local_models += 1
            else:
                pulled = time.monotonic()
                version, params, halted = client.pull()
                if (took := time.monotonic() - pulled) > 0 and step:
                    # Not the first: every worker pulls the first model at once, so whose pull began first, not whose
                    # link is faster, sets those rates; with none the first group is planned at the default rate,
                    # closes at its deadline without the slow workers, and so measures them.
                    pull_rate = params.nbytes / took
                report.pulls += 1
                report.ps_version = max(report.ps_version, version)
                if halted:
                    report.halted = True
                    break
            report.phase_seconds["model"] += time.monotonic() - phase_start
            receiving = cache is not None and (cache.membership is None or cache.membership.receiving)
            rate = cache.rate if receiving and cache is not None and cache.rate is not None else pull_rate
            outcome: dict[str, Any] = {"carry": carry}
            if not _step(client, report, grad_fn, schedule, switch, compute_delay, on_step, step, version, params,
                         rate, outcome, receiving if cache is not None else None):
                break
            ahead, carry, coming = outcome.get("ahead"), outcome.get("carry"), outcome.get("multicast", True)
    finally:
        if carry is not None:  # the run ended before an update carried it
            report.folded_values_dropped += carry[1]
        if cache is not None:
            cache.close()
        if membership is not None:
            membership.close()
            report.distribution_leaves, report.distribution_joins = membership.stats.leaves, membership.stats.joins
    report.failovers = client.failovers
    report.seconds = time.monotonic() - started
    return report


def _initialized(client: FabricClient, wait: float) -> bool:
    """Whether the PS has a model, asking (``hello``, which carries no model) until it has or ``wait`` passed."""
    deadline = time.monotonic() + wait
    while not client.hello().get("initialized"):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _delivered(client: FabricClient, cache: ModelCache | None, step: int, version: int, floor: int,
               local_wait: float, coming: bool = True) -> tuple[int, np.ndarray] | None:
    """A version the switch delivered to start from: the newest the PS reported (``floor``, waiting up to
    ``local_wait`` for it when it is newer than the last), else any newer than the last; None: pull.
    ``coming``: False where the PS said it does not send ``floor`` (only one already here, or a pull, then)."""
    if cache is None or not step:
        return None
    if cache.membership is not None and not cache.membership.receiving:
        local_wait = 0.0  # out of the group: no version is coming, only one already here (pull otherwise)
    try:
        if not coming and floor > version:
            return cache.newest(floor - 1, 0.0, client.model_blocks)
        return cache.newest(floor - 1, local_wait if floor > version else 0.0, client.model_blocks) \
            or cache.newest(version, 0.0 if floor > version else local_wait, client.model_blocks)
    except Unavailable:
        raise
    except FabricError:  # the repair was refused: pull instead
        return None


def _step(client: FabricClient, report: WorkerReport, grad_fn: GradFn, schedule: str, switch: SwitchSummer | None,
          compute_delay: float, on_step: Callable[[int, dict[str, Any]], None] | None, step: int, version: int,
          params: np.ndarray, rate: float | None = None, out: dict[str, Any] | None = None,
          receiving: bool | None = None) -> bool:
    """Compute and send one gradient; False once the PS says the job is halted. ``out["ahead"]``: the next
    model, when this worker can compute it from its switch group's sum. ``out["carry"]``: in, values of the last
    update to add to this one; out, values of this one to add to the next (its closed group lacked them).
    ``out["multicast"]``: whether the PS sends the version of this update's outcome through the switch."""
    began = time.monotonic()
    loss, grad = grad_fn(params, step)
    grad = np.ascontiguousarray(grad, np.float32)
    carry = out.pop("carry", None) if out is not None else None
    if carry is not None:
        grad = grad + carry[0]
    report.last_loss = float(loss)
    if compute_delay:
        time.sleep(compute_delay)
    computed = time.monotonic()
    report.phase_seconds["compute"] += computed - began
    update_id = f"{client.rank}:{step}"
    report.steps = step + 1
    try:
        outcome = _send(client, report, schedule, update_id, version, grad, switch, rate, receiving)
        if outcome is not None and out is not None:
            out["multicast"] = bool(outcome.get("multicast", True))
        if outcome is not None and (folded := outcome.pop("_carry", None)) is not None and out is not None:
            out["carry"] = (np.where(folded, grad, np.float32(0)), int(folded.sum()))
        if outcome is not None and (total := outcome.pop("_sum", None)) is not None:
            parts, rest = outcome.pop("_parts"), outcome.pop("_rest", None)
            if out is not None:
                out["ahead"] = _apply_sum(outcome, parts, version, params, total,
                                          None if rest is None else (rest, grad))
    except Unavailable:
        raise
    except FabricError as err:
        report.errors += 1
        report.error_messages = [*report.error_messages[-9:], str(err)]
        if carry is not None:
            report.folded_values_dropped += carry[1]
        return True
    finally:
        report.phase_seconds["send"] += time.monotonic() - computed
    if carry is not None and (outcome is None or outcome.get("outcome") != "applied"):
        report.folded_values_dropped += carry[1]  # dropped with the update that carried them
    if outcome is None:  # dropped by the scheduler (whose answer may say the job is halted)
        return not report.halted
    report.pushed += 1
    report.ps_version = max(report.ps_version, int(outcome.get("version", -1)))
    if outcome.get("outcome") == "applied":
        report.applied += 1
        report.acked.append(update_id)
        delays = outcome.get("delays") or []
        report.delays.append(int(max(delays)) if delays else 0)
    else:
        report.dropped += 1
    if on_step is not None:
        on_step(step, outcome)
    if outcome.get("halted"):
        report.halted = True
        return False
    return True


def _send(client: FabricClient, report: WorkerReport, schedule: str, update_id: str, version: int,
          grad: np.ndarray, switch: SwitchSummer | None = None, rate: float | None = None,
          receiving: bool | None = None) -> dict[str, Any] | None:
    """Push ``grad`` (asking the scheduler first with ``schedule: mlfabric``); None if the scheduler dropped it."""
    if schedule != "mlfabric":
        return client.push(update_id, version, grad)
    asked = time.monotonic()
    decision = client.request(update_id, version, grad.nbytes, float(np.linalg.norm(grad)), rate=rate,
                              receiving=receiving)
    waited = time.monotonic() - asked
    report.phase_seconds["grant"] += waited
    if isinstance(held := decision.get("held"), (int, float)):
        report.grant_wire_seconds += max(waited - float(held), 0.0)
    report.phase_seconds["send"] -= waited  # counted in "send" by the caller
    action = decision["action"]
    if decision.get("halted"):
        report.halted = True
    if action == "drop":
        report.scheduler_dropped += 1
        report.ps_version = max(report.ps_version, int(decision.get("version", -1)))
        return None
    if action == "send":
        return client.push(update_id, version, grad)
    report.aggregated += 1
    if "switch" in decision:
        return _switch_aggregate(client, report, switch, decision["switch"], update_id, version, grad)
    host, port = decision["agg"]
    conn = Connection((host, int(port)), timeout=client.timeout, secret=client.secret)
    try:
        header = {"op": "agg_push", "job_id": client.job_id, "group": decision["group"],
                  "group_size": decision["group_size"], "update_id": update_id, "rank": client.rank,
                  "version": version}
        return conn.call(header, to_blob(grad), timeout=60.0)[0]
    except Unreachable as err:
        raise FabricError(f"aggregator {host}:{port}: {err}") from None
    finally:
        conn.close()


def _apply_sum(outcome: dict[str, Any], parts: int, version: int, params: np.ndarray, total: np.ndarray,
               rest: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[int, np.ndarray] | None:
    """The PS's model after a switch group, computed here: when the PS applied the group's sum (``parts``
    gradients) right on top of ``version`` (the outcome's version is ``version + parts``), its model is
    ``params - lr * total`` in float32, the PS's own arithmetic, bit for bit. ``rest`` (mask, this member's
    update): the group closed without some of this member's values, and ``outcome`` is that of its push of them,
    which the PS applied right on top of the group (``version + parts + 1``): those values' step too. None
    otherwise."""
    group = version + parts
    if outcome.get("outcome") != "applied" or "lr" not in outcome \
            or int(outcome.get("version", -1)) != group + (rest is not None):
        return None
    lr = np.float32(outcome["lr"])
    model = np.array(params, np.float32)
    model += (-lr * total).astype(np.float32)
    if rest is None:
        return group, model
    mask, grad = rest
    model += np.where(mask, (-lr * grad).astype(np.float32), np.float32(0))
    return group + 1, model


def _switch_aggregate(client: FabricClient, report: WorkerReport, switch: SwitchSummer | None,
                      grant: dict[str, Any], update_id: str, version: int, grad: np.ndarray) -> dict[str, Any]:
    """Sum ``grad`` with the group's in the switch; the leader pushes the sum (or, where the PS is a member of
    the group, ``ps``, the PS received it from the switch), the others get its outcome."""
    if switch is None:
        raise FabricError("the scheduler grouped this update in the switch, but this worker has no switch path")
    deadline, give_up = grant.get("deadline"), grant.get("give_up")
    began = time.monotonic()
    try:
        total = switch.sum(grad, int(grant["members"]), int(grant["round"]),
                           deadline=None if deadline is None else float(deadline),
                           give_up=None if give_up is None else float(give_up))
    except SwitchAggregationFailed as err:
        log.warning("switch group %s: the exchange failed after %.2f s (%s); pushing this update",
                    grant.get("parts"), time.monotonic() - began, err)
        report.switch_fallbacks += 1
        return client.push(update_id, version, grad)
    if (t := switch.transport) is not None:
        s = t.stats
        log.info("switch group %s: summed in %.2f s (so far: %d packets, %d retransmissions, %d peer timeouts, "
                 "%d spurious, window %.1f, smallest %.1f, %d cuts)", grant.get("parts"), time.monotonic() - began,
                 s.packets_sent, s.retransmissions, s.peer_timeouts, s.spurious_timeouts, t.window,
                 s.smallest_window, s.window_decreases)
    report.switch_aggregated += 1
    # The next model is computed here from this sum only if this member holds the sum the PS applied in every
    # block. The PS is in every round of a group with a deadline, so a block whose result names it holds that
    # sum, whoever else is in it; a block without (a slot this member left, its copy of a result lost) would make
    # the model wrong there. Without the PS in the group, every member in every block.
    members = switch.last_members
    if deadline is not None and "ps" in grant:
        held = bool(((members >> np.uint32(int(grant["ps"]))) & 1).all())
    else:
        held = deadline is None or bool((members == int(grant["members"])).all())
    summed = {"_sum": total, "_parts": len(grant["parts"])} if held else {}
    if "ps" not in grant and int(grant["leader"]) == client.rank:
        report.switch_led += 1
        try:
            return {**client.push(update_id, version, total, parts=grant["parts"]), **summed}
        except Unavailable:
            raise
        except FabricError:  # e.g. a member already pushed its own: every member falls back to its own
            report.switch_fallbacks += 1
            return client.push(update_id, version, grad)
    asked = time.monotonic()
    outcome = client.call("outcome", {"update_id": update_id, "timeout": 20.0}, timeout=30.0)[0]
    log.info("switch group %s: the PS's outcome after %.2f s: %s", grant.get("parts"), time.monotonic() - asked,
             {k: outcome.get(k) for k in ("known", "outcome", "version", "rest")})
    if outcome.get("known") and outcome.get("rest"):
        # The group closed at its deadline before all of this update arrived: the PS applied the part in its
        # sum and applies the rest from this push (and nothing twice). Only the values the sum lacked are sent
        # where this member agrees with the PS on which (the same blocks' results); with the group's sum they
        # give the PS's model after the rest, when it was applied right on top of the group.
        report.switch_partial += 1
        mask = switch.missing([client.rank], grad.size).get(client.rank) if held else None
        if mask is not None and int(mask.sum()) == int(outcome["rest"]) and outcome.get("fold"):
            # Carried into the next update (error feedback): no version of its own comes between this group and the
            # next, so the members stay in step on the group's model.
            try:
                client.fold(update_id, int(mask.sum()))
            except Unavailable:
                raise
            except FabricError as err:  # the PS expects no such rest: pushed as below
                log.warning("switch group %s: the fold refused (%s); pushing the rest", grant.get("parts"), err)
            else:
                report.switch_folded += 1
                report.folded_values += int(mask.sum())
                return {**outcome, **summed, "_carry": mask}
        if mask is not None and int(mask.sum()) == int(outcome["rest"]):
            try:
                pushed = client.push(update_id, version, grad[mask], rest=True)
            except Unavailable:
                raise
            except FabricError as err:  # the PS's rest is not this one: the whole update
                log.warning("switch group %s: the rest refused (%s); pushing the whole update", grant.get("parts"),
                            err)
            else:
                report.switch_rest_values += int(mask.sum())
                # The model after the rest is this member's to compute only if the PS applied the group right on top
                # of its version (a part left out of the sum, then another update, would give the rest's push the
                # same version number over another model) and the rest right on top of the group (_apply_sum).
                if int(outcome.get("version", -1)) == version + len(grant["parts"]):
                    return {**pushed, **summed, "_rest": mask}
                return pushed
        return client.push(update_id, version, grad)
    if outcome.get("known"):
        return {**outcome, **summed}
    report.switch_fallbacks += 1
    return client.push(update_id, version, grad)
