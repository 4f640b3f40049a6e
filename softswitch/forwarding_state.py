"""The software target's control-plane-visible state: tables, counters, multicast groups.

No packet logic lives here. The packet pipeline reads the state (``table(...).lookup``,
``count``, ``multicast_groups``) while holding ``lock``; the P4Runtime server mutates
it, also under ``lock``, through ``apply_update`` and reads it through ``read``.
Every method that takes P4Runtime messages validates them the way P4Runtime 1.3
and PI/BMv2 do and raises ``StateError`` (a gRPC code and a precise message).

Methods do not take ``lock`` themselves: callers hold it.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from p4.v1 import p4runtime_pb2 as p4rt

from netagg.p4info import (
    ActionInfo,
    CounterInfo,
    MatchFieldInfo,
    P4InfoIndex,
    P4InfoLookupError,
    TableInfo,
    decode_int,
    encode_int,
)

__all__ = [
    "MAX_MULTICAST_GROUP_ID",
    "MAX_REPLICA_INSTANCE",
    "ExactTable",
    "ForwardingState",
    "LookupResult",
    "LpmTable",
    "StateError",
    "Table",
    "TableEntryRecord",
    "TernaryTable",
]

#: (full action name, params in P4Info order): what a table lookup yields.
LookupResult = tuple[str, tuple[int, ...]]
#: Multicast group ids must be below this (PI reserves [2**15, ...) for clone sessions).
MAX_MULTICAST_GROUP_ID = 1 << 15
#: v1model's egress_rid is 16 bits wide.
MAX_REPLICA_INSTANCE = 0xFFFF

_Code = grpc.StatusCode
_INSERT, _MODIFY, _DELETE = p4rt.Update.INSERT, p4rt.Update.MODIFY, p4rt.Update.DELETE


class StateError(Exception):
    """A P4Runtime failure: the gRPC status code to answer and a precise message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


def _invalid(message: str) -> StateError:
    return StateError(_Code.INVALID_ARGUMENT, message)


# --------------------------------------------------------------------------- tables

#: Where ``read`` adds entities (``ReadResponse.entities``).
RepeatedEntities = Any

#: A normalised match key: per field (P4Info order) exact -> int, lpm -> (value, prefix_len),
#: ternary -> (value, mask), range -> (low, high), optional -> int or None (wildcard).
MatchKey = tuple[object, ...]


@dataclass(frozen=True, slots=True)
class TableEntryRecord:
    """One installed table entry (immutable; MODIFY replaces the record)."""

    key: MatchKey
    priority: int
    action: ActionInfo
    params: tuple[int, ...]
    result: LookupResult
    controller_metadata: int
    metadata: bytes
    seq: int


def _prefix_mask(bitwidth: int, prefix_len: int) -> int:
    return ((1 << prefix_len) - 1) << (bitwidth - prefix_len)


class Table:
    """A table's entries and default action; subclasses index them for ``lookup``."""

    def __init__(self, info: TableInfo, default_action: ActionInfo | None) -> None:
        self.info = info
        self.name = info.name
        self._entries: dict[tuple[MatchKey, int], TableEntryRecord] = {}
        self._initial_default_action = default_action
        self.default_action: ActionInfo | None = default_action
        self.default_params: tuple[int, ...] = ()
        self._default: LookupResult = (default_action.name if default_action else "NoAction", ())

    def lookup(self, key: tuple[int, ...]) -> LookupResult:
        """The (action name, params) for a packet's key (ints in P4Info field order)."""
        raise NotImplementedError

    @property
    def default(self) -> LookupResult:
        """What a miss yields."""
        return self._default

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[TableEntryRecord]:
        """The installed entries, in insertion order."""
        return list(self._entries.values())

    def get(self, key: MatchKey, priority: int) -> TableEntryRecord | None:
        """The entry with exactly this normalised key and priority, if any."""
        return self._entries.get((key, priority))

    # Mutations: only ForwardingState calls these (it validates first).
    def put(self, entry: TableEntryRecord) -> None:
        """Insert, or replace the entry with the same key and priority."""
        self._entries[(entry.key, entry.priority)] = entry

    def remove(self, entry: TableEntryRecord) -> None:
        del self._entries[(entry.key, entry.priority)]

    def clear(self) -> None:
        self._entries.clear()
        self.reset_default()

    def reset_default(self) -> None:
        """Back to the program's default action."""
        self.set_default(self._initial_default_action, ())

    def set_default(self, action: ActionInfo | None, params: tuple[int, ...]) -> None:
        self.default_action, self.default_params = action, params
        self._default = (action.name if action else "NoAction", params)


