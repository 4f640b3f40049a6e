"""The software target's compiled engine: the P4 program over batches of frames (numba).

:class:`FastPipeline` has the reference model's interface (``process(frame, port)``,
``reset_registers()``) plus :meth:`FastPipeline.run`, which takes a whole batch. Its
packet logic is in :mod:`netagg.softswitch.fastpath_kernels`; this module compiles the
``ForwardingState``'s tables into arrays for it (again after every P4Runtime write) and
owns its registers. :func:`unavailable` says why it cannot run here (numba missing, no
recvmmsg), in which case the target uses the reference model and says so.
"""

from __future__ import annotations

import threading

import numpy as np
from p4.config.v1 import p4info_pb2

from netagg import dataplane as dp
from netagg import mmsg, wire
from netagg.softswitch.forwarding_state import ForwardingState, StateLock

#: Counters in the order the kernels index them (C_* in fastpath_kernels).
COUNTERS = (dp.COUNTER_DROP_REASONS, dp.COUNTER_EGRESS_DROP_REASONS, dp.COUNTER_JOB_CONTRIBUTIONS,
            dp.COUNTER_JOB_RESULTS, dp.COUNTER_JOB_DUPLICATES, dp.COUNTER_JOB_RETRANSMIT_RESULTS,
            dp.COUNTER_JOB_REJECTS)
_M64 = (1 << 64) - 1
_HASH_MULT = 0x9E3779B97F4A7C15
#: Frames one batch call takes; outputs are flushed when one more input could overflow them.
BATCH = mmsg.BATCH


def unavailable() -> str | None:
    """Why the compiled engine cannot run here, or None."""
    if not mmsg.AVAILABLE:
        return "recvmmsg/sendmmsg are not available on this platform"
    try:
        from netagg.softswitch import fastpath_kernels  # noqa: F401
    except ImportError as err:
        return f"numba is not installed ({err}); install netagg's 'fast' extra"
    return None


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _hash_slot(key: int, mask: int) -> int:
    return (((key & _M64) * _HASH_MULT) & _M64) >> 40 & mask


def _hash_size(entries: int) -> int:
    size = 16
    while size < 2 * entries:
        size *= 2
    return size


class FastRegisters:
    """The slot registers as arrays (the same state as ``netagg.slots.SlotRegisters``)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        pools = num_slots * wire.NUM_POOLS
        self.owner = np.zeros(num_slots, np.uint32)
        self.rounds = np.zeros((wire.NUM_POOLS, num_slots), np.uint16)
        self.members = np.zeros(pools, np.uint32)
        self.bitmaps = np.zeros(pools, np.uint32)
        self.counts = np.zeros(pools, np.uint8)
        self.exponents = np.zeros(pools, np.int8)
        self.values = np.zeros((pools, wire.K), np.int32)
        self.levels = np.zeros(pools, np.uint8)
        self.exchanges = np.zeros(pools, np.uint32)
        self.flags = np.zeros(pools, np.uint8)

    def arrays(self) -> tuple:
        """The registers as the kernels take them (``regs`` in fastpath_kernels): P4 order up to LevelState, then
        ExchangeCheck's and RoundFlags' (added with wire version 3)."""
        return (self.owner, self.rounds, self.members, self.bitmaps, self.counts, self.exponents, self.values,
                self.levels, self.exchanges, self.flags)

    def reset(self) -> None:
        for array in self.arrays():
            array.fill(0)

    def snapshot(self) -> dict[str, np.ndarray]:
        """Every register as an array (for comparing engines)."""
        return {"owner": self.owner.astype(np.int64), "rounds": self.rounds.astype(np.int64),
                "members": self.members.astype(np.int64),
                "exchanges": self.exchanges.astype(np.int64), "flags": self.flags.astype(np.int64),
                "bitmaps": self.bitmaps.astype(np.int64), "counts": self.counts.astype(np.int64),
                "exponents": self.exponents.astype(np.int64), "levels": self.levels.astype(np.int64),
                "values": self.values.copy()}


def _by_job_id(state: ForwardingState, table: str, action: str, width: int) -> tuple[np.ndarray, np.ndarray]:
    """A table keyed by the job id alone as two arrays indexed by it: hit, and the action's parameters."""
    valid = np.zeros(1 << 16, np.bool_)
    params = np.zeros((1 << 16, width), np.int64)
    for e in state.table(table).entries():
        if e.result[0] == action:
            (job,) = e.key
            valid[job] = True
            params[job] = e.params
    return valid, params


