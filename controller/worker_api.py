"""The controller's endpoint for the jobs' workers (``controller.worker_address``): how they follow moves of their
job's slots (``moves.py``; the worker's side is hoststack/moves.py).

Requests are :mod:`netagg.psproto` frames over TCP, each carrying the job id and the job's secret; a request for a
job that does not exist or without its secret is refused alike (and counted), so another tenant learns nothing.
``poll`` (rank, generation) answers whether a move is pending; ``move`` (rank, generation, exchange, ready,
on_ps) is a step of one. ``receive`` (rank, receiving) is a distribution job's receiver leaving or joining its
multicast group (docs/mlfabric.md).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import TYPE_CHECKING

from netagg import jobsecret
from netagg.framed_server import Frame, FramedServer, Reply, Session, listen
from netagg.jobconfig import Endpoint

if TYPE_CHECKING:
    from netagg.controller.service import JobService

log = logging.getLogger("netagg.controller")

#: The answer to a request naming a job that does not exist or without the job's secret.
REFUSAL = "no such job, or wrong or missing job secret"
#: Connections one host may hold at once (its workers keep one each): no host takes every thread.
PER_HOST_CONNECTIONS = 256


class WorkerApi:
    """Serves the workers' requests on ``address`` until :meth:`stop`."""

    def __init__(self, service: JobService, address: Endpoint) -> None:
        self.service = service
        #: Refused requests (unknown job or wrong secret), malformed frames, bad requests; requests answered.
        self.counts: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        self.server = FramedServer(listen(address.as_tuple()), self._session, name="netagg-worker-api",
                                   frame_timeout=10.0, on_malformed=lambda _: self._count("malformed"),
                                   on_error=lambda _: self._count("bad_request"), per_source=PER_HOST_CONNECTIONS,
                                   on_refused=lambda _: self._count("connections_refused"))

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def start(self) -> WorkerApi:
        self.server.start()
        log.info("worker endpoint on %s:%d", *self.address)
        return self

    def stop(self) -> None:
        self.server.stop()

    def _count(self, what: str) -> None:
        with self._count_lock:
            self.counts[what] += 1

    def _session(self) -> Session:
        return self._handle, None

    def _handle(self, frame: Frame) -> Reply:
        header = frame.header
        job_id = header.get("job_id")
        job = self.service.store.get(job_id) if isinstance(job_id, int) and not isinstance(job_id, bool) else None
        if job is None or not job.secret or not jobsecret.matches(job.secret, header):
            self._count("refused")
            raise ValueError(REFUSAL)
        op = header.get("op")
        moves = self.service.moves
        if op == "poll":
            answer = moves.poll(job, _integer(header, "rank"), _integer(header, "generation"))
        elif op == "move":
            answer = moves.ask(job, _integer(header, "rank", 0), _integer(header, "generation", 0),
                               _integer(header, "exchange", 0), _flag(header, "ready"), _flag(header, "on_ps"),
                               _integer(header, "move", optional=True))
        elif op == "receive":
            answer = self.service.set_receiving(job.job_id, _integer(header, "rank", 0), _flag(header, "receiving"))
        else:
            raise ValueError(f"unknown op {op!r} (poll, move, receive)")
        self._count("answered")
        return {"ok": True, **answer}, b""


def _integer(header: dict, key: str, minimum: int | None = None, optional: bool = False) -> int | None:
    """The request's integer ``key`` (at least ``minimum``; None where ``optional`` and absent), else ValueError."""
    value = header.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{key}: expected an integer{bound}, got {value!r}")
    return value


def _flag(header: dict, key: str) -> bool:
    """The request's boolean ``key`` (false when absent); ValueError otherwise."""
    value = header.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false, got {value!r}")
    return value