class ExactTable(Table):
    """Only exact fields: one dict lookup."""

    def __init__(self, info: TableInfo, default_action: ActionInfo | None) -> None:
        super().__init__(info, default_action)
        self._index: dict[MatchKey, LookupResult] = {}

    def lookup(self, key: tuple[int, ...]) -> LookupResult:
        return self._index.get(key, self._default)

    def put(self, entry: TableEntryRecord) -> None:
        super().put(entry)
        self._index[entry.key] = entry.result

    def remove(self, entry: TableEntryRecord) -> None:
        super().remove(entry)
        del self._index[entry.key]

    def clear(self) -> None:
        super().clear()
        self._index.clear()


class LpmTable(Table):
    """One LPM field plus exact fields: one dict per prefix length, longest first."""

    def __init__(self, info: TableInfo, default_action: ActionInfo | None) -> None:
        super().__init__(info, default_action)
        (self._pos,) = [i for i, mf in enumerate(info.match_fields) if mf.match_kind == "lpm"]
        self._width = info.match_fields[self._pos].bitwidth
        self._single = len(info.match_fields) == 1
        self._by_len: dict[int, dict[MatchKey, LookupResult]] = {}
        self._levels: list[tuple[dict[MatchKey, LookupResult], int]] = []

    def lookup(self, key: tuple[int, ...]) -> LookupResult:
        if self._single:
            value = key[0]
            for by_value, mask in self._levels:
                found = by_value.get((value & mask,))
                if found is not None:
                    return found
            return self._default
        pos = self._pos
        head, tail, value = key[:pos], key[pos + 1:], key[pos]
        for by_value, mask in self._levels:
            found = by_value.get((*head, value & mask, *tail))
            if found is not None:
                return found
        return self._default

    def _split(self, entry: TableEntryRecord) -> tuple[int, MatchKey]:
        value, prefix_len = entry.key[self._pos]  # type: ignore[misc]
        return prefix_len, (*entry.key[:self._pos], value, *entry.key[self._pos + 1:])

    def _relevel(self) -> None:
        self._levels = [(self._by_len[n], _prefix_mask(self._width, n))
                        for n in sorted(self._by_len, reverse=True)]

    def put(self, entry: TableEntryRecord) -> None:
        super().put(entry)
        prefix_len, key = self._split(entry)
        if prefix_len not in self._by_len:
            self._by_len[prefix_len] = {}
            self._relevel()
        self._by_len[prefix_len][key] = entry.result

    def remove(self, entry: TableEntryRecord) -> None:
        super().remove(entry)
        prefix_len, key = self._split(entry)
        level = self._by_len[prefix_len]
        del level[key]
        if not level:
            del self._by_len[prefix_len]
            self._relevel()

    def clear(self) -> None:
        super().clear()
        self._by_len.clear()
        self._levels = []


_Rule = tuple[tuple[int, int], tuple[tuple[int, int, int], ...], tuple[tuple[int, int, int], ...],
              LookupResult]