class CompiledTables:
    """The tables and multicast groups of a ``ForwardingState`` as the kernels' arrays."""

    def __init__(self, state: ForwardingState) -> None:
        # num_workers, slot_base, slot_count, mgid, generation, width
        self.job_valid, self.job_params = _by_job_id(state, dp.TABLE_JOBS, dp.ACTION_SET_JOB, 6)
        workers = [e for e in state.table(dp.TABLE_WORKERS).entries() if e.result[0] == dp.ACTION_SET_WORKER]
        size = _hash_size(len(workers))
        self.w_keys = np.full((size, 2), -1, np.int64)
        self.w_vals = np.zeros((size, 2), np.int64)
        for e in workers:
            job, src, sport, ingress = e.key
            key = _signed64((job << 48) | (sport << 32) | src)
            h = _hash_slot((key & _M64) ^ (ingress << 20), size - 1)
            while self.w_keys[h, 1] != -1:
                h = (h + 1) & (size - 1)
            self.w_keys[h] = (key, ingress)
            self.w_vals[h] = e.params  # rank, worker_mask
        sources = state.table(dp.TABLE_SOURCES).entries()
        size = _hash_size(len(sources))
        self.src_keys = np.full(size, -1, np.int64)
        self.src_vals = np.zeros((size, 2), np.int64)
        for e in sources:
            action = {dp.ACTION_SWITCH_ONLY: 1, dp.ACTION_BIND_TO_PORT: 2}.get(e.result[0])
            if action is None:
                continue
            (src,) = e.key
            h = _hash_slot(src, size - 1)
            while self.src_keys[h] != -1:
                h = (h + 1) & (size - 1)
            self.src_keys[h] = src
            self.src_vals[h] = (action, e.params[0] if e.params else -1)
        routes = sorted((e for e in state.table(dp.TABLE_ROUTES).entries() if e.result[0] == dp.ACTION_FORWARD),
                        key=lambda e: -e.key[0][1])
        self.route_vm = np.zeros((len(routes), 2), np.int64)
        self.route_out = np.zeros((len(routes), 2), np.int64)
        for i, e in enumerate(routes):
            value, prefix_len = e.key[0]
            mask = ((1 << prefix_len) - 1) << (32 - prefix_len)
            self.route_vm[i] = (value & mask, mask)
            self.route_out[i] = e.params  # port, dst_mac
        replicas = [e for e in state.table(dp.TABLE_REPLICAS).entries() if e.result[0] == dp.ACTION_SET_DESTINATION]
        size = _hash_size(len(replicas))
        self.rep_keys = np.full(size, -1, np.int64)
        self.rep_vals = np.zeros((size, 3), np.int64)
        for e in replicas:
            mgid, rid = e.key
            key = (mgid << 16) | rid
            h = _hash_slot(key, size - 1)
            while self.rep_keys[h] != -1:
                h = (h + 1) & (size - 1)
            self.rep_keys[h] = key
            self.rep_vals[h] = e.params  # dst_mac, dst_addr, dst_port
        groups = state.multicast_groups
        top = max(groups, default=0)
        self.grp_off = np.zeros(top + 2, np.int64)
        items: list[tuple[int, int]] = []
        for gid in range(top + 1):
            self.grp_off[gid] = len(items)
            items.extend(groups.get(gid, ()))
        self.grp_off[top + 1] = len(items)
        self.grp_items = np.array(items, np.int64).reshape(-1, 2)
        # port, parent_job, parent_rank, parent_mac, parent_addr
        self.up_valid, self.up_params = _by_job_id(state, dp.TABLE_UP_LINKS, dp.ACTION_SET_UP_LINK, 5)
        downs = [e for e in state.table(dp.TABLE_DOWN_LINKS).entries() if e.result[0] == dp.ACTION_SET_DOWN_LINK]
        size = _hash_size(len(downs))
        self.dn_keys = np.full((size, 2), -1, np.int64)
        self.dn_vals = np.zeros(size, np.int64)
        for e in downs:
            ingress, src, job = e.key
            key = _signed64((job << 48) | (ingress << 32) | src)
            h = _hash_slot(key & _M64, size - 1)
            while self.dn_keys[h, 1] != -1:
                h = (h + 1) & (size - 1)
            self.dn_keys[h] = (key, ingress)
            self.dn_vals[h] = e.params[0]  # the local job
        #: The most frames one input can emit (the largest group, or 1).
        self.max_out = max([1, *(len(r) for r in groups.values())])

    def arrays(self) -> tuple:
        """The tables as the kernels take them (``tables`` in fastpath_kernels)."""
        return (self.job_valid, self.job_params, self.w_keys, self.w_vals, self.src_keys, self.src_vals,
                self.route_vm, self.route_out, self.rep_keys, self.rep_vals, self.grp_off, self.grp_items,
                self.up_valid, self.up_params, self.dn_keys, self.dn_vals)


