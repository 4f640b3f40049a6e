"""P4Runtime entities from names and values: table entries, multicast groups, counters (no session needed).

Names (tables, fields, actions, params, counters) are resolved through the P4Info;
values are ints. A bad name or value raises ``P4RuntimeError`` INVALID_ARGUMENT ("(client) ...").

Match values in ``EntityBuilder.table_entry`` (and ``EntryOp``), by the field's match kind: exact and
optional ``int``; lpm ``(value, prefix_len)`` (or an int for a full-length prefix); ternary
``(value, mask)``; range ``(low, high)``. Fields left out are don't-care (not allowed for exact fields).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from p4.v1 import p4runtime_pb2 as p4rt

from netagg.controller.errors import P4RuntimeError, client_error
from netagg.p4info import MatchFieldInfo, P4InfoIndex, P4InfoLookupError, TableInfo, decode_int, encode_int

__all__ = ["UPDATE_TYPES", "EntityBuilder", "EntryOp", "MatchValue", "TableEntryView", "multicast_group_entity"]

MatchValue = int | tuple[int, int]


@dataclass(frozen=True, slots=True)
class TableEntryView:
    """A table entry as read back, decoded to names and ints."""

    table: str
    match: dict[str, MatchValue]
    action: str | None
    params: dict[str, int]
    priority: int = 0
    is_default_action: bool = False


@dataclass(frozen=True, slots=True)
class EntryOp:
    """One table-entry update (for ``P4RuntimeClient.write_entries``)."""

    kind: Literal["insert", "modify", "delete"]
    table: str
    match: Mapping[str, MatchValue]
    action: str | None = None
    params: Mapping[str, int] = field(default_factory=dict)
    priority: int = 0

    @classmethod
    def insert(cls, table: str, match: Mapping[str, MatchValue], action: str,
               params: Mapping[str, int] | None = None, priority: int = 0) -> EntryOp:
        return cls("insert", table, match, action, params or {}, priority)

    @classmethod
    def modify(cls, table: str, match: Mapping[str, MatchValue], action: str,
               params: Mapping[str, int] | None = None, priority: int = 0) -> EntryOp:
        return cls("modify", table, match, action, params or {}, priority)

    @classmethod
    def delete(cls, table: str, match: Mapping[str, MatchValue], priority: int = 0) -> EntryOp:
        return cls("delete", table, match, None, {}, priority)


#: EntryOp.kind -> the Update type.
UPDATE_TYPES = {"insert": p4rt.Update.INSERT, "modify": p4rt.Update.MODIFY, "delete": p4rt.Update.DELETE}


def multicast_group_entity(group_id: int, replicas: Iterable[tuple[int, int]] = ()) -> p4rt.Entity:
    """A multicast group with these (port, instance) replicas (group 0, no replicas: a read of all groups)."""
    # Ports go in the deprecated uint32 `egress_port`: every PI/BMv2 accepts it (the bytes
    # `port` needs PI from 2023 on, PI#598), and PI rejects port 0 given as bytes.
    group = p4rt.MulticastGroupEntry(multicast_group_id=group_id)
    for port, instance in replicas:
        group.replicas.add(egress_port=port, instance=instance)
    return p4rt.Entity(packet_replication_engine_entry=p4rt.PacketReplicationEngineEntry(
        multicast_group_entry=group))


class EntityBuilder:
    """Builds (and decodes) the entities of one P4 program, named through its P4Info."""

    def __init__(self, index: P4InfoIndex) -> None:
        self.index = index

    def table_entry(self, table: str, match: Mapping[str, MatchValue], action: str | None = None,
                    params: Mapping[str, int] | None = None, priority: int = 0,
                    into: p4rt.TableEntry | None = None) -> p4rt.TableEntry:
        """Build a TableEntry (in ``into`` if given) from names and ints.

        Checks names and widths only; the switch checks the rest.
        """
        entry = into if into is not None else p4rt.TableEntry()
        try:
            info = self.index.table(table)
            entry.table_id, entry.priority = info.id, priority
            for name, value in match.items():
                _add_field_match(entry, info, info.match_field(name), value)
            if action is not None:
                self._set_action(entry, info, action, params or {})
        except P4InfoLookupError as e:
            raise client_error(str(e)) from None
        return entry

    def table_read(self, table: str | None = None) -> p4rt.Entity:
        """The entity that reads every entry of one table (of every table without ``table``)."""
        try:
            table_id = self.index.table(table).id if table is not None else 0
        except P4InfoLookupError as e:
            raise client_error(str(e)) from None
        return p4rt.Entity(table_entry=p4rt.TableEntry(table_id=table_id))

    def counter_entity(self, name: str, index: int | None = None) -> p4rt.Entity:
        """A counter cell (every cell without ``index``), for a read."""
        try:
            entry = p4rt.CounterEntry(counter_id=self.index.counter(name).id)
        except P4InfoLookupError as e:
            raise client_error(str(e)) from None
        if index is not None:
            entry.index.CopyFrom(p4rt.Index(index=index))
        return p4rt.Entity(counter_entry=entry)

    def view(self, entry: p4rt.TableEntry) -> TableEntryView:
        """A table entry as read back, decoded to names and ints."""
        info = self.index.table(entry.table_id)
        match = {}
        for fm in entry.match:
            mf = info.match_field(fm.field_id)
            match[mf.name] = _decode_field(mf, fm)
        action, params = None, {}
        if entry.action.HasField("action"):
            action_info = self.index.action(entry.action.action.action_id)
            action = action_info.name
            params = {action_info.param(p.param_id).name: decode_int(p.value)
                      for p in entry.action.action.params}
        return TableEntryView(info.name, match, action, params, entry.priority,
                              entry.is_default_action)

    def _set_action(self, entry: p4rt.TableEntry, table: TableInfo, action: str,
                    params: Mapping[str, int]) -> None:
        info = self.index.action(action)
        if info.id not in table.action_scopes:
            raise client_error(f"action '{info.name}' is not an action of table '{table.name}'")
        entry.action.action.action_id = info.id
        for name, value in params.items():
            param = info.param(name)
            entry.action.action.params.add(param_id=param.id, value=_encode(
                value, param.bitwidth, f"action '{info.name}' param '{param.name}'"))


def _encode(value: int, bitwidth: int, what: str) -> bytes:
    try:
        return encode_int(value, bitwidth)
    except ValueError as e:
        raise client_error(f"{what}: {e}") from None


def _add_field_match(entry: p4rt.TableEntry, table: TableInfo, mf: MatchFieldInfo,
                     value: MatchValue) -> None:
    """Add the FieldMatch for a user value; nothing when it means don't-care (prefix 0, mask 0)."""
    what = f"table '{table.name}' field '{mf.name}'"
    kind, width = mf.match_kind, mf.bitwidth
    pair = isinstance(value, tuple)
    if (kind in ("exact", "optional") and pair) or (kind in ("ternary", "range") and not pair):
        raise client_error(f"{what} is {kind}: got {value!r}")
    if kind == "exact":
        entry.match.add(field_id=mf.id).exact.value = _encode(value, width, what)  # type: ignore[arg-type]
    elif kind == "optional":
        entry.match.add(field_id=mf.id).optional.value = _encode(value, width, what)  # type: ignore[arg-type]
    elif kind == "lpm":
        prefix, prefix_len = value if isinstance(value, tuple) else (value, width)
        if prefix_len:
            fm = entry.match.add(field_id=mf.id)
            fm.lpm.value, fm.lpm.prefix_len = _encode(prefix, width, what), prefix_len
    elif kind == "ternary":
        if value[1]:  # type: ignore[index]
            fm = entry.match.add(field_id=mf.id)
            fm.ternary.value = _encode(value[0], width, what)  # type: ignore[index]
            fm.ternary.mask = _encode(value[1], width, what)  # type: ignore[index]
    elif kind == "range":
        fm = entry.match.add(field_id=mf.id)
        fm.range.low = _encode(value[0], width, what)  # type: ignore[index]
        fm.range.high = _encode(value[1], width, what)  # type: ignore[index]
    else:
        raise client_error(f"{what}: match kind {kind!r} is not supported")


def _decode_field(mf: MatchFieldInfo, fm: p4rt.FieldMatch) -> MatchValue:
    kind = fm.WhichOneof("field_match_type")
    if kind == "exact":
        return decode_int(fm.exact.value)
    if kind == "optional":
        return decode_int(fm.optional.value)
    if kind == "lpm":
        return decode_int(fm.lpm.value), fm.lpm.prefix_len
    if kind == "ternary":
        return decode_int(fm.ternary.value), decode_int(fm.ternary.mask)
    if kind == "range":
        return decode_int(fm.range.low), decode_int(fm.range.high)
    raise P4RuntimeError("INTERNAL", f"field '{mf.name}': unsupported match {kind!r} in a read")