class TernaryTable(Table):
    """Ternary / range / optional (and anything mixed): highest priority wins, first inserted on ties."""

    def __init__(self, info: TableInfo, default_action: ActionInfo | None) -> None:
        super().__init__(info, default_action)
        self._rules: list[_Rule] = []  # sorted by (-priority, seq)

    def lookup(self, key: tuple[int, ...]) -> LookupResult:
        for _, masks, ranges, result in self._rules:
            for i, mask, value in masks:
                if key[i] & mask != value:
                    break
            else:
                for i, low, high in ranges:
                    if not low <= key[i] <= high:
                        break
                else:
                    return result
        return self._default

    def _compile(self, entry: TableEntryRecord) -> _Rule:
        masks: list[tuple[int, int, int]] = []
        ranges: list[tuple[int, int, int]] = []
        for i, (mf, v) in enumerate(zip(self.info.match_fields, entry.key, strict=True)):
            full = (1 << mf.bitwidth) - 1
            if mf.match_kind == "exact" or (mf.match_kind == "optional" and v is not None):
                masks.append((i, full, v))  # type: ignore[arg-type]
            elif mf.match_kind == "lpm" and v[1]:  # type: ignore[index]
                masks.append((i, _prefix_mask(mf.bitwidth, v[1]), v[0]))  # type: ignore[index]
            elif mf.match_kind == "ternary" and v[1]:  # type: ignore[index]
                masks.append((i, v[1], v[0]))  # type: ignore[index]
            elif mf.match_kind == "range" and v != (0, full):
                ranges.append((i, *v))  # type: ignore[misc]
        return ((-entry.priority, entry.seq), tuple(masks), tuple(ranges), entry.result)

    def _position(self, entry: TableEntryRecord) -> int:
        return bisect.bisect_left(self._rules, ((-entry.priority, entry.seq),))  # type: ignore[arg-type]

    def put(self, entry: TableEntryRecord) -> None:
        old = self.get(entry.key, entry.priority)
        if old is not None:
            del self._rules[self._position(old)]
        super().put(entry)
        bisect.insort(self._rules, self._compile(entry))

    def remove(self, entry: TableEntryRecord) -> None:
        super().remove(entry)
        del self._rules[self._position(entry)]

    def clear(self) -> None:
        super().clear()
        self._rules.clear()


def _make_table(info: TableInfo, index: P4InfoIndex) -> Table:
    default = _initial_default_action(info, index)
    kinds = [mf.match_kind for mf in info.match_fields]
    if all(k == "exact" for k in kinds):
        return ExactTable(info, default)
    if kinds.count("lpm") == 1 and all(k in ("exact", "lpm") for k in kinds):
        return LpmTable(info, default)
    return TernaryTable(info, default)


def _initial_default_action(info: TableInfo, index: P4InfoIndex) -> ActionInfo | None:
    """The const default action; else NoAction if the table lists it (P4Info has no other clue)."""
    if info.const_default_action_id:
        return index.action(info.const_default_action_id)
    for action_id in info.action_scopes:
        action = index.action(action_id)
        if action.name == "NoAction":
            return action
    return None


# --------------------------------------------------------------------------- match / action parsing


def _value(data: bytes, bitwidth: int, what: str) -> int:
    """Decode a byte string that must fit ``bitwidth`` bits (canonical or padded)."""
    if not data:
        raise _invalid(f"{what}: empty byte string")
    value = decode_int(data)
    if value >> bitwidth:
        raise _invalid(f"{what}: value {value:#x} does not fit in {bitwidth} bits")
    return value


def _field_what(info: TableInfo, mf: MatchFieldInfo) -> str:
    return f"table '{info.name}' match field '{mf.name}' ({mf.match_kind}, {mf.bitwidth} bits)"


def _dont_care(mf: MatchFieldInfo) -> object:
    return {"lpm": (0, 0), "ternary": (0, 0), "optional": None,
            "range": (0, (1 << mf.bitwidth) - 1)}[mf.match_kind]


def _parse_lpm(fm: p4rt.FieldMatch, mf: MatchFieldInfo, what: str) -> tuple[int, int]:
    value = _value(fm.lpm.value, mf.bitwidth, what)
    prefix_len = fm.lpm.prefix_len
    if not 0 < prefix_len <= mf.bitwidth:
        hint = " (omit the field for a don't-care match)" if prefix_len == 0 else ""
        raise _invalid(f"{what}: prefix length {prefix_len} is not in 1..{mf.bitwidth}{hint}")
    if value & ~_prefix_mask(mf.bitwidth, prefix_len):
        raise _invalid(f"{what}: value {value:#x} has bits set beyond the prefix length {prefix_len}")
    return value, prefix_len


def _parse_ternary(fm: p4rt.FieldMatch, mf: MatchFieldInfo, what: str) -> tuple[int, int]:
    value = _value(fm.ternary.value, mf.bitwidth, what)
    mask = _value(fm.ternary.mask, mf.bitwidth, f"{what} mask")
    if mask == 0:
        raise _invalid(f"{what}: mask 0 (omit the field for a don't-care match)")
    if value & ~mask:
        raise _invalid(f"{what}: value {value:#x} has bits set outside mask {mask:#x}")
    return value, mask