class _TableCache:
    """The compiled tables of one state, rebuilt after each write; shared by a switch's shards."""

    def __init__(self, state: ForwardingState) -> None:
        self.state = state
        self._lock = threading.Lock()
        self._version = -1
        self._tables: CompiledTables | None = None

    def get(self) -> CompiledTables:
        """The tables of the state's current version (call holding the state's lock or a shard's)."""
        with self._lock:
            if self._version != self.state.version or self._tables is None:
                self._tables = CompiledTables(self.state)
                self._version = self.state.version
            return self._tables


class FastPipeline:
    """The netagg program on one software switch, compiled; batches in, batches out.

    :meth:`add_shard` makes a pipeline for one more core: the same registers and tables, counters of
    its own and a lock of its own, so shards run batches at the same time (on disjoint slots:
    ``netagg.steering``) while control-plane writes still see every shard between batches."""

    def __init__(self, state: ForwardingState, p4info: p4info_pb2.P4Info | None = None, *,
                 first: FastPipeline | None = None) -> None:
        """``first``: make another shard of that pipeline (:meth:`add_shard`) instead of a pipeline of its own."""
        from netagg.softswitch import fastpath_kernels as kernels

        self._kernels = kernels
        self.state = state
        if first is None:
            assert p4info is not None
            sizes = {r.preamble.name: r.size for r in p4info.registers}
            self.registers = FastRegisters(sizes[dp.REGISTER_SLOT_OWNER])
            self._cache = _TableCache(state)
            #: This pipeline's shard number (0 for the first) and the lock it holds for a batch.
            self.shard = 0
            self.lock: threading.Lock | StateLock = state.lock
        else:
            self.registers, self._cache = first.registers, first._cache
            self.shard = state.add_counter_shard()
            self.lock = state.lock.add_shard()
        self._counters = tuple(a for name in COUNTERS for a in state.counter_arrays(name, self.shard))
        self._work = np.zeros(65536 + 64, np.uint8)
        self._one_out = np.zeros((0, 0), np.uint8)
        if first is None:
            self._warm_up()

    def add_shard(self) -> FastPipeline:
        """A pipeline for one more shard (call before any shard runs); the first call also gives this one
        a shard lock, so from then on no batch holds the whole state lock."""
        if self.lock is self.state.lock:
            self.lock = self.state.lock.add_shard()
        return FastPipeline(self.state, first=self)

    def _warm_up(self) -> None:
        """Compile (or load from numba's cache) the batch kernel now, not on the first packet."""
        t = CompiledTables(self.state)
        frames = np.zeros((1, 64), np.uint8)
        lengths = np.zeros(1, np.int64)
        regs = FastRegisters(1)
        self._kernels.run_batch(frames, lengths, lengths.copy(), 0, self._work, frames.copy(), lengths.copy(),
                                lengths.copy(), 1, t.arrays(), self._counters, regs.arrays())

    def reset_registers(self) -> None:
        """Power-on state (registers are not writable over P4Runtime)."""
        self.registers.reset()

    def tables(self) -> CompiledTables:
        """The compiled tables, rebuilt if the control plane wrote since (call with ``lock`` held)."""
        return self._cache.get()

    def run(self, in_buf: np.ndarray, in_len: np.ndarray, in_port: np.ndarray, count: int, out_buf: np.ndarray,
            out_len: np.ndarray, out_port: np.ndarray, start: int = 0) -> tuple[int, int]:
        """Frames ``start..count-1`` (rows of ``in_buf``) through the program, in order.

        Returns (next unprocessed frame, frames emitted into ``out_*``); fewer than all when the
        outputs filled up: send them and call again from the returned index."""
        with self.lock:
            return self.run_locked(in_buf, in_len, in_port, count, out_buf, out_len, out_port, start)

    def run_locked(self, in_buf: np.ndarray, in_len: np.ndarray, in_port: np.ndarray, count: int,
                   out_buf: np.ndarray, out_len: np.ndarray, out_port: np.ndarray, start: int = 0) -> tuple[int, int]:
        """:meth:`run` for a caller that holds ``lock`` (and, for frames of another shard's slots, that
        shard's lock too: ``batch_switch``)."""
        if not self.state.configured:  # like BMv2 --no-p4 before a pipeline is pushed
            return count, 0
        t = self.tables()
        if t.max_out > out_buf.shape[0]:
            raise ValueError(f"an output batch of {out_buf.shape[0]} frames cannot hold a group of {t.max_out}")
        done, emitted = self._kernels.run_batch(
            in_buf[start:], in_len[start:], in_port[start:], count - start, self._work, out_buf, out_len,
            out_port, t.max_out, t.arrays(), self._counters, self.registers.arrays())
        return start + done, emitted

    def process(self, frame: bytes, ingress_port: int) -> list[tuple[int, bytes]]:
        """One frame (the reference model's interface); returns the frames it emits."""
        length = len(frame)
        in_buf = np.frombuffer(frame, np.uint8).reshape(1, length).copy() if length else np.zeros((1, 1), np.uint8)
        with self.lock:
            cap = self.tables().max_out
        stride = max(length, 1)
        if self._one_out.shape[0] < cap or self._one_out.shape[1] < stride:
            self._one_out = np.zeros((max(cap, self._one_out.shape[0]), max(stride, self._one_out.shape[1])),
                                     np.uint8)
        out_len = np.zeros(self._one_out.shape[0], np.int64)
        out_port = np.zeros(self._one_out.shape[0], np.int64)
        _, emitted = self.run(in_buf, np.array([length], np.int64), np.array([ingress_port], np.int64), 1,
                              self._one_out, out_len, out_port)
        return [(int(out_port[i]), self._one_out[i, :out_len[i]].tobytes()) for i in range(emitted)]


def warm_up() -> None:
    """Compile every kernel of the fast path into numba's cache (``make`` runs this once after installing)."""
    from netagg.p4info import P4InfoIndex
    from netagg.softswitch import batch_switch

    index = P4InfoIndex.from_file(dp.P4INFO_PATH)
    FastPipeline(ForwardingState(index), index.p4info)
    batch_switch.warm_up()

