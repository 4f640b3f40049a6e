"""The controller's endpoint for the jobs' workers (``controller.worker_address``): how they follow moves of their
job's slots (``moves.py``; the worker's side is hoststack/moves.py).

Requests are :mod:`netagg.psproto` frames over TCP, each carrying the job id and the job's secret; a request for a
job that does not exist or without its secret is refused alike (and counted), so another tenant learns nothing.
``poll`` (rank, generation) answers whether a move is pending; ``move`` (rank, generation, exchange, ready,
on_ps) is a step of one.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import TYPE_CHECKING

from netagg import jobsecret
from netagg.controller.moves import check_request
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
            rank, generation = header.get("rank"), header.get("generation")
            for key, value in (("rank", rank), ("generation", generation)):
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"{key}: expected an integer, got {value!r}")
            answer = moves.poll(job, rank, generation)
        elif op == "move":
            rank, generation, exchange, ready, on_ps = check_request(header)
            following = header.get("move")
            if following is not None and (not isinstance(following, int) or isinstance(following, bool)):
                raise ValueError(f"move: expected the generation of the move followed, got {following!r}")
            answer = moves.ask(job, rank, generation, exchange, ready, on_ps, following)
        else:
            raise ValueError(f"unknown op {op!r} (poll, move)")
        self._count("answered")
        return {"ok": True, **answer}, b""