def _parse_range(fm: p4rt.FieldMatch, mf: MatchFieldInfo, what: str) -> tuple[int, int]:
    low = _value(fm.range.low, mf.bitwidth, f"{what} low")
    high = _value(fm.range.high, mf.bitwidth, f"{what} high")
    if low > high:
        raise _invalid(f"{what}: low {low:#x} > high {high:#x}")
    if (low, high) == (0, (1 << mf.bitwidth) - 1):
        raise _invalid(f"{what}: full range (omit the field for a don't-care match)")
    return low, high


def _parse_field(info: TableInfo, mf: MatchFieldInfo, fm: p4rt.FieldMatch | None) -> object:
    what = _field_what(info, mf)
    kind = mf.match_kind
    if kind not in ("exact", "lpm", "ternary", "range", "optional"):
        raise StateError(_Code.UNIMPLEMENTED, f"{what}: match kind {kind!r} is not supported")
    if fm is None:
        if kind == "exact":
            raise _invalid(f"{what} is missing (exact fields are mandatory)")
        return _dont_care(mf)
    given = fm.WhichOneof("field_match_type")
    if given != kind:
        raise _invalid(f"{what}: got a {given or 'empty'} match")
    if kind == "exact":
        return _value(fm.exact.value, mf.bitwidth, what)
    if kind == "optional":
        return _value(fm.optional.value, mf.bitwidth, what)
    return {"lpm": _parse_lpm, "ternary": _parse_ternary, "range": _parse_range}[kind](fm, mf, what)


def _parse_match(info: TableInfo, te: p4rt.TableEntry) -> MatchKey:
    given: dict[int, p4rt.FieldMatch] = {}
    for fm in te.match:
        if fm.field_id in given:
            raise _invalid(f"table '{info.name}': match field id {fm.field_id} is given twice")
        try:
            info.match_field(fm.field_id)
        except P4InfoLookupError:
            raise _invalid(f"table '{info.name}' has no match field with id {fm.field_id}") from None
        given[fm.field_id] = fm
    return tuple(_parse_field(info, mf, given.get(mf.id)) for mf in info.match_fields)


def _parse_priority(info: TableInfo, priority: int) -> int:
    if info.needs_priority and priority <= 0:
        raise _invalid(f"table '{info.name}' has ternary/range/optional fields: "
                       f"entries need a priority > 0, got {priority}")
    if not info.needs_priority and priority != 0:
        raise _invalid(f"table '{info.name}' has no ternary/range/optional field: "
                       f"priority must be 0, got {priority}")
    return priority


def _describe_key(info: TableInfo, key: MatchKey) -> str:
    parts = []
    for mf, v in zip(info.match_fields, key, strict=True):
        if mf.match_kind != "exact" and v == _dont_care(mf):
            continue
        if mf.match_kind == "lpm":
            parts.append(f"{mf.name}={v[0]:#x}/{v[1]}")  # type: ignore[index]
        elif mf.match_kind == "ternary":
            parts.append(f"{mf.name}={v[0]:#x}&&&{v[1]:#x}")  # type: ignore[index]
        elif mf.match_kind == "range":
            parts.append(f"{mf.name}={v[0]:#x}..{v[1]:#x}")  # type: ignore[index]
        else:
            parts.append(f"{mf.name}={v:#x}")
    return "{" + ", ".join(parts) + "}"


def _add_field_match(te: p4rt.TableEntry, mf: MatchFieldInfo, v: object) -> None:
    """Add the canonical FieldMatch for a normalised value (nothing for don't-care)."""
    kind, width = mf.match_kind, mf.bitwidth
    if kind != "exact" and v == _dont_care(mf):
        return
    fm = te.match.add(field_id=mf.id)
    if kind == "exact":
        fm.exact.value = encode_int(v, width)  # type: ignore[arg-type]
    elif kind == "optional":
        fm.optional.value = encode_int(v, width)  # type: ignore[arg-type]
    elif kind == "lpm":
        fm.lpm.value, fm.lpm.prefix_len = encode_int(v[0], width), v[1]  # type: ignore[index]
    elif kind == "ternary":
        fm.ternary.value, fm.ternary.mask = encode_int(v[0], width), encode_int(v[1], width)  # type: ignore[index]
    else:
        fm.range.low, fm.range.high = encode_int(v[0], width), encode_int(v[1], width)  # type: ignore[index]


