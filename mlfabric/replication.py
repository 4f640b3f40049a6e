"""Chain replication of the PS: every applied update goes down the chain, in apply order.

A node (the primary, or a replica with a successor) hands each applied record to its
:class:`ChainForwarder`. The forwarder's thread sends the records one by one to the
next node (``replicate`` frames, each numbered by the node's apply sequence) and
counts its acknowledgements. A successor acknowledges a record only after applying it
*and* having it acknowledged by its own successor, so an acknowledgement from the
first replica means "applied everywhere down the chain".

Two guarantees the PS builds on:

* **bounded lag**: :meth:`ChainForwarder.reserve` blocks (up to a timeout) while
  ``max_lag`` records are unacknowledged, and the PS calls it before applying anything,
  so the replica never lags the primary by more than ``max_lag`` records;
* **safe acknowledgement**: the PS answers a worker's push only after
  :meth:`ChainForwarder.wait_acked` says the push's record was acknowledged.

After a reconnect the forwarder asks the successor for its last applied sequence
number (``chain_hello``) and resends every record after it that it still holds (it
holds every unacknowledged record).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

from netagg.mlfabric.protocol import Connection, FabricError, Refused, Unreachable

log = logging.getLogger(__name__)

_RETRY_SECONDS = 0.2


class ReplicationStalled(FabricError):
    """The successor has not acknowledged in time: the update is not safe (nor applied, for reserve)."""


class ChainForwarder:
    """Sends a node's applied records to its successor in order (see the module docstring)."""

    def __init__(self, successor: tuple[str, int], job_id: int, *, first_seq: int = 1, max_lag: int = 1,
                 timeout: float = 5.0) -> None:
        if max_lag < 1:
            raise ValueError("max_lag must be >= 1")
        self.successor = successor
        self.job_id = job_id
        self.max_lag = max_lag
        self.timeout = timeout
        #: Highest sequence number the successor acknowledged.
        self.acked_seq = first_seq - 1
        self.records_sent = 0
        self.reconnects = 0
        self.last_error = ""
        self._queue: deque[tuple[int, dict[str, Any], bytes]] = deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlfabric-chain", daemon=True)
        self._conn: Connection | None = None

    def start(self) -> ChainForwarder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=5)
        if self._conn is not None:
            self._conn.close()

    @property
    def lag(self) -> int:
        """Records handed over and not yet acknowledged."""
        with self._cond:
            return len(self._queue)

    def reserve(self, timeout: float) -> None:
        """Wait until one more record keeps the lag within ``max_lag``; raises ReplicationStalled."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._queue) < self.max_lag or self._stop.is_set(), timeout):
                raise ReplicationStalled(f"replica {self.successor[0]}:{self.successor[1]} is {len(self._queue)} "
                                         f"records behind (bound {self.max_lag}) for {timeout:.1f} s"
                                         + (f": {self.last_error}" if self.last_error else ""))

    def submit(self, seq: int, header: dict[str, Any], blob: bytes) -> None:
        """Queue the record applied as ``seq`` (call in apply order, after :meth:`reserve`)."""
        with self._cond:
            self._queue.append((seq, header, blob))
            self._cond.notify_all()

    def wait_acked(self, seq: int, timeout: float) -> bool:
        """Whether record ``seq`` is acknowledged by the successor within ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self.acked_seq >= seq, timeout)

    # -- the forwarding thread -------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop.is_set(), 0.5)
                if self._stop.is_set():
                    return
                if not self._queue:
                    continue
                seq, header, blob = self._queue[0]
            try:
                conn = self._connection()
                response, _ = conn.call({**header, "op": "replicate", "job_id": self.job_id, "seq": seq}, blob,
                                        timeout=self.timeout)
                acked = int(response["seq"])
            except (Unreachable, Refused, KeyError, ValueError) as err:
                self.last_error = str(err)
                log.warning("replication to %s:%d: %s", *self.successor, err)
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                self._stop.wait(_RETRY_SECONDS)
                continue
            self.records_sent += 1
            self._acknowledge(acked)

    def _acknowledge(self, acked: int) -> None:
        with self._cond:
            self.acked_seq = max(self.acked_seq, acked)
            while self._queue and self._queue[0][0] <= self.acked_seq:
                self._queue.popleft()
            self._cond.notify_all()

    def _connection(self) -> Connection:
        if self._conn is not None:
            return self._conn
        conn = Connection(self.successor, timeout=self.timeout)
        try:
            response, _ = conn.call({"op": "chain_hello", "job_id": self.job_id})
            their_seq = int(response["seq"])
        except BaseException:
            conn.close()
            raise
        with self._cond:
            oldest = self._queue[0][0] if self._queue else self.acked_seq + 1
        if their_seq < oldest - 1:
            conn.close()
            raise Refused(f"successor has applied up to record {their_seq} but the oldest record still held is "
                          f"{oldest}: it missed records (a replica restarted empty needs a state transfer, "
                          f"which is not implemented)")
        self.reconnects += 1
        self._conn = conn
        self._acknowledge(their_seq)
        return conn

