"""Model distribution through the switch: the PS sends each model version once, the switch copies it.

A *distribution job* on the switch has the MLfabric job's workers (each on a port of its own,
its distribution endpoint) plus the PS as its last rank, or the PS chain (primary, then replicas)
as its last ranks (``senders``): whichever node is primary sends, as itself. The PS sends a version as one-member
subset rounds (``members`` = its own bit, docs/protocol.md): every packet completes its round
at once and the switch multicasts it to the job's group. The values are the model's float32
bit patterns (a one-member sum is the value itself), so every copy is exact.

* :class:`DistributionLayout`: block ``b`` of version ``v`` goes in slot ``b mod S`` with round
  ``v * uses + b div S + 1`` (pool 0), so rounds grow with the version, which the PS chain
  replicates: a promoted PS continues past the old primary's rounds without state of its own;
  ``seq`` carries the version's low 16 bits and the block number.
* :class:`ModelSender` (PS): a thread sends the newest published version whenever the previous
  send is done, paced at ``rate`` bytes/s (a burst into a rate-limited link would be dropped);
  versions published meanwhile are skipped. It keeps the last versions it sent for repairs.
* :class:`ModelCache` (worker): a thread assembles the versions it receives; :meth:`newest`
  returns the newest complete version newer than a given one, repairing a nearly complete
  one with the blocks it misses (``repair``: the PS's ``model_blocks``) when asked to.
"""

from __future__ import annotations

import math
import select
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from netagg import mmsg, wire
from netagg.hoststack.packets import RECV_ROW_BYTES, headers, packet_dtype, udp_socket
from netagg.jobconfig import WorkerConfig, resolve
from netagg.mlfabric.receivers import ReceiverMembership

#: Versions kept for repairs at the PS, and assembled at once at a worker.
KEEP_VERSIONS = 4
#: A version that arrived faster than this gives no rate sample (too short to time).
MIN_RATE_SECONDS = 0.01
#: Seconds a version waits at most, in all, while ``ModelSender.hold`` says so (a switch group in flight).
HOLD_LIMIT = 1.0
_VERSION_BITS = 16
_BLOCK_MASK = (1 << 16) - 1
_STRIDE = RECV_ROW_BYTES