# --------------------------------------------------------------------------- the state


class ForwardingState:
    """Tables, counters and multicast groups of one pipeline, sized from its P4Info.

    ``lock`` is held by the packet pipeline for each packet and by the P4Runtime
    server for each Write (and while reading). Table objects returned by
    ``table()`` stay valid across ``reset()``.
    """

    def __init__(self, index: P4InfoIndex) -> None:
        self.index = index
        self.lock = threading.Lock()
        #: Set by the P4Runtime server once a pipeline is committed; False after reset().
        self.configured = False
        self._tables = {info.name: _make_table(info, index) for info in index.tables}
        self._tables_by_id = {t.info.id: t for t in self._tables.values()}
        self._counters = {c.name: (np.zeros(c.size, np.int64), np.zeros(c.size, np.int64))
                          for c in index.counters}
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
        packets, byte_counts = self._counter_arrays(counter)
        if not 0 <= index < packets.shape[0]:
            raise IndexError(f"counter {counter!r} has {packets.shape[0]} cells, no index {index}")
        return int(packets[index]), int(byte_counts[index])

    def counter_total(self, counter: str | int) -> int:
        """Packets counted over all cells of ``counter``."""
        return int(self._counter_arrays(counter)[0].sum())

    def _counter_arrays(self, counter: str | int) -> tuple[np.ndarray, np.ndarray]:
        return self._counters[self.index.counter(counter).name]

    def counter_arrays(self, counter: str | int) -> tuple[np.ndarray, np.ndarray]:
        """The (packets, bytes) arrays of ``counter`` themselves (compiled pipelines count into them)."""
        return self._counter_arrays(counter)

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
        for packets, byte_counts in self._counters.values():
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
            raise _invalid(f"update type {update.type} is not INSERT, MODIFY or DELETE")
        self.version += 1
        entity = update.entity
        kind = entity.WhichOneof("entity")
        if kind == "table_entry":
            self.write_table_entry(update.type, entity.table_entry)
        elif kind == "packet_replication_engine_entry":
            self.write_multicast_group(update.type, _multicast_entry(entity))
        elif kind == "counter_entry":
            self.write_counter_entry(update.type, entity.counter_entry)
        elif kind == "register_entry":
            # Exactly like PI/BMv2 (p4lang/PI#376).
            raise StateError(_Code.UNIMPLEMENTED, "Register writes are not supported yet")
        elif kind is None:
            raise _invalid("the update carries no entity")
        else:
            raise StateError(_Code.UNIMPLEMENTED, f"{kind} writes are not supported by this target")

    def write_table_entry(self, update_type: int, te: p4rt.TableEntry) -> None:
        """INSERT / MODIFY / DELETE one table entry (or MODIFY the default entry)."""
        table = self._table_by_id(te.table_id)
        if te.HasField("time_since_last_hit"):
            raise _invalid(f"table '{table.name}': time_since_last_hit must not be set in a Write")
        if update_type == _INSERT:
            self._insert(table, te)
        elif update_type == _MODIFY:
            self._modify(table, te)
        else:
            self._delete(table, te)

    def _table_by_id(self, table_id: int) -> Table:
        table = self._tables_by_id.get(table_id)
        if table is None:
            raise _invalid(f"the P4Info has no table with id {table_id:#x}")
        return table

    def _check_not_const(self, table: Table) -> None:
        if table.info.is_const_table:
            raise StateError(_Code.PERMISSION_DENIED,
                             f"table '{table.name}' is const: its entries cannot be changed")

    def _check_extras(self, table: Table, te: p4rt.TableEntry) -> None:
        if te.idle_timeout_ns and not table.info.supports_idle_timeout:
            raise _invalid(f"table '{table.name}' does not support idle timeout: "
                           f"idle_timeout_ns must be 0")
        for field in ("meter_config", "counter_data", "meter_counter_data"):
            if te.HasField(field):
                raise _invalid(f"table '{table.name}': {field} given, but this target supports "
                               f"no direct resources")

    def _parse_action(self, table: Table, te: p4rt.TableEntry, *, default_entry: bool,
                      ) -> tuple[ActionInfo, tuple[int, ...]]:
        kind = te.action.WhichOneof("type")
        if kind != "action":
            raise _invalid(f"table '{table.name}' is a direct table: its entries need an Action, "
                           f"got {kind or 'no action'}")
        proto = te.action.action
        try:
            action = self.index.action(proto.action_id)
        except P4InfoLookupError:
            raise _invalid(f"the P4Info has no action with id {proto.action_id:#x}") from None
        scope = table.info.action_scopes.get(action.id)
        if scope is None:
            raise _invalid(f"action '{action.name}' is not an action of table '{table.name}'")
        if scope == "default_only" and not default_entry:
            raise StateError(_Code.PERMISSION_DENIED, f"action '{action.name}' is @defaultonly in "
                             f"table '{table.name}': it cannot be used in a table entry")
        if scope == "table_only" and default_entry:
            raise StateError(_Code.PERMISSION_DENIED, f"action '{action.name}' is @tableonly in "
                             f"table '{table.name}': it cannot be the default action")
        return action, _parse_params(action, proto.params)

    def _entry_record(self, table: Table, te: p4rt.TableEntry, seq: int | None = None,
                      ) -> TableEntryRecord:
        key = _parse_match(table.info, te)
        priority = _parse_priority(table.info, te.priority)
        if not te.HasField("action"):
            raise _invalid(f"table '{table.name}': the entry {_describe_key(table.info, key)} "
                           f"needs an action")
        action, params = self._parse_action(table, te, default_entry=False)
        self._check_extras(table, te)
        return TableEntryRecord(
            key=key, priority=priority, action=action, params=params, result=(action.name, params),
            controller_metadata=te.controller_metadata, metadata=te.metadata,
            seq=next(self._seq) if seq is None else seq)

    def _insert(self, table: Table, te: p4rt.TableEntry) -> None:
        if te.is_default_action:
            raise _invalid(f"table '{table.name}': the default entry cannot be INSERTed, use MODIFY")
        self._check_not_const(table)
        entry = self._entry_record(table, te)
        if table.get(entry.key, entry.priority) is not None:
            raise StateError(_Code.ALREADY_EXISTS, f"table '{table.name}': an entry with match "
                             f"{_describe_key(table.info, entry.key)} already exists (use MODIFY)")
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
        key = _parse_match(table.info, te)
        old = table.get(key, _parse_priority(table.info, te.priority))
        entry = self._entry_record(table, te, seq=old.seq if old else -1)
        if old is None:
            raise StateError(_Code.NOT_FOUND, f"table '{table.name}': no entry with match "
                             f"{_describe_key(table.info, key)} to MODIFY")
        table.put(entry)

    def _modify_default(self, table: Table, te: p4rt.TableEntry) -> None:
        if te.match or te.priority:
            raise _invalid(f"table '{table.name}': the default entry has no match and priority 0")
        const_id = table.info.const_default_action_id
        if const_id:
            raise StateError(_Code.PERMISSION_DENIED, f"table '{table.name}' has a const default "
                             f"action ('{self.index.action(const_id).name}'): it cannot be modified")
        if te.HasField("action"):
            table.set_default(*self._parse_action(table, te, default_entry=True))
        else:
            table.reset_default()

    def _delete(self, table: Table, te: p4rt.TableEntry) -> None:
        if te.is_default_action:
            raise _invalid(f"table '{table.name}': the default entry cannot be DELETEd")
        self._check_not_const(table)
        key = _parse_match(table.info, te)
        old = table.get(key, _parse_priority(table.info, te.priority))
        if old is None:
            raise StateError(_Code.NOT_FOUND, f"table '{table.name}': no entry with match "
                             f"{_describe_key(table.info, key)} to DELETE")
        table.remove(old)

    def write_multicast_group(self, update_type: int, mge: p4rt.MulticastGroupEntry) -> None:
        """INSERT / MODIFY / DELETE one multicast group (PI's checks and codes)."""
        gid = _check_group_id(mge.multicast_group_id, allow_zero=False)
        exists = gid in self.multicast_groups
        if update_type == _INSERT and exists:
            raise StateError(_Code.ALREADY_EXISTS, f"multicast group {gid} already exists")
        if update_type != _INSERT and not exists:
            raise StateError(_Code.NOT_FOUND, f"multicast group {gid} does not exist")
        if update_type == _DELETE:
            del self.multicast_groups[gid]
            del self._replica_forms[gid]
            return
        replicas, forms = _parse_replicas(gid, mge.replicas)
        self.multicast_groups[gid] = replicas
        self._replica_forms[gid] = forms

    def write_counter_entry(self, update_type: int, ce: p4rt.CounterEntry) -> None:
        """MODIFY sets one cell (units from P4Info); DELETE zeroes it (as PI); INSERT is invalid."""
        info = self._counter_info(ce.counter_id)
        if not ce.HasField("index"):
            raise StateError(_Code.UNIMPLEMENTED,
                             f"counter '{info.name}': wildcard writes (no index) are not supported")
        index = _check_counter_index(info, ce.index.index)
        if update_type == _INSERT:
            raise _invalid(f"counter '{info.name}': INSERT is not supported for counters, use MODIFY")
        packets, byte_counts = self._counters[info.name]
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
            raise _invalid(f"the P4Info has no counter with id {counter_id:#x}") from None

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
                _multicast_entry(entity),
                lambda: new_entity().packet_replication_engine_entry.multicast_group_entry)
        elif kind == "register_entry":
            # Exactly like PI/BMv2 (p4lang/PI#376): registers cannot be read over P4Runtime.
            raise StateError(_Code.UNIMPLEMENTED, "Register reads are not supported yet")
        elif kind is None:
            raise _invalid("the read request holds an empty entity")
        else:
            raise StateError(_Code.UNIMPLEMENTED, f"{kind} reads are not supported by this target")
        return added

    def read_table_entries(self, te: p4rt.TableEntry,
                           new: Callable[[], p4rt.TableEntry] = p4rt.TableEntry,
                           ) -> list[p4rt.TableEntry]:
        """Entries of one table (or all: table_id 0), a single one (match given), or the default."""
        if te.table_id == 0:
            if te.match or te.is_default_action:
                raise _invalid("a read of all tables (table_id 0) cannot carry a match "
                               "or is_default_action")
            tables = list(self._tables.values())
        else:
            tables = [self._table_by_id(te.table_id)]
        out: list[p4rt.TableEntry] = []
        for table in tables:
            if te.is_default_action:
                out.append(_fill_default_entry(new(), table))
                continue
            if te.match:
                found = table.get(_parse_match(table.info, te), _parse_priority(table.info, te.priority))
                entries = [found] if found else []
            else:
                entries = table.entries()
            out += [_fill_entry(new(), table.info, e) for e in entries]
        return out

    def read_counter_entries(self, ce: p4rt.CounterEntry,
                             new: Callable[[], p4rt.CounterEntry] = p4rt.CounterEntry,
                             ) -> list[p4rt.CounterEntry]:
        """Cells of one counter (or all: counter_id 0); every index unless one is given."""
        infos = self.index.counters if ce.counter_id == 0 else (self._counter_info(ce.counter_id),)
        out: list[p4rt.CounterEntry] = []
        for info in infos:
            indices = ([_check_counter_index(info, ce.index.index)] if ce.HasField("index")
                       else list(range(info.size)))
            packets, byte_counts = self._counters[info.name]
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
        gid = _check_group_id(mge.multicast_group_id, allow_zero=True)
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


