"""Aggregation at an idle worker: sums the updates the scheduler sent here, pushes one update to the PS.

Each worker of an ``schedule: mlfabric`` job runs an :class:`AggregationService` (a TCP
endpoint it announces in its ``hello``). A worker told to ``aggregate`` sends its update
here (``agg_push`` with the group id and size from the scheduler's decision). When
all members of the group arrived (or ``group_timeout`` after the first one), the service
waits for the aggregate's slot on the PS's link (``agg_grant``), pushes the sum with the
members as ``parts``, and answers every member with the PS's outcome — so a member's
update is acknowledged only once the PS (and its replicas) applied it. An ``agg_push``
without the job's shared secret is refused before it is looked at (``bad_secret``); the
service's own requests to the PS carry the secret through its :class:`FabricClient`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from netagg.framed_server import Frame, FramedServer, dispatch, listen
from netagg.mlfabric.protocol import FabricError, from_blob
from netagg.mlfabric.worker import FabricClient


@dataclass
class _Group:
    size: int
    deadline: float
    parts: list[list[Any]] = field(default_factory=list)
    total: np.ndarray | None = None
    forwarding: bool = False
    outcome: dict[str, Any] | None = None
    error: str = ""


@dataclass
class AggregationStats:
    """What this aggregator did."""

    members: int = 0
    groups: int = 0
    partial_groups: int = 0
    errors: int = 0
    #: Requests answered ``ok: false`` (wrong job or op, bad values, wrong secret, ...).
    bad_requests: int = 0
    #: Requests refused for a wrong or missing job secret (also counted in ``bad_requests``).
    bad_secret: int = 0


class AggregationService:
    """A worker's aggregation endpoint (see the module docstring).

    ``secret`` is the job's shared secret ("" = the job has none): an ``agg_push`` must carry it.
    ``client_factory`` makes the client for the PS (``FabricClient.from_config``, which carries it too).
    """

    def __init__(self, client_factory: Callable[[], FabricClient], job_id: int, bind: tuple[str, int],
                 group_timeout: float = 5.0, keep_groups: int = 1024, *, secret: str) -> None:
        self.client_factory = client_factory
        self.job_id = job_id
        self._secret = secret
        self.group_timeout = group_timeout
        self.keep_groups = keep_groups
        self.server = FramedServer(listen(bind), lambda: (self._handle, None), name="mlfabric-agg",
                                   on_error=self._on_error)
        self.address: tuple[str, int] = self.server.address
        self.stats = AggregationStats()
        self._groups: dict[int, _Group] = {}
        self._client: FabricClient | None = None
        self._client_lock = threading.Lock()
        self._cond = threading.Condition()

    def start(self) -> AggregationService:
        self.server.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._cond.notify_all()
        self.server.stop()
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> AggregationService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _on_error(self, message: str) -> None:
        with self._cond:
            self.stats.bad_requests += 1

    def _count_bad_secret(self) -> None:
        with self._cond:
            self.stats.bad_secret += 1

    def _handle(self, frame: Frame) -> tuple[dict[str, Any], bytes | bytearray]:
        return dispatch(frame, {"agg_push": self._agg_push}, job_id=self.job_id, secret=self._secret,
                        on_bad_secret=self._count_bad_secret, server="this aggregator",
                        unknown="an aggregator takes agg_push, not {op!r}")

    def _agg_push(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        header = frame.header
        group_id, size = int(header["group"]), int(header["group_size"])
        part = [str(header["update_id"]), int(header["rank"]), int(header["version"])]
        values = from_blob(frame.blob)
        if size < 1 or not np.isfinite(values).all():
            raise ValueError("agg_push: group_size must be >= 1 and the update finite")
        with self._cond:
            group = self._groups.get(group_id)
            if group is None:
                group = self._groups[group_id] = _Group(size, time.monotonic() + self.group_timeout)
                self._forget_old()
            if group.forwarding or len(group.parts) >= group.size:
                raise ValueError(f"group {group_id} is complete or already sent")
            if group.total is not None and group.total.size != values.size:
                raise ValueError(f"group {group_id}: {values.size} values, the group has {group.total.size}")
            group.parts.append(part)
            group.total = values if group.total is None else group.total + values
            self.stats.members += 1
            self._cond.notify_all()
            # Wait for the group's outcome; the first member to find the group complete (or expired) leaves
            # the loop by ``break`` and forwards it. Python's while/else: ``else`` runs when the outcome came.
            while group.outcome is None and not group.error:
                if not group.forwarding and (len(group.parts) == group.size or time.monotonic() >= group.deadline):
                    group.forwarding = True
                    break
                self._cond.wait(max(0.01, min(0.5, group.deadline - time.monotonic())))
            else:
                return self._answer(group)
        self._forward(group_id, group)
        with self._cond:
            return self._answer(group)

    def _answer(self, group: _Group) -> tuple[dict[str, Any], bytes]:
        if group.error:
            raise ValueError(f"the aggregate was not applied: {group.error}")
        assert group.outcome is not None
        return {"ok": True, **group.outcome}, b""

    def _forward(self, group_id: int, group: _Group) -> None:
        """Wait for the aggregate's slot, push it, record the outcome for every member."""
        assert group.total is not None
        outcome: dict[str, Any] | None = None
        error = ""
        try:
            with self._client_lock:
                if self._client is None:
                    self._client = self.client_factory()
                self._client.agg_grant(group_id)
                outcome = self._client.push(f"agg{group_id}", min(p[2] for p in group.parts), group.total,
                                            parts=group.parts)
        except FabricError as err:
            error = str(err)
        with self._cond:
            self.stats.groups += 1
            if len(group.parts) < group.size:
                self.stats.partial_groups += 1
            if error:
                self.stats.errors += 1
            group.outcome, group.error = outcome, error
            self._cond.notify_all()

    def _forget_old(self) -> None:
        while len(self._groups) > self.keep_groups:
            del self._groups[next(iter(self._groups))]