@dataclass(frozen=True)
class DistributionLayout:
    """Where each block of a ``size``-value model travels in a job of ``slots`` slots of ``width`` values."""

    size: int
    slots: int
    width: int = wire.K

    def __post_init__(self) -> None:
        if self.size < 1 or self.slots < 1:
            raise ValueError(f"bad layout: {self.size} values, {self.slots} slots")
        if self.blocks > _BLOCK_MASK + 1:
            raise ValueError(f"{self.size} values are {self.blocks} blocks: more than a version can number")
        if self.uses >= 1 << 14:
            raise ValueError(f"{self.blocks} blocks in {self.slots} slots use {self.uses} rounds per slot: too many")

    @property
    def blocks(self) -> int:
        return -(-self.size // self.width)

    @property
    def uses(self) -> int:
        """Rounds one version uses in a slot."""
        return -(-self.blocks // self.slots)

    def rounds(self, version: int) -> np.ndarray:
        """Round number of each block of ``version`` (mod 2**16)."""
        return (version * self.uses + np.arange(self.blocks) // self.slots + 1) & 0xFFFF

    def seqs(self, version: int) -> np.ndarray:
        return ((version & 0xFFFF) << _VERSION_BITS) | np.arange(self.blocks)

    def padded(self, model: np.ndarray) -> np.ndarray:
        """The model as (blocks, width) float32, zero-padded."""
        out = np.zeros(self.blocks * self.width, np.float32)
        out[:self.size] = model
        return out.reshape(self.blocks, self.width)

    @property
    def message_bytes(self) -> int:
        return wire.netagg_bytes(self.width)


@dataclass
class SenderStats:
    versions_sent: int = 0
    versions_skipped: int = 0
    packets_sent: int = 0
    bytes_sent: int = 0
    send_errors: int = 0
    repairs_served: int = 0
    #: Seconds versions waited for switch groups (``ModelSender.hold``).
    held_seconds: float = 0.0
    #: Versions not sent because every receiver holds them or a newer one (``ModelSender.supersede``), and of
    #: those, ones dropped while they waited for a switch group before their first packet.
    versions_unneeded: int = 0
    sends_cut: int = 0


class ModelSender:
    """The PS's side (see the module docstring). ``config``: the PS's rank in the distribution job."""

    def __init__(self, config: WorkerConfig, rate: float, *, batch: int = 64) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate}")
        self.config = config
        self.rate = rate
        self.batch = batch
        self.members = 1 << config.rank
        self.stats = SenderStats()
        #: While it returns True, no version packet leaves (for at most ``HOLD_LIMIT`` s a version): the PS sets it
        #: to "a switch group is in flight", whose results need the workers' links that the versions would fill.
        self.hold: Callable[[], bool] | None = None
        self.sock = udp_socket(resolve(config.bind))
        self.sock.setblocking(True)
        self.destination = resolve(config.aggregator)
        self._sent: OrderedDict[int, np.ndarray] = OrderedDict()
        self._pending: tuple[int, np.ndarray, Callable[[], None] | None] | None = None
        #: Versions below this are no receiver's to take (``supersede``): not sent, or no longer.
        self._floor = -1
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="model-sender", daemon=True)
        self._thread.start()

    def publish(self, version: int, model: np.ndarray, ready: Callable[[], None] | None = None) -> None:
        """Send ``version`` (a copy of ``model``) when the sender is free; ``ready`` runs first (e.g. waits
        until the version is replicated). An older pending version is replaced."""
        with self._cond:
            if self._pending is not None:
                self.stats.versions_skipped += 1
            self._pending = (version, np.array(model, np.float32), ready)
            self._cond.notify_all()

    def supersede(self, version: int) -> None:
        """Every receiver holds ``version`` already (it computed it from its switch group's sum): it is not sent,
        and an older one pending, or waiting for a switch group before its first packet, is dropped, since nobody
        would start from it."""
        with self._cond:
            self.stats.versions_unneeded += 1
            self._floor = max(self._floor, version + 1)
            if self._pending is not None and self._pending[0] < self._floor:
                self._pending = None
                self.stats.versions_unneeded += 1

    def blocks(self, version: int, ranges: list[tuple[int, int]]) -> np.ndarray | None:
        """Blocks ``[start, end)`` of a version sent lately, as (n, width) float32; None if it is gone."""
        with self._cond:
            padded = self._sent.get(version)
            if padded is None:
                return None
            self.stats.repairs_served += 1
        parts = [padded[max(0, a):min(b, padded.shape[0])] for a, b in ranges]
        return np.concatenate(parts) if parts else np.zeros((0, self.config.width), np.float32)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(5)
        self.sock.close()

    # -- sending thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._pending is not None)
                if self._stop:
                    return
                version, model, ready = self._pending  # type: ignore[misc]
                self._pending = None
                if version < self._floor:
                    continue
            try:
                if ready is not None:
                    ready()
            except Exception:
                with self._cond:
                    self.stats.versions_skipped += 1
                continue
            self._send(version, model)

    def _send(self, version: int, model: np.ndarray) -> None:
        layout = DistributionLayout(model.size, self.config.slot_count, self.config.width)
        padded = layout.padded(model)
        with self._cond:
            self._sent[version] = padded
            while len(self._sent) > KEEP_VERSIONS:
                self._sent.popitem(last=False)
        packets = np.zeros(layout.blocks, packet_dtype(layout.width))
        hdr = packets["hdr"]
        hdr["version"] = wire.VERSION
        hdr["width"] = wire.width_code(layout.width)
        hdr["job_id"] = self.config.job_id
        hdr["rank"] = self.config.rank
        hdr["members"] = self.members
        blocks = np.arange(layout.blocks)
        hdr["slot"] = blocks % layout.slots
        hdr["round"] = layout.rounds(version)
        hdr["seq"] = layout.seqs(version)
        packets["values"] = padded.view(np.int32)
        raw = packets.view(np.uint8).reshape(layout.blocks, layout.message_bytes)
        start = time.monotonic()
        held = 0.0
        sent = 0
        cut = False
        for first in range(0, layout.blocks, self.batch):
            if self.hold is not None and held < HOLD_LIMIT and self.hold():
                waited = time.monotonic()
                while time.monotonic() - waited < HOLD_LIMIT - held and self.hold():
                    time.sleep(0.005)
                pause = time.monotonic() - waited
                held += pause
                start += pause  # the pace goes on from here
                self.stats.held_seconds += pause
            if not sent and version < self._floor:
                # Every receiver holds a newer version now (an int read: no lock needed). Only a version not begun
                # is dropped: a receiver would count one cut short as its link's failure (ReceiverPolicy).
                cut = True
                break
            for row in raw[first:first + self.batch]:
                try:
                    self.sock.sendto(row, self.destination)
                    sent += 1
                except OSError:
                    self.stats.send_errors += 1
            due = start + sent * (wire.frame_bytes(layout.width) + 24) / self.rate
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        with self._cond:
            self.stats.versions_sent += not cut
            self.stats.sends_cut += cut
            self.stats.packets_sent += sent
            self.stats.bytes_sent += sent * layout.message_bytes


@dataclass
class _Receiving:
    """The version a receiver is getting: its blocks' flags, when its first and its last block so far arrived."""

    version: int
    got: np.ndarray
    first: float
    last: float


@dataclass
class CacheStats:
    versions_complete: int = 0
    versions_repaired: int = 0
    blocks_repaired: int = 0
    versions_abandoned: int = 0
    packets: int = 0
    foreign: int = 0
    malformed: int = 0


class ModelCache:
    """A worker's side (see the module docstring). ``config``: this worker's rank in the distribution job."""

    def __init__(self, config: WorkerConfig, size: int, *, batched: bool | None = None,
                 membership: ReceiverMembership | None = None) -> None:
        """``batched``: receive with recvmmsg (default: where available), else one datagram per call.
        ``membership``: told the share of each version this worker got once the sender went past it (a receiver
        whose link cannot take the versions leaves the group: mlfabric/receivers.py)."""
        self.config = config
        self.membership = membership
        #: The version being received (scored when the next one begins).
        self._receiving: _Receiving | None = None
        self.batched = mmsg.AVAILABLE if batched is None else batched
        #: The PS chain are the distribution job's last ranks (``senders``; 0: the last rank alone), and only
        #: their one-member rounds are versions: a promoted replica sends as itself. A worker of the job
        #: cannot forge them: in a one-way job the switch takes no packet from a receiver.
        senders = max(config.senders, 1)
        self.sender_members = ((1 << senders) - 1) << (config.num_workers - senders)
        self.layout = DistributionLayout(size, config.slot_count, config.width)
        self.stats = CacheStats()
        self.sock = udp_socket(resolve(config.bind))
        self.source = resolve(config.aggregator)
        self._parts: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()  # version -> (blocks, got)
        self._latest: tuple[int, np.ndarray] | None = None
        #: version -> when its first block arrived; and the rate the versions arrived at (bytes/s, a mean).
        self._first_seen: dict[int, float] = {}
        self._rate: float | None = None
        self._known = -1  # the newest version seen, to widen 16-bit version numbers
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="model-cache", daemon=True)
        self._thread.start()

    def newest(self, after: int, wait: float = 0.0,
               repair: Callable[[int, list[tuple[int, int]]], np.ndarray | None] | None = None,
               max_missing: float = 0.5) -> tuple[int, np.ndarray] | None:
        """The newest complete version newer than ``after`` (waiting up to ``wait`` s for one), as
        (version, model); with ``repair``, a newer version missing at most ``max_missing`` of its blocks
        is completed with them first. None if there is none."""
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                if self._latest is not None and self._latest[0] > after:
                    return self._latest[0], self._latest[1].copy()
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            candidate = self._repairable(after, max_missing) if repair is not None else None
        if candidate is None or repair is None:
            return None
        version, missing = candidate
        fetched = repair(version, missing)
        if fetched is None or fetched.shape != (sum(b - a for a, b in missing), self.layout.width):
            return None  # gone at the PS, or not this layout's blocks
        with self._cond:
            entry = self._parts.get(version)
            if entry is None:
                return None
            blocks, got = entry
            at = 0
            for a, b in missing:
                n = b - a
                blocks[a:b] = fetched[at:at + n]
                got[a:b] = True
                at += n
            self.stats.versions_repaired += 1
            self.stats.blocks_repaired += at
            self._measure(version)  # the rate a version reaches this worker, repair included
            self._complete(version)
            return (self._latest[0], self._latest[1].copy()) if self._latest and self._latest[0] > after else None

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.sock.close()

    # -- holding the lock ------------------------------------------------------------
    def _repairable(self, after: int, max_missing: float) -> tuple[int, list[tuple[int, int]]] | None:
        for version in sorted(self._parts, reverse=True):
            if version <= after:
                break
            _, got = self._parts[version]
            if (~got).sum() <= max_missing * got.size:
                return version, _ranges(~got)
        return None

    def _complete(self, version: int) -> None:
        blocks, _ = self._parts.pop(version)
        for older in [v for v in self._first_seen if v <= version]:
            del self._first_seen[older]
        for older in [v for v in self._parts if v < version]:
            del self._parts[older]
            self.stats.versions_abandoned += 1
        self.stats.versions_complete += 1
        if self._latest is None or version > self._latest[0]:
            self._latest = (version, blocks.reshape(-1)[:self.layout.size].copy())
        self._known = max(self._known, version)
        self._cond.notify_all()

    # -- receiving thread --------------------------------------------------------------
    def _run(self) -> None:
        """Batches of datagrams (``recvmmsg`` where available), checked and placed with numpy."""
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        batch = mmsg.MsgBatch(mmsg.BATCH, _STRIDE) if self.batched else None
        rows = batch.buf if batch is not None else np.zeros((mmsg.BATCH, _STRIDE), np.uint8)
        names = batch.names if batch is not None else np.zeros((mmsg.BATCH, mmsg.NAME_BYTES), np.uint8)
        lengths = batch.lengths if batch is not None else np.zeros(mmsg.BATCH, np.uint32)
        expected_name = np.frombuffer(bytes(mmsg.sockaddr_in(*self.source)[:8]), np.uint8)
        fd = self.sock.fileno()
        while not self._stop:
            if not poller.poll(200):
                continue
            try:
                count = batch.recv(fd) if batch is not None else self._recv_each(rows, names, lengths, expected_name)
            except OSError:
                if self._stop:
                    return
                continue
            if count:
                self._accept(rows[:count], lengths[:count], (names[:count, :8] == expected_name).all(axis=1))

    def _recv_each(self, rows: np.ndarray, names: np.ndarray, lengths: np.ndarray, expected: np.ndarray) -> int:
        """Without recvmmsg: one recvfrom_into per datagram, into the same rows."""
        count = 0
        while count < rows.shape[0]:
            try:
                size, source = self.sock.recvfrom_into(memoryview(rows[count]))
            except BlockingIOError:
                break
            lengths[count] = size
            names[count, :8] = expected if source == self.source else 0
            count += 1
        return count

    def _accept(self, rows: np.ndarray, lengths: np.ndarray, from_switch: np.ndarray) -> None:
        layout = self.layout
        hdr = headers(rows)
        valid = from_switch & (lengths == layout.message_bytes) & (hdr["version"] == wire.VERSION) \
            & ((hdr["flags"] & wire.FLAG_RESULT) != 0) & (hdr["job_id"] == self.config.job_id) \
            & ((hdr["members"] & ~np.uint32(self.sender_members)) == 0) & (hdr["members"] != 0) \
            & ((hdr["members"] & (hdr["members"] - np.uint32(1))) == 0)  # one sender of the chain
        seqs = hdr["seq"].astype(np.int64)
        blocks = seqs & _BLOCK_MASK
        valid &= blocks < layout.blocks
        with self._cond:
            self.stats.foreign += int((~from_switch).sum())
            self.stats.malformed += int((from_switch & ~valid).sum())
            self.stats.packets += int(valid.sum())
            if not valid.any():
                return
            values = rows[valid, wire.HEADER_BYTES:layout.message_bytes].copy().view(">i4").astype(np.int32)
            lows, blocks = seqs[valid] >> _VERSION_BITS, blocks[valid]
            for low in np.unique(lows):
                version = self._widen(int(low))
                if self._latest is not None and version <= self._latest[0]:
                    continue  # copies of a version already assembled (or older)
                entry = self._parts.get(version)
                if entry is None:
                    entry = (np.zeros((layout.blocks, layout.width), np.float32), np.zeros(layout.blocks, bool))
                    self._parts[version] = entry
                    self._first_seen[version] = time.monotonic()
                    while len(self._parts) > KEEP_VERSIONS:
                        dropped, _ = self._parts.popitem(last=False)
                        self._first_seen.pop(dropped, None)
                        self.stats.versions_abandoned += 1
                    self._began(version, entry[1])
                if self._receiving is not None and self._receiving.version == version:
                    self._receiving.last = time.monotonic()
                mine = lows == low
                entry[0][blocks[mine]] = values[mine].view(np.float32)
                entry[1][blocks[mine]] = True
                if entry[1].all():
                    self._measure(version)
                    self._complete(version)

    def _began(self, version: int, got: np.ndarray) -> None:
        """The first block of ``version`` arrived: the sender is past the one received before it."""
        now = time.monotonic()
        previous, self._receiving = self._receiving, _Receiving(version, got, now, now)
        if previous is None or previous.version >= version:
            return
        share = float(previous.got.mean())
        if self.membership is not None:
            self.membership.version_over(share)
        seconds = previous.last - previous.first
        if share < 1.0 and seconds >= MIN_RATE_SECONDS:  # a short version: its blocks came at the link's pace
            self._rate_sample(share * self.layout.size * 4 / seconds)

    def _measure(self, version: int) -> None:
        """A version is whole (through the switch, or repaired): one sample of this worker's receiving rate."""
        seconds = time.monotonic() - self._first_seen.pop(version, time.monotonic())
        if seconds >= MIN_RATE_SECONDS:
            self._rate_sample(self.layout.size * 4 / seconds)

    def _rate_sample(self, sample: float) -> None:
        self._rate = sample if self._rate is None else 0.5 * self._rate + 0.5 * sample

    @property
    def rate(self) -> float | None:
        """Model bytes per second at which versions arrived lately (None before one arrived): a whole version's
        size over its time, or a short one's blocks over the time they took."""
        with self._cond:
            return self._rate

    def _widen(self, low: int) -> int:
        """The version whose low 16 bits are ``low``, nearest to the newest seen."""
        if self._known < 0:
            self._known = low
            return low
        base = self._known - (self._known & 0xFFFF) + low
        candidates = (base - 0x10000, base, base + 0x10000)
        version = min(candidates, key=lambda v: abs(v - self._known))
        self._known = max(self._known, version)
        return version


def _ranges(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) runs of True in ``mask``."""
    padded = np.concatenate(([False], mask, [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def rate_of(mbit: float) -> float:
    """Bytes/s of a link of ``mbit`` Mbit/s, less 10 % headroom for everything else on it."""
    if not math.isfinite(mbit) or mbit <= 0:
        raise ValueError(f"rate must be > 0 Mbit/s, got {mbit}")
    return mbit * 1e6 / 8 * 0.9


__all__ = ["DistributionLayout", "ModelCache", "ModelSender", "rate_of"]