def _fill_entry(te: p4rt.TableEntry, info: TableInfo, e: TableEntryRecord) -> p4rt.TableEntry:
    te.table_id = info.id
    te.priority = e.priority
    te.controller_metadata = e.controller_metadata
    te.metadata = e.metadata
    for mf, v in zip(info.match_fields, e.key, strict=True):
        _add_field_match(te, mf, v)
    _set_action(te, e.action, e.params)
    return te


def _fill_default_entry(te: p4rt.TableEntry, table: Table) -> p4rt.TableEntry:
    te.table_id = table.info.id
    te.is_default_action = True
    if table.default_action is not None:
        _set_action(te, table.default_action, table.default_params)
    return te


# --------------------------------------------------------------------------- helpers


def _check_counter_index(info: CounterInfo, index: int) -> int:
    if index < 0:
        raise _invalid(f"counter '{info.name}': negative index {index}")
    if index >= info.size:
        raise StateError(_Code.OUT_OF_RANGE,
                         f"counter '{info.name}' has {info.size} cells, no index {index}")
    return index


def _parse_params(action: ActionInfo, params: Iterable[p4rt.Action.Param]) -> tuple[int, ...]:
    values: dict[int, int] = {}
    for p in params:
        try:
            info = action.param(p.param_id)
        except P4InfoLookupError:
            raise _invalid(f"action '{action.name}' has no parameter with id {p.param_id}") from None
        if p.param_id in values:
            raise _invalid(f"action '{action.name}': parameter '{info.name}' is given twice")
        values[p.param_id] = _value(p.value, info.bitwidth,
                                    f"action '{action.name}' parameter '{info.name}' "
                                    f"({info.bitwidth} bits)")
    missing = [p.name for p in action.params if p.id not in values]
    if missing:
        raise _invalid(f"action '{action.name}': missing parameter(s) {', '.join(missing)}")
    return tuple(values[p.id] for p in action.params)


