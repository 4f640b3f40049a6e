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

On every (re)connection the forwarder asks the successor for its last applied sequence
number (``chain_hello``, which also tells it this node's ``head``) and resends every
record after it that it still holds (it holds every unacknowledged record). A
successor that is further behind than that — it restarted empty, or joined the chain
— gets a **state transfer**: a snapshot of the node (``snapshot``: model, version,
sequence number, outcome window, log, counters) taken under the node's apply lock by
``snapshot_source``, so it is exactly the state after record ``S``; then the records
after ``S`` follow as usual. While the snapshot is in flight, new records queue up to
``max_lag`` and applies wait, as with any slow successor. When idle, the forwarder
pings (``chain_hello``) so a successor that restarted is noticed and brought back.

**Failure detection** (``peer_timeout`` > 0): every answer of the successor (to a ping, a
record, a snapshot) counts as contact. If the successor stays unreachable (or another node
holds it as its successor: :data:`ANOTHER_UPSTREAM`) for ``peer_timeout`` seconds since the
last contact, it is declared dead and removed from the chain, as ``chainctl unlink`` does:
if its last answer named its own successor, the forwarder *bypasses* it — it goes on with
that node, keeping its queue, and resends whatever that node lacks (that node acknowledged
everything the dead one acknowledged, so nothing is missing) — otherwise the forwarder
*detaches*: this node becomes the tail, the records it holds count as acknowledged by the
shorter chain, and later records are acknowledged as soon as they are applied here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from netagg.mlfabric.protocol import Connection, FabricError, Refused, Unreachable

log = logging.getLogger(__name__)

_RETRY_SECONDS = 0.2
_PING_SECONDS = 1.0
_SNAPSHOT_POLL = 0.05
#: A primary's answer to ``chain_hello``: a node whose successor says this was replaced (``superseded``).
PRIMARY_REFUSAL = "this node is a primary; it takes no replication stream"
#: A node's answer to a ``chain_hello`` while another upstream node is connected to it: one predecessor only.
ANOTHER_UPSTREAM = "another upstream node forwards to this node"

Endpoint = tuple[str, int]
#: ``on_lost(dead, new)``: the forwarder removed ``dead`` from the chain; ``new`` is the node it bypasses to,
#: or None (it detached: this node is the tail now). Called from the forwarder's thread, holding no lock.
LostCallback = Callable[[Endpoint, "Endpoint | None"], None]

#: ``snapshot_source(wait)``: ``(header, blob)`` of the node's state — the header has its ``seq`` —
#: taken under the node's apply lock if that lock can be had within ``wait`` seconds (0: only if free
#: or already held by the caller), else None.
SnapshotSource = Callable[[float], "tuple[dict[str, Any], bytes] | None"]


class ReplicationStalled(FabricError):
    """The successor has not acknowledged in time: the update is not safe (nor applied, for reserve)."""


class ChainForwarder:
    """Sends a node's applied records to its successor in order (see the module docstring).

    ``head`` is the node's sequence number when the forwarder starts (records up to it are
    only in the node's state: a successor behind it gets a snapshot from ``snapshot_source``).
    ``secret`` is the job's shared secret, carried by every request to the successor.
    """

    def __init__(self, successor: tuple[str, int], job_id: int, *, head: int = 0, max_lag: int = 1,
                 timeout: float = 5.0, snapshot_source: SnapshotSource | None = None, secret: str = "",
                 peer_timeout: float = 0.0, own: Iterable[Endpoint] = (), on_lost: LostCallback | None = None) -> None:
        """``peer_timeout``: seconds without contact after which an unreachable successor is removed from
        the chain (0: never; an operator unlinks it). ``own``: this node's endpoints (never a bypass target)."""
        if max_lag < 1:
            raise ValueError("max_lag must be >= 1")
        if peer_timeout < 0:
            raise ValueError("peer_timeout must be >= 0")
        self.successor = successor
        self.peer_timeout = peer_timeout
        self._own = frozenset(own)
        self._on_lost = on_lost
        #: The successor's successor, as its last answer said (the node a dead successor is bypassed to).
        self.next_successor: Endpoint | None = None
        #: The successor was removed and no other took its place: this node is the tail (acknowledges at once).
        self.detached = False
        #: Successors this forwarder declared dead (bypassed or detached).
        self.successors_lost = 0
        self.job_id = job_id
        self.max_lag = max_lag
        self.timeout = timeout
        self.snapshot_source = snapshot_source
        self._secret = secret
        #: Highest sequence number the successor acknowledged.
        self.acked_seq = 0
        #: Highest sequence number handed over (or the node's state when the forwarder started).
        self.head = head
        self.records_sent = 0
        self.snapshots_sent = 0
        #: The successor answered that it is a primary: the chain was re-formed without this node.
        self.superseded = False
        self.reconnects = 0
        self.last_error = ""
        self._queue: deque[tuple[int, dict[str, Any], bytes]] = deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlfabric-chain", daemon=True)
        self._conn: Connection | None = None
        self._resync = False
        self._last_contact = 0.0
        #: A state transfer under way wants a snapshot; reserve() takes it if the forwarder cannot get the lock.
        self._snapshot_wanted = False
        self._snapshot: tuple[dict[str, Any], bytes] | None = None

    def start(self) -> ChainForwarder:
        self._last_contact = time.monotonic()  # the failure timeout counts from here until a first answer
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._conn is not None:
            self._conn.close()

    def detach(self) -> None:
        """Stop forwarding (``unlink``): this node is the tail; what it holds counts as acknowledged."""
        with self._cond:
            self.detached = True
            self._queue.clear()
            self.acked_seq = max(self.acked_seq, self.head)
            self._cond.notify_all()

    @property
    def probe_timeout(self) -> float:
        """Timeout of a connection attempt or ping: the failure timeout, when that is shorter."""
        return min(self.timeout, self.peer_timeout) if self.peer_timeout > 0 else self.timeout

    @property
    def lag(self) -> int:
        """Records handed over and not yet acknowledged."""
        with self._cond:
            return len(self._queue)

    def reserve(self, timeout: float) -> None:
        """Wait until one more record keeps the lag within ``max_lag``; raises ReplicationStalled.

        Called holding the node's apply lock; a state transfer waiting for that lock gets its
        snapshot from here.
        """
        def room() -> bool:
            self._serve_snapshot()
            return len(self._queue) < self.max_lag or self._stop.is_set() or self.detached

        with self._cond:
            if not self._cond.wait_for(room, timeout):
                raise ReplicationStalled(f"replica {self.successor[0]}:{self.successor[1]} is {len(self._queue)} "
                                         f"records behind (bound {self.max_lag}) for {timeout:.1f} s"
                                         + (f": {self.last_error}" if self.last_error else ""))

    def submit(self, seq: int, header: dict[str, Any], blob: bytes) -> None:
        """Queue the record applied as ``seq`` (call in apply order, after :meth:`reserve`)."""
        with self._cond:
            self.head = seq
            if self.detached:  # the tail: applied here is applied by the whole (shorter) chain
                self.acked_seq = seq
            else:
                self._queue.append((seq, header, blob))
            self._cond.notify_all()

    def reset(self, head: int) -> None:
        """The node's state was replaced by a snapshot at ``head``: drop the queue, bring the successor there."""
        with self._cond:
            self._queue.clear()
            self.head = head
            self.acked_seq = min(self.acked_seq, head)
            self._resync = True
            self._cond.notify_all()

    def wait_acked(self, seq: int, timeout: float) -> bool:
        """Whether record ``seq`` is acknowledged by the successor within ``timeout`` seconds
        (False at once when the forwarder stops: no acknowledgement will come)."""
        with self._cond:
            self._cond.wait_for(lambda: self.acked_seq >= seq or self._stop.is_set(), timeout)
            return self.acked_seq >= seq

    # -- the forwarding thread -------------------------------------------------
    def _run(self) -> None:
        failing = ""
        while not self._stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self.acked_seq < self.head or self._resync
                                    or self._stop.is_set() or self._conn is None or self.detached,
                                    _PING_SECONDS / 2)
                if self._stop.is_set() or self.detached:
                    self._close()
                    return
                resync, self._resync = self._resync, False
            try:
                if resync:
                    self._close()
                conn = self._connection()
                with self._cond:
                    record = self._queue[0] if self._queue else None
                    behind = self.acked_seq < self.head
                if record is None:
                    if behind:  # cannot happen after a successful connection; resynchronise rather than spin
                        self._close()
                    elif time.monotonic() - self._last_contact >= _PING_SECONDS:
                        self._acknowledge(self._hello(conn))
                    continue
                seq, header, blob = record
                response, _ = conn.call({**header, "op": "replicate", "job_id": self.job_id, "seq": seq}, blob,
                                        timeout=self.timeout)
                acked = int(response["seq"])
                self._learn(response)
            except (Unreachable, Refused, KeyError, ValueError) as err:
                self.last_error = str(err)
                self.superseded = self.superseded or PRIMARY_REFUSAL in self.last_error
                if self.last_error != failing:  # one warning per distinct failure, not one per retry
                    log.warning("replication to %s:%d: %s", *self.successor, err)
                failing = self.last_error
                self._close()
                if self._dead(err):
                    self._lose_successor()
                    failing = ""
                    continue
                self._stop.wait(_RETRY_SECONDS)
                continue
            failing = ""
            self._last_contact = time.monotonic()
            self.records_sent += 1
            self._acknowledge(acked)

    def _dead(self, err: Exception) -> bool:
        """Whether the successor, failing with ``err``, is past the failure timeout (never, without one)."""
        if self.peer_timeout <= 0 or self._stop.is_set():
            return False
        if not (isinstance(err, Unreachable) or ANOTHER_UPSTREAM in str(err)):
            return False  # it answered: a refusal is not a death (a stale node, a record missing, ...)
        return time.monotonic() - self._last_contact >= self.peer_timeout

    def _lose_successor(self) -> None:
        """Remove the dead successor from the chain: bypass it to its own successor, or detach.

        ``on_lost`` runs first: a push waiting for this chain's acknowledgement is released by the change, and
        whoever sees it acknowledged must also see the loss counted."""
        silent = time.monotonic() - self._last_contact
        with self._cond:
            dead, new = self.successor, self.next_successor
        if new is None or new == dead or new in self._own:
            new = None
        if self._on_lost is not None:
            self._on_lost(dead, new)
        with self._cond:
            self.next_successor = None
            self.successors_lost += 1
            if new is not None:
                self.successor = new  # the queue stays: the new successor gets what it lacks on connection
                self._last_contact = time.monotonic()
            else:
                self.detached = True
                self._queue.clear()
                self.acked_seq = max(self.acked_seq, self.head)
            self._cond.notify_all()
        if new is not None:
            log.warning("successor %s:%d unreachable for %.1f s (%s): removed from the chain at record %d; "
                        "forwarding to its successor %s:%d instead", *dead, silent, self.last_error, self.head, *new)
        else:
            log.warning("successor %s:%d unreachable for %.1f s (%s): removed from the chain at record %d; "
                        "this node is the tail now", *dead, silent, self.last_error, self.head)

    def _learn(self, response: dict[str, Any]) -> None:
        """Remember the successor's successor from its answer (``successor``: [host, port] or null)."""
        if "successor" in response:
            nxt = response["successor"]
            self.next_successor = (str(nxt[0]), int(nxt[1])) if isinstance(nxt, list) and len(nxt) == 2 else None

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _acknowledge(self, acked: int) -> None:
        with self._cond:
            self.acked_seq = max(self.acked_seq, acked)
            while self._queue and self._queue[0][0] <= self.acked_seq:
                self._queue.popleft()
            self._cond.notify_all()

    def _hello(self, conn: Connection) -> int:
        with self._cond:
            head = self.head
        response, _ = conn.call({"op": "chain_hello", "job_id": self.job_id, "head": head},
                                timeout=self.probe_timeout)
        self._last_contact = time.monotonic()
        self._learn(response)
        return int(response["seq"])

    def _connection(self) -> Connection:
        if self._conn is not None:
            return self._conn
        conn = Connection(self.successor, timeout=self.probe_timeout, secret=self._secret)
        try:
            their_seq = self._hello(conn)
            with self._cond:
                oldest = self._queue[0][0] if self._queue else self.head + 1
                head = self.head
            if their_seq > head:
                raise Refused(f"successor has applied up to record {their_seq}, this node only up to {head}: it "
                              f"is not behind this node (restart it empty to let it join)")
            if their_seq < oldest - 1:
                their_seq = self._transfer(conn, their_seq)
        except BaseException:
            conn.close()
            raise
        self.reconnects += 1
        self._conn = conn
        self._acknowledge(their_seq)
        return conn

    # -- state transfer ----------------------------------------------------------
    def _transfer(self, conn: Connection, their_seq: int) -> int:
        """Send the successor a snapshot of this node; returns the sequence number it acknowledged."""
        if self.snapshot_source is None:
            raise Refused(f"successor has applied up to record {their_seq} but the oldest record still held is "
                          f"later: it needs a state transfer and this node has no snapshot source")
        header, blob = self._take_snapshot()
        log.warning("state transfer to %s:%d: snapshot at record %d (successor was at %d, %d bytes)",
                    *self.successor, header["seq"], their_seq, len(blob))
        response, _ = conn.call({**header, "op": "snapshot", "job_id": self.job_id}, blob, timeout=self.timeout)
        acked = int(response["seq"])
        self._last_contact = time.monotonic()
        self._learn(response)
        self._acknowledge(acked)
        self.snapshots_sent += 1  # after the acknowledgement: who sees it counted sees the acknowledged seq
        return acked

    def _take_snapshot(self) -> tuple[dict[str, Any], bytes]:
        """A snapshot taken under the node's apply lock: by this thread, or by an apply waiting in reserve()."""
        assert self.snapshot_source is not None
        deadline = time.monotonic() + self.timeout
        with self._cond:
            self._snapshot, self._snapshot_wanted = None, True
            self._cond.notify_all()
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                snapshot = self.snapshot_source(_SNAPSHOT_POLL)
                with self._cond:
                    if snapshot is None:
                        self._cond.wait_for(lambda: self._snapshot is not None, _SNAPSHOT_POLL)
                        snapshot = self._snapshot
                    if snapshot is not None:
                        self._snapshot_wanted = False
                        return snapshot
            raise Refused(f"no snapshot of this node within {self.timeout:.1f} s")
        finally:
            with self._cond:
                self._snapshot, self._snapshot_wanted = None, False

    def _serve_snapshot(self) -> None:
        """In reserve() (holding the node's apply lock and this forwarder's): take a snapshot that is wanted."""
        if self._snapshot_wanted and self._snapshot is None and self.snapshot_source is not None:
            self._snapshot = self.snapshot_source(0)
            self._cond.notify_all()
