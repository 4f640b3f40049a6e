"""A worker's client of the MLfabric PS chain, with failover from the primary to its replicas.

The worker knows every endpoint of the chain (the config's ``ps``, then ``replicas``).
When the node it talks to breaks or stops answering, the client moves to the next one
(wrapping around: a node that rejoined the chain on an earlier endpoint is reached too),
asks it to take over (``promote``: a replica accepts only once its primary is gone and
it has caught up; a primary just says so) and repeats the request there. Pushes carry
update ids, so a push repeated after a failover is applied at most once (the replica
already has every update the primary acknowledged). Every request has a timeout; after
``failover_timeout`` seconds without any reachable primary, :class:`Unavailable` is raised, but
only after a second attempt: a request whose one attempt outlasted the deadline (its connection
stalled) is sent again on a fresh connection first.
Every request carries the job's shared secret (``secret``; :meth:`FabricClient.from_config`
takes it from the config). A refusal for a wrong secret is raised at once, not failed over.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from netagg.jobconfig import WorkerConfig, resolve
from netagg.mlfabric.protocol import Connection, FabricError, Refused, Unreachable, from_blob, to_blob

#: Refusals that mean "this node does not act as primary (yet)": try the next one.
_NOT_PRIMARY = ("not the primary", "not promoted")
_ROTATION_PAUSE = 0.2


class Unavailable(FabricError):
    """No node of the chain acted as primary within the failover timeout."""


class FabricClient:
    """One worker's (or a monitor's) connection to the job's PS chain."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], job_id: int, rank: int, *, timeout: float = 10.0,
                 failover_timeout: float = 30.0, agg: tuple[str, int] | None = None, observer: bool = False,
                 secret: str = "") -> None:
        if not endpoints:
            raise ValueError("no PS endpoint")
        self.endpoints = list(endpoints)
        self.job_id = job_id
        self.rank = rank
        self.timeout = timeout
        self.failover_timeout = failover_timeout
        self.agg = agg
        #: An observer (a monitor, a test) only reads ``stats``: it never says hello nor promotes a replica.
        self.observer = observer
        #: The job's shared secret ("" = none), sent with every request; also for the worker's ``agg_push``.
        self.secret = secret
        self.current = 0
        self.failovers = 0
        self.last_failure = ""
        self._conn: Connection | None = None

    @classmethod
    def from_config(cls, config: WorkerConfig, **options: Any) -> FabricClient:
        """A client for ``config``'s job and rank (and secret); endpoints: ``ps`` then ``replicas``."""
        assert config.ps is not None
        endpoints = [resolve(config.ps), *(resolve(r) for r in config.replicas)]
        return cls(endpoints, config.job_id, config.rank, secret=config.secret, **options)

    # -- requests --------------------------------------------------------------
    def call(self, op: str, fields: dict[str, Any] | None = None, blob: bytes = b"",
             timeout: float | None = None) -> tuple[dict[str, Any], bytearray]:
        """One request to the current primary, failing over as needed; raises Refused or Unavailable."""
        header = {"op": op, "job_id": self.job_id, "rank": self.rank, **(fields or {})}
        deadline = time.monotonic() + self.failover_timeout
        attempts = 0
        while True:
            attempts += 1
            try:
                conn = self._connection()
                return conn.call(header, blob, timeout)
            except Unreachable as err:
                self._rotate(str(err), deadline, attempts)
            except Refused as err:
                if not any(reason in str(err) for reason in _NOT_PRIMARY):
                    raise
                self._rotate(str(err), deadline, attempts)

    def hello(self) -> dict[str, Any]:
        fields = {"agg": list(self.agg)} if self.agg else {}
        return self.call("hello", fields)[0]

    def init(self, model: np.ndarray) -> bool:
        """Offer the initial model; True if this call set it (the first offer wins)."""
        return bool(self.call("init", {}, to_blob(model))[0]["initialized_now"])

    def pull(self, min_version: int = 0, timeout: float = 30.0) -> tuple[int, np.ndarray, bool]:
        """``(version, model, halted)`` once the PS is at ``min_version`` or later."""
        response, data = self.call("pull", {"min_version": min_version, "timeout": timeout}, timeout=timeout + 5)
        return int(response["version"]), from_blob(data, int(response["size"])), bool(response["halted"])

    def push(self, update_id: str, version: int, update: np.ndarray,
             parts: list[list[Any]] | None = None, timeout: float = 40.0, rest: bool = False) -> dict[str, Any]:
        """Push one update (or an aggregate with its ``parts``); returns the PS's outcome. ``rest``: ``update``
        holds only the values its switch group's sum lacked (the outcome's ``rest`` of them, in order)."""
        fields: dict[str, Any] = {"update_id": update_id, "version": version}
        if parts is not None:
            fields["parts"] = parts
        if rest:
            fields["rest"] = int(update.size)
        return self.call("push", fields, to_blob(update), timeout=timeout)[0]

    def fold(self, update_id: str, count: int) -> dict[str, Any]:
        """Carry the ``count`` values of ``update_id`` that its closed switch group's sum lacked into this worker's
        next update instead of pushing them (the outcome said ``fold``); raises Refused if the PS expects no such
        rest."""
        return self.call("fold", {"update_id": update_id, "rest": int(count)})[0]

    def request(self, update_id: str, version: int, size: int, norm: float, timeout: float = 40.0,
                rate: float | None = None, receiving: bool | None = None) -> dict[str, Any]:
        """Ask the scheduler to send an update; returns when granted (or dropped). ``rate``: bytes/s at which
        this worker received the model lately (a hint for the scheduler; see GrantService.hint). ``receiving``:
        whether it takes the versions the PS sends through the switch (it is in the distribution's group)."""
        header: dict[str, Any] = {"update_id": update_id, "version": version, "size": size, "norm": norm}
        if rate is not None:
            header["rate"] = rate
        if receiving is not None:
            header["receiving"] = receiving
        return self.call("request", header, timeout=timeout)[0]

    def model_blocks(self, version: int, ranges: list[tuple[int, int]]) -> np.ndarray | None:
        """Blocks ``[start, end)`` of a version the PS sent through the switch ((n, K) float32); None if gone."""
        response, data = self.call("model_blocks", {"version": version, "ranges": [list(r) for r in ranges]})
        if not response.get("found"):
            return None
        return from_blob(data).reshape(int(response["blocks"]), -1)

    def agg_grant(self, group: int, timeout: float = 40.0) -> dict[str, Any]:
        """As the aggregator of ``group``: wait for the aggregate's slot."""
        return self.call("agg_grant", {"group": group}, timeout=timeout)[0]

    def stats(self, log: bool = False, model: bool = False) -> tuple[dict[str, Any], np.ndarray | None]:
        response, data = self.call("stats", {"log": log, "model": model})
        return response, (from_blob(data) if data else None)

    def halt(self) -> None:
        self.call("halt")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- failover ----------------------------------------------------------------
    def _connection(self) -> Connection:
        if self._conn is not None:
            return self._conn
        conn = Connection(self.endpoints[self.current], timeout=self.timeout, secret=self.secret)
        try:
            base = {"job_id": self.job_id, "rank": self.rank}
            if not self.observer:  # any endpoint may be a replica by now (a node that rejoined the chain)
                conn.call({"op": "promote", **base})
                fields = {"agg": list(self.agg)} if self.agg else {}
                conn.call({"op": "hello", **base, **fields})
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def _rotate(self, why: str, deadline: float, attempts: int) -> None:
        """Move to the next endpoint after a failed attempt; Unavailable once ``deadline`` has passed, but
        never after a single attempt: one that outlasted the deadline by itself (a request whose answer
        timed out, e.g. a push through a connection that stalled) is tried again on a fresh connection."""
        self.close()
        self.last_failure = why
        if time.monotonic() > deadline and attempts > 1:
            raise Unavailable(f"no primary among {self.endpoints} for {self.failover_timeout:.0f} s; last: {why}")
        self.current = (self.current + 1) % len(self.endpoints)
        self.failovers += 1
        if self.current == 0:
            time.sleep(_ROTATION_PAUSE)