def _set_action(te: p4rt.TableEntry, action: ActionInfo, params: tuple[int, ...]) -> None:
    te.action.action.action_id = action.id
    for info, value in zip(action.params, params, strict=True):
        te.action.action.params.add(param_id=info.id, value=encode_int(value, info.bitwidth))


def _multicast_entry(entity: p4rt.Entity) -> p4rt.MulticastGroupEntry:
    pre = entity.packet_replication_engine_entry
    kind = pre.WhichOneof("type")
    if kind == "multicast_group_entry":
        return pre.multicast_group_entry
    if kind == "clone_session_entry":
        raise StateError(_Code.UNIMPLEMENTED, "clone sessions are not supported by this target")
    raise _invalid("PacketReplicationEngineEntry holds neither a multicast group nor a clone session")


def _check_group_id(gid: int, *, allow_zero: bool) -> int:
    if gid == 0 and not allow_zero:
        raise _invalid("0 is not a valid multicast group id")
    if gid >= MAX_MULTICAST_GROUP_ID:
        raise StateError(_Code.OUT_OF_RANGE, f"multicast group id {gid} is too high "
                         f"(ids must be below {MAX_MULTICAST_GROUP_ID}, as in PI)")
    return gid


def _replica_port(gid: int, n: int, replica: p4rt.Replica) -> tuple[int, int | None]:
    """(port, form): form None for the deprecated uint32 egress_port, else the byte length.

    Mirrors PI's GetReplicaPort / bytestring_to_pi_port (proto/frontend/src/pre_mc_mgr.cpp
    and common.cpp since p4lang/PI#598): an empty `port` is INVALID_ARGUMENT, more than
    4 bytes UNIMPLEMENTED, and a value that is not > 0 as an int32 INVALID_ARGUMENT (so
    port 0 can only be written as egress_port).
    """
    what = f"multicast group {gid} replica #{n}"
    kind = replica.WhichOneof("port_kind")
    if kind == "egress_port":
        return replica.egress_port, None
    if kind != "port":
        raise _invalid(f"{what}: no port (set `port` or the deprecated `egress_port`)")
    if not replica.port:
        raise _invalid(f"{what}: port must not be the empty string")
    if len(replica.port) > 4:
        raise StateError(_Code.UNIMPLEMENTED,
                         f"{what}: port of {len(replica.port)} bytes, only 4 bytes are supported")
    port = decode_int(replica.port)
    if not 0 < port < 1 << 31:
        raise _invalid(f"{what}: port {port} must be positive (as a 32-bit signed int)")
    return port, len(replica.port)


def _parse_replicas(gid: int, replicas: Iterable[p4rt.Replica],
                    ) -> tuple[list[tuple[int, int]], list[int | None]]:
    ports: list[tuple[int, int]] = []
    forms: list[int | None] = []
    seen: set[tuple[int, int]] = set()
    for n, replica in enumerate(replicas):
        port, form = _replica_port(gid, n, replica)
        if replica.instance > MAX_REPLICA_INSTANCE:
            raise _invalid(f"multicast group {gid} replica #{n}: instance {replica.instance} does "
                           f"not fit v1model's 16-bit egress_rid")
        if (port, replica.instance) in seen:
            raise _invalid(f"multicast group {gid}: duplicate replica (port {port}, "
                           f"instance {replica.instance})")
        seen.add((port, replica.instance))
        ports.append((port, replica.instance))
        forms.append(form)
    return ports, forms
