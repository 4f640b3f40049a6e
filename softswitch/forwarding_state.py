"""The software target's control-plane-visible state: tables, counters, multicast groups.

No packet logic lives here. The packet pipeline reads the state (``table(...).lookup``,
``count``, ``multicast_groups``) while holding ``lock``; the P4Runtime server mutates
it, also under ``lock``, through ``apply_update`` and reads it through ``read``.
Every method that takes P4Runtime messages validates them the way P4Runtime 1.3
and PI/BMv2 do (with :mod:`netagg.softswitch.p4rt_codec`) and raises ``StateError``
(a gRPC code and a precise message). The tables themselves are in
:mod:`netagg.softswitch.tables`.

Methods do not take ``lock`` themselves: callers hold it. With pipeline shards (several
cores, :mod:`netagg.softswitch.shards`) ``lock`` is a :class:`StateLock`: the control plane
takes it whole, so every shard is between batches while a write is applied and the write
reaches every shard before it is acknowledged; each shard takes only its own part for a
batch and counts into counter arrays of its own, which reads add up.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import grpc
import numpy as np
from p4.v1 import p4runtime_pb2 as p4rt

from netagg.p4info import CounterInfo, P4InfoIndex, P4InfoLookupError
from netagg.softswitch.p4rt_codec import (
    StateError,
    check_counter_index,
    check_extras,
    check_group_id,
    describe_key,
    fill_default_entry,
    fill_entry,
    invalid,
    multicast_entry,
    parse_action,
    parse_match,
    parse_priority,
    parse_replicas,
)
from netagg.softswitch.tables import Table, TableEntryRecord, make_table

__all__ = ["ForwardingState", "StateError"]

_Code = grpc.StatusCode
_INSERT, _MODIFY, _DELETE = p4rt.Update.INSERT, p4rt.Update.MODIFY, p4rt.Update.DELETE

#: Where ``read`` adds entities (``ReadResponse.entities``).
RepeatedEntities = Any


class StateLock:
    """The state's lock: taking it takes its own lock and then every shard's (in order); a pipeline shard
    holds only the lock :meth:`add_shard` gave it while it runs a batch. Without shards, a plain lock."""

    def __init__(self) -> None:
        self._own = threading.Lock()
        self._shards: list[threading.Lock] = []

    def add_shard(self) -> threading.Lock:
        """A new shard's lock (call before the shard runs)."""
        with self._own:
            lock = threading.Lock()
            self._shards.append(lock)
            return lock

    def acquire(self) -> bool:
        self._own.acquire()
        for lock in self._shards:
            lock.acquire()
        return True

    def release(self) -> None:
        for lock in reversed(self._shards):
            lock.release()
        self._own.release()

    def locked(self) -> bool:
        return self._own.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class ForwardingState:
    """Tables, counters and multicast groups of one pipeline, sized from its P4Info.

    ``lock`` is held by the packet pipeline for each packet and by the P4Runtime
    server for each Write (and while reading). Table objects returned by
    ``table()`` stay valid across ``reset()``.
    """

    def __init__(self, index: P4InfoIndex) -> None:
        self.index = index
        self.lock = StateLock()
        #: Set by the P4Runtime server once a pipeline is committed; False after reset().
        self.configured = False
        self._tables = {info.name: make_table(info, index) for info in index.tables}
        self._tables_by_id = {t.info.id: t for t in self._tables.values()}
        self._counters = {c.name: (np.zeros(c.size, np.int64), np.zeros(c.size, np.int64))
                          for c in index.counters}
        #: Counter arrays of the pipeline shards past the first (added to the state's own on every read).
        self._shard_counters: list[dict[str, tuple[np.ndarray, np.ndarray]]] = []
        #: group id -> [(egress_port, instance)], as the packet replication engine uses them.
        self.multicast_groups: dict[int, list[tuple[int, int]]] = {}
        # How each replica's port was written (None: egress_port, n: n-byte `port`), for reads.
        self._replica_forms: dict[int, list[int | None]] = {}
        self._seq = itertools.count()
        self._reset_hooks: list[Callable[[], None]] = []
        #: Bumped by every write and reset: compiled copies of the tables (the fast path) rebuild on change.
        self.version = 0

    # ---- packet-pipeline API (hot path)

    def table(self, name: str | int) -> Table:
        """A table by fully qualified name (fast), alias or id."""
        table = self._tables.get(name)  # type: ignore[arg-type]
        if table is None:
            table = self._tables[self.index.table(name).name]
        return table

    @property
    def multicast(self) -> dict[int, list[tuple[int, int]]]:
        """Alias of ``multicast_groups`` (the same dict)."""
        return self.multicast_groups

    @property
    def tables(self) -> Mapping[str, Table]:
        """All tables by fully qualified name."""
        return self._tables

    def count(self, counter: str, index: int, nbytes: int) -> None:
        """Add one packet of ``nbytes`` to ``counter[index]``; ignore out-of-range indices (as BMv2)."""
        arrays = self._counters.get(counter)
        if arrays is None:
            arrays = self._counters[self.index.counter(counter).name]
        packets, byte_counts = arrays
        if 0 <= index < packets.shape[0]:
            packets[index] += 1
            byte_counts[index] += nbytes

    def counter_values(self, counter: str | int, index: int) -> tuple[int, int]:
        """(packets, bytes) of one counter cell; IndexError if out of range."""
        packets, byte_counts = self.counter_sums(counter)
        if not 0 <= index < packets.shape[0]:
            raise IndexError(f"counter {counter!r} has {packets.shape[0]} cells, no index {index}")
        return int(packets[index]), int(byte_counts[index])

    def counter_total(self, counter: str | int) -> int:
        """Packets counted over all cells of ``counter``."""
        return int(self.counter_sums(counter)[0].sum())

    def counter_sums(self, counter: str | int) -> tuple[np.ndarray, np.ndarray]:
        """What ``counter`` has counted: the state's own arrays, or with shards their sum (a copy)."""
        name = self.index.counter(counter).name
        packets, byte_counts = self._counters[name]
        for shard in self._shard_counters:
            packets = packets + shard[name][0]
            byte_counts = byte_counts + shard[name][1]
        return packets, byte_counts

    def counter_arrays(self, counter: str | int, shard: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The (packets, bytes) arrays ``shard`` counts ``counter`` into (compiled pipelines count into
        them): shard 0's are the state's own; :meth:`add_counter_shard` makes the others'."""
        name = self.index.counter(counter).name
        return self._counters[name] if shard == 0 else self._shard_counters[shard - 1][name]

    def add_counter_shard(self) -> int:
        """Counter arrays for one more pipeline shard (zeros); returns its shard number (1, 2, ...)."""
        self._shard_counters.append({name: (np.zeros_like(p), np.zeros_like(b))
                                     for name, (p, b) in self._counters.items()})
        return len(self._shard_counters)

    # ---- lifecycle

    def add_reset_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` (under ``lock``) on every reset, e.g. to clear the pipeline's registers."""
        self._reset_hooks.append(hook)

    def reset(self) -> None:
        """Forget all entries, counts and groups (a new pipeline) and run the reset hooks.

        Table objects are kept (the pipeline may cache them).
        """
        for hook in self._reset_hooks:
            hook()
        for table in self._tables.values():
            table.clear()
        for counters in (self._counters, *self._shard_counters):
            for packets, byte_counts in counters.values():
                packets.fill(0)
                byte_counts.fill(0)
        self.multicast_groups.clear()
        self._replica_forms.clear()
        self.configured = False
        self.version += 1

    # ---- P4Runtime writes

    def apply_update(self, update: p4rt.Update) -> None:
        """Apply one Write update; raises StateError with P4Runtime's code on failure."""
        if update.type not in (_INSERT, _MODIFY, _DELETE):
            raise invalid(f"update type {update.type} is not INSERT, MODIFY or DELETE")
        self.version += 1
        entity = update.entity
        kind = entity.WhichOneof("entity")
        if kind == "table_entry":
            self.write_table_entry(update.type, entity.table_entry)
        elif kind == "packet_replication_engine_entry":
            self.write_multicast_group(update.type, multicast_entry(entity))
        elif kind == "counter_entry":
            self.write_counter_entry(update.type, entity.counter_entry)
        elif kind == "register_entry":
            # Exactly like PI/BMv2 (p4lang/PI#376).
            raise StateError(_Code.UNIMPLEMENTED, "Register writes are not supported yet")
        elif kind is None:
            raise invalid("the update carries no entity")
        else:
            raise StateError(_Code.UNIMPLEMENTED, f"{kind} writes are not supported by this target")

    def write_table_entry(self, update_type: int, te: p4rt.TableEntry) -> None:
        """INSERT / MODIFY / DELETE one table entry (or MODIFY the default entry)."""
        table = self._table_by_id(te.table_id)
        if te.HasField("time_since_last_hit"):
            raise invalid(f"table '{table.name}': time_since_last_hit must not be set in a Write")
        if update_type == _INSERT:
            self._insert(table, te)
        elif update_type == _MODIFY:
            self._modify(table, te)
        else:
            self._delete(table, te)

    def _table_by_id(self, table_id: int) -> Table:
        table = self._tables_by_id.get(table_id)
        if table is None:
            raise invalid(f"the P4Info has no table with id {table_id:#x}")
        return table

    def _check_not_const(self, table: Table) -> None:
        if table.info.is_const_table:
            raise StateError(_Code.PERMISSION_DENIED,
                             f"table '{table.name}' is const: its entries cannot be changed")

    def _entry_record(self, table: Table, te: p4rt.TableEntry, seq: int | None = None,
                      ) -> TableEntryRecord:
        key = parse_match(table.info, te)
        priority = parse_priority(table.info, te.priority)
        if not te.HasField("action"):
            raise invalid(f"table '{table.name}': the entry {describe_key(table.info, key)} "
                           f"needs an action")
        action, params = parse_action(self.index, table, te, default_entry=False)
        check_extras(table, te)
        return TableEntryRecord(
            key=key, priority=priority, action=action, params=params, result=(action.name, params),
            controller_metadata=te.controller_metadata, metadata=te.metadata,
            seq=next(self._seq) if seq is None else seq)

    def _insert(self, table: Table, te: p4rt.TableEntry) -> None:
        if te.is_default_action:
            raise invalid(f"table '{table.name}': the default entry cannot be INSERTed, use MODIFY")
        self._check_not_const(table)
        entry = self._entry_record(table, te)
        if table.get(entry.key, entry.priority) is not None:
            raise StateError(_Code.ALREADY_EXISTS, f"table '{table.name}': an entry with match "
                             f"{describe_key(table.info, entry.key)} already exists (use MODIFY)")
        size = table.info.size
        if size and len(table) >= size:
            raise StateError(_Code.RESOURCE_EXHAUSTED,
                             f"table '{table.name}' is full ({size} entries)")
        table.put(entry)

    def _modify(self, table: Table, te: p4rt.TableEntry) -> None:
        if te.is_default_action:
            self._modify_default(table, te)
            return
        self._check_not_const(table)
        key = parse_match(table.info, te)
        old = table.get(key, parse_priority(table.info, te.priority))
        entry = self._entry_record(table, te, seq=old.seq if old else -1)
        if old is None:
            raise StateError(_Code.NOT_FOUND, f"table '{table.name}': no entry with match "
                             f"{describe_key(table.info, key)} to MODIFY")
        table.put(entry)

    def _modify_default(self, table: Table, te: p4rt.TableEntry) -> None:
        if te.match or te.priority:
            raise invalid(f"table '{table.name}': the default entry has no match and priority 0")
        const_id = table.info.const_default_action_id
        if const_id:
            raise StateError(_Code.PERMISSION_DENIED, f"table '{table.name}' has a const default "
                             f"action ('{self.index.action(const_id).name}'): it cannot be modified")
        if te.HasField("action"):
            table.set_default(*parse_action(self.index, table, te, default_entry=True))
        else:
            table.reset_default()

    def _delete(self, table: Table, te: p4rt.TableEntry) -> None:
        if te.is_default_action:
            raise invalid(f"table '{table.name}': the default entry cannot be DELETEd")
        self._check_not_const(table)
        key = parse_match(table.info, te)
        old = table.get(key, parse_priority(table.info, te.priority))
        if old is None:
            raise StateError(_Code.NOT_FOUND, f"table '{table.name}': no entry with match "
                             f"{describe_key(table.info, key)} to DELETE")
        table.remove(old)

    def write_multicast_group(self, update_type: int, mge: p4rt.MulticastGroupEntry) -> None:
        """INSERT / MODIFY / DELETE one multicast group (PI's checks and codes)."""
        gid = check_group_id(mge.multicast_group_id, allow_zero=False)
        exists = gid in self.multicast_groups
        if update_type == _INSERT and exists:
            raise StateError(_Code.ALREADY_EXISTS, f"multicast group {gid} already exists")
        if update_type != _INSERT and not exists:
            raise StateError(_Code.NOT_FOUND, f"multicast group {gid} does not exist")
        if update_type == _DELETE:
            del self.multicast_groups[gid]
            del self._replica_forms[gid]
            return
        replicas, forms = parse_replicas(gid, mge.replicas)
        self.multicast_groups[gid] = replicas
        self._replica_forms[gid] = forms

    def write_counter_entry(self, update_type: int, ce: p4rt.CounterEntry) -> None:
        """MODIFY sets one cell (units from P4Info); DELETE zeroes it (as PI); INSERT is invalid."""
        info = self._counter_info(ce.counter_id)
        if not ce.HasField("index"):
            raise StateError(_Code.UNIMPLEMENTED,
                             f"counter '{info.name}': wildcard writes (no index) are not supported")
        index = check_counter_index(info, ce.index.index)
        if update_type == _INSERT:
            raise invalid(f"counter '{info.name}': INSERT is not supported for counters, use MODIFY")
        packets, byte_counts = self._counters[info.name]
        for shard in self._shard_counters:  # the cell's value lives in the state's own arrays from now on
            shard[info.name][0][index] = shard[info.name][1][index] = 0
        if update_type == _DELETE:
            packets[index] = byte_counts[index] = 0
            return
        if info.unit in ("packets", "both", "unspecified"):
            packets[index] = ce.data.packet_count
        if info.unit in ("bytes", "both", "unspecified"):
            byte_counts[index] = ce.data.byte_count

    def _counter_info(self, counter_id: int) -> CounterInfo:
        try:
            return self.index.counter(counter_id)
        except P4InfoLookupError:
            raise invalid(f"the P4Info has no counter with id {counter_id:#x}") from None

    # ---- P4Runtime reads
    #
    # Results are built in place (``new()`` hands out the message to fill): with the
    # pure-Python protobuf runtime, copying thousands of messages costs more than building them.

    def read(self, entity: p4rt.Entity, sink: RepeatedEntities | None = None) -> list[p4rt.Entity]:
        """The entities a Read of ``entity`` selects, added to ``sink`` if given; raises StateError."""
        add: Callable[[], p4rt.Entity] = sink.add if sink is not None else p4rt.Entity
        added: list[p4rt.Entity] = []

        def new_entity() -> p4rt.Entity:
            added.append(add())
            return added[-1]

        kind = entity.WhichOneof("entity")
        if kind == "table_entry":
            self.read_table_entries(entity.table_entry, lambda: new_entity().table_entry)
        elif kind == "counter_entry":
            self.read_counter_entries(entity.counter_entry, lambda: new_entity().counter_entry)
        elif kind == "packet_replication_engine_entry":
            self.read_multicast_groups(
                multicast_entry(entity),
                lambda: new_entity().packet_replication_engine_entry.multicast_group_entry)
        elif kind == "register_entry":
            # Exactly like PI/BMv2 (p4lang/PI#376): registers cannot be read over P4Runtime.
            raise StateError(_Code.UNIMPLEMENTED, "Register reads are not supported yet")
        elif kind is None:
            raise invalid("the read request holds an empty entity")
        else:
            raise StateError(_Code.UNIMPLEMENTED, f"{kind} reads are not supported by this target")
        return added

    def read_table_entries(self, te: p4rt.TableEntry,
                           new: Callable[[], p4rt.TableEntry] = p4rt.TableEntry,
                           ) -> list[p4rt.TableEntry]:
        """Entries of one table (or all: table_id 0), a single one (match given), or the default."""
        if te.table_id == 0:
            if te.match or te.is_default_action:
                raise invalid("a read of all tables (table_id 0) cannot carry a match "
                               "or is_default_action")
            tables = list(self._tables.values())
        else:
            tables = [self._table_by_id(te.table_id)]
        out: list[p4rt.TableEntry] = []
        for table in tables:
            if te.is_default_action:
                out.append(fill_default_entry(new(), table))
                continue
            if te.match:
                found = table.get(parse_match(table.info, te), parse_priority(table.info, te.priority))
                entries = [found] if found else []
            else:
                entries = table.entries()
            out += [fill_entry(new(), table.info, e) for e in entries]
        return out

    def read_counter_entries(self, ce: p4rt.CounterEntry,
                             new: Callable[[], p4rt.CounterEntry] = p4rt.CounterEntry,
                             ) -> list[p4rt.CounterEntry]:
        """Cells of one counter (or all: counter_id 0); every index unless one is given."""
        infos = self.index.counters if ce.counter_id == 0 else (self._counter_info(ce.counter_id),)
        out: list[p4rt.CounterEntry] = []
        for info in infos:
            indices = ([check_counter_index(info, ce.index.index)] if ce.HasField("index")
                       else list(range(info.size)))
            packets, byte_counts = self.counter_sums(info.name)
            for i, p, b in zip(indices, packets[indices].tolist(), byte_counts[indices].tolist(),
                               strict=True):
                cell = new()
                cell.counter_id = info.id
                cell.index.index = i
                cell.data.packet_count = p
                cell.data.byte_count = b
                out.append(cell)
        return out

    def read_multicast_groups(self, mge: p4rt.MulticastGroupEntry,
                              new: Callable[[], p4rt.MulticastGroupEntry] = p4rt.MulticastGroupEntry,
                              ) -> list[p4rt.MulticastGroupEntry]:
        """One group (NOT_FOUND if absent) or all (id 0), replicas in the form they were written."""
        gid = check_group_id(mge.multicast_group_id, allow_zero=True)
        if gid == 0:
            gids = sorted(self.multicast_groups)
        elif gid in self.multicast_groups:
            gids = [gid]
        else:
            raise StateError(_Code.NOT_FOUND, f"multicast group {gid} does not exist")
        return [self._fill_group(new(), g) for g in gids]

    def _fill_group(self, entry: p4rt.MulticastGroupEntry, gid: int) -> p4rt.MulticastGroupEntry:
        entry.multicast_group_id = gid
        for (port, instance), form in zip(self.multicast_groups[gid], self._replica_forms[gid],
                                          strict=True):
            if form is None:
                entry.replicas.add(egress_port=port, instance=instance)
            else:
                entry.replicas.add(port=port.to_bytes(form, "big"), instance=instance)
        return entry
