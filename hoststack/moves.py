"""A worker's side of a move: the controller gives a running job new slots, and every worker switches at the same
exchange (docs/controller.md, "Fair shares that move").

The rules, with the controller's side in ``controller/moves.py``:

* **Learning.** A thread asks the controller every :data:`POLL_SECONDS` whether the job has a move pending
  (``poll``). Nothing else talks to the controller while none is.
* **Agreeing on the exchange.** While a move is pending, the worker asks before *every* exchange it starts
  (``move`` with the exchange's index): the controller answers either "not decided" (run this exchange on the old
  slots; the controller remembers the largest index it said that to) or the exchange everyone switches at. It
  decides once every rank has asked, at one past the largest index it let run on the old slots: no worker can have
  started an exchange beyond that without asking, so none is past it. A worker that cannot reach the controller
  while a move is pending keeps asking (it must not start an exchange the controller does not know of) and fails
  loudly after :data:`BARRIER_SECONDS`.
* **Switching.** At the decided exchange a worker has every result of the ones before it. It tells the controller
  so and waits: once every rank is there nothing is in flight in the old range, and the controller writes the job's
  new range and generation to the switch, then answers ``go`` with the new slot count. A worker still on the PS
  after a failover answers ``on_ps``, and the controller gives the move up (everyone stays on the old slots).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from netagg.jobconfig import WorkerConfig, resolve
from netagg.psproto import PsClient, PsError, PsRefused

log = logging.getLogger(__name__)

#: How often the poll thread asks whether a move is pending.
POLL_SECONDS = 0.5
#: The longest a worker waits, with a move pending, for an answer or for the other ranks at the switch point.
BARRIER_SECONDS = 30.0
#: Between two asks while waiting at the switch point.
WAIT_STEP = 0.005
#: One request's timeout (the controller answers at once).
REQUEST_TIMEOUT = 2.0


class MoveError(RuntimeError):
    """A move could not be followed (no answer in time, an answer that breaks the rules): the job's collectives
    cannot go on safely on this worker."""


class MoveClient:
    """Follows the controller's moves of one worker's job (see the module docstring); thread-safe polling, the
    engine thread calls :meth:`before_exchange`."""

    def __init__(self, config: WorkerConfig, *, poll_seconds: float = POLL_SECONDS,
                 barrier_seconds: float = BARRIER_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        if config.controller is None:
            raise ValueError("the job's config names no controller endpoint")
        self.config = config
        self.address = resolve(config.controller)
        self.poll_seconds = poll_seconds
        self.barrier_seconds = barrier_seconds
        self.clock = clock
        #: The generation of the move the controller announced (None: none pending) and, once decided, the
        #: exchange everyone switches at.
        self._pending: int | None = None
        self._switch_at: int | None = None
        #: The job's generation when the controller says this worker's config is older (a worker restarted with
        #: the config it was launched with, after the job moved): its slots are not the others'.
        self._stale: int | None = None
        self._client: PsClient | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_loop, name=f"netagg-moves{config.rank}", daemon=True)
        self._thread.start()

    @property
    def generation(self) -> int:
        return self.config.generation

    def before_exchange(self, index: int, on_ps: bool = False) -> WorkerConfig | None:
        """Called before exchange ``index`` starts: the config to run it (and what follows) with when the job
        switches slots here, else None (stay). Raises :class:`MoveError` when the move cannot be followed."""
        if self._stale is not None:
            raise MoveError(f"job {self.config.job_id} rank {self.config.rank}: this worker's config is of generation "
                            f"{self.config.generation}, the job's slots moved since (generation {self._stale}): "
                            "get a fresh config (netagg job config)")
        if self._pending is None and self._switch_at is None:
            return None
        if self._switch_at is None:
            answer = self._ask(index, ready=False, on_ps=on_ps)
            if answer.get("move") is None:  # given up before it was decided
                self._forget()
                return None
            self._pending = answer["move"]  # (another than the poll saw, if that one was given up meanwhile)
            self._switch_at = answer.get("switch_at")
            if self._switch_at is None:
                return None
        if index < self._switch_at:
            return None
        if index > self._switch_at:
            raise MoveError(f"job {self.config.job_id} rank {self.config.rank}: at exchange {index}, past the move's "
                            f"switch point {self._switch_at}")
        return self._switch(index, on_ps)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    # -- internals -----------------------------------------------------------
    def _switch(self, index: int, on_ps: bool) -> WorkerConfig | None:
        """Wait at the switch point until the controller says go (the new config) or gave the move up (None)."""
        deadline = self.clock() + self.barrier_seconds
        while True:
            answer = self._ask(index, ready=True, on_ps=on_ps, deadline=deadline)
            state = answer.get("state")
            if state == "go":
                slot_count, generation = answer["slot_count"], answer["generation"]
                if not (isinstance(slot_count, int) and slot_count >= 1 and isinstance(generation, int)):
                    raise MoveError(f"job {self.config.job_id}: the controller's go names no slots: {answer!r}")
                self.config = replace(self.config, slot_count=slot_count, generation=generation)
                self._forget()
                return self.config
            if state == "aborted":
                self._forget()
                log.warning("job %d rank %d: the controller gave the move up at exchange %d; the job keeps its slots",
                            self.config.job_id, self.config.rank, index)
                return None
            if state != "wait":
                raise MoveError(f"job {self.config.job_id}: unexpected answer at the switch point: {answer!r}")
            if self.clock() >= deadline:
                raise MoveError(f"job {self.config.job_id} rank {self.config.rank}: the job's other ranks did not "
                                f"reach the move's switch point (exchange {index}) within {self.barrier_seconds:g} s")
            time.sleep(WAIT_STEP)

    def _forget(self) -> None:
        with self._lock:
            self._pending = None
            self._switch_at = None

    def _ask(self, index: int, *, ready: bool, on_ps: bool, deadline: float | None = None) -> dict:
        """One ``move`` request, retried while the controller cannot be reached (until ``deadline``: it must not
        start an exchange the controller does not know of)."""
        deadline = self.clock() + self.barrier_seconds if deadline is None else deadline
        header = {"op": "move", "job_id": self.config.job_id, "rank": self.config.rank,
                  "generation": self.config.generation, "exchange": index, "ready": ready, "on_ps": on_ps,
                  "move": self._pending}
        while True:
            try:
                return self._request(header)
            except PsRefused as err:
                raise MoveError(f"job {self.config.job_id} rank {self.config.rank}: the controller refused the move "
                                f"request: {err}") from None
            except PsError as err:
                if self.clock() >= deadline:
                    raise MoveError(f"job {self.config.job_id} rank {self.config.rank}: no answer from the controller "
                                    f"at {self.address[0]}:{self.address[1]} with a move pending: {err}") from None
                time.sleep(min(0.05, self.poll_seconds))

    def _request(self, header: dict) -> dict:
        with self._lock:
            if self._client is None:
                self._client = PsClient(self.address, timeout=REQUEST_TIMEOUT, secret=self.config.secret)
            try:
                return self._client.request(header)[0]
            except PsRefused:
                raise
            except PsError:
                self._client.close()
                self._client = None
                raise

    def _poll_loop(self) -> None:
        header = {"op": "poll", "job_id": self.config.job_id, "rank": self.config.rank}
        while not self._stop.wait(self.poll_seconds):
            if self._pending is not None:
                continue
            try:
                answer = self._request({**header, "generation": self.config.generation})
            except PsError as err:
                log.debug("job %d rank %d: cannot ask the controller for moves: %s", self.config.job_id,
                          self.config.rank, err)
                continue
            move, current = answer.get("move"), answer.get("generation")
            if isinstance(move, int) and not isinstance(move, bool):
                with self._lock:
                    self._pending = move
            elif isinstance(current, int) and current > self.config.generation and self._switch_at is None:
                self._stale = current
