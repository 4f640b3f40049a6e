"""P4Info index shared by the P4Runtime client and the software target's server.

``P4InfoIndex`` answers "what is table X / action Y / counter Z" by fully
qualified name, by unique alias or by id; ``encode_int``/``decode_int`` convert
between ints and P4Runtime byte strings; ``p4info_differences`` tells whether
two P4Infos describe the same pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from google.protobuf import text_format
from p4.config.v1 import p4info_pb2

__all__ = [
    "ActionInfo",
    "CounterInfo",
    "MatchFieldInfo",
    "P4InfoIndex",
    "P4InfoLookupError",
    "ParamInfo",
    "RegisterInfo",
    "TableInfo",
    "decode_int",
    "encode_int",
    "load_p4info",
    "p4info_differences",
    "same_pipeline",
]


class P4InfoLookupError(KeyError):
    """A name or id that the P4Info does not know (a ``KeyError`` with a readable message)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown P4Info object"


def load_p4info(path: str | Path) -> p4info_pb2.P4Info:
    """Parse a P4Info text-format file (``*.p4info.txtpb``)."""
    p4info = p4info_pb2.P4Info()
    text_format.Parse(Path(path).read_text(), p4info)
    return p4info


# --------------------------------------------------------------------------- byte strings


def encode_int(value: int, bitwidth: int) -> bytes:
    """Encode ``value`` as a P4Runtime 1.3 canonical byte string.

    Shortest big-endian form, ``b"\\x00"`` for zero. Raises ``ValueError`` if the
    value is negative or needs more than ``bitwidth`` bits.
    """
    if bitwidth <= 0:
        raise ValueError(f"bitwidth must be positive, got {bitwidth}")
    if value < 0 or value >> bitwidth:
        raise ValueError(f"value {value} does not fit in {bitwidth} bits")
    return value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")


def decode_int(data: bytes) -> int:
    """Decode a P4Runtime byte string (canonical or zero-padded) as an unsigned int."""
    if not data:
        raise ValueError("empty byte string is not a valid P4Runtime value")
    return int.from_bytes(data, "big")


# --------------------------------------------------------------------------- info records

_MATCH_KINDS = {
    p4info_pb2.MatchField.EXACT: "exact",
    p4info_pb2.MatchField.LPM: "lpm",
    p4info_pb2.MatchField.TERNARY: "ternary",
    p4info_pb2.MatchField.RANGE: "range",
    p4info_pb2.MatchField.OPTIONAL: "optional",
}
#: Match kinds that make a table need a priority (P4Runtime 1.3, section 9.1.1).
PRIORITY_MATCH_KINDS = frozenset({"ternary", "range", "optional"})

_SCOPES = {
    p4info_pb2.ActionRef.TABLE_AND_DEFAULT: "table_and_default",
    p4info_pb2.ActionRef.TABLE_ONLY: "table_only",
    p4info_pb2.ActionRef.DEFAULT_ONLY: "default_only",
}

_COUNTER_UNITS = {
    p4info_pb2.CounterSpec.UNSPECIFIED: "unspecified",
    p4info_pb2.CounterSpec.BYTES: "bytes",
    p4info_pb2.CounterSpec.PACKETS: "packets",
    p4info_pb2.CounterSpec.BOTH: "both",
}


@dataclass(frozen=True, slots=True)
class MatchFieldInfo:
    """One match field of a table."""

    id: int
    name: str
    bitwidth: int
    #: "exact", "lpm", "ternary", "range", "optional", or the P4Info other_match_type string.
    match_kind: str


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """One parameter of an action."""

    id: int
    name: str
    bitwidth: int


@dataclass(frozen=True, slots=True)
class ActionInfo:
    """An action and its parameters (in P4Info order)."""

    id: int
    name: str
    alias: str
    params: tuple[ParamInfo, ...]

    def param(self, key: str | int) -> ParamInfo:
        """A parameter by name or id."""
        for p in self.params:
            if p.name == key or p.id == key:
                return p
        raise P4InfoLookupError(f"action '{self.name}' has no parameter {key!r}")


@dataclass(frozen=True, slots=True, eq=False)
class TableInfo:
    """A table: match fields (P4Info order), allowed actions and their scopes, size."""

    id: int
    name: str
    alias: str
    match_fields: tuple[MatchFieldInfo, ...]
    #: action id -> "table_and_default" | "table_only" | "default_only"
    action_scopes: Mapping[int, str]
    const_default_action_id: int
    size: int
    is_const_table: bool
    implementation_id: int
    direct_resource_ids: tuple[int, ...]
    supports_idle_timeout: bool

    def match_field(self, key: str | int) -> MatchFieldInfo:
        """A match field by name or id."""
        for mf in self.match_fields:
            if mf.name == key or mf.id == key:
                return mf
        raise P4InfoLookupError(f"table '{self.name}' has no match field {key!r}")

    @property
    def needs_priority(self) -> bool:
        """True if entries must carry a priority (a ternary, range or optional field)."""
        return any(mf.match_kind in PRIORITY_MATCH_KINDS for mf in self.match_fields)


@dataclass(frozen=True, slots=True)
class CounterInfo:
    """An indirect counter array."""

    id: int
    name: str
    alias: str
    unit: str
    size: int


@dataclass(frozen=True, slots=True)
class RegisterInfo:
    """A register array; ``bitwidth`` is None unless its type is a plain bit<W>/int<W>."""

    id: int
    name: str
    alias: str
    size: int
    bitwidth: int | None


_T = TypeVar("_T", TableInfo, ActionInfo, CounterInfo, RegisterInfo)
_U = TypeVar("_U")


class _Registry(Generic[_T]):
    """Objects of one kind, by id, fully qualified name and unique alias."""

    def __init__(self, kind: str, items: Iterable[_T]) -> None:
        self.kind = kind
        self.items: tuple[_T, ...] = tuple(items)
        self.by_id = {it.id: it for it in self.items}
        self.by_name = {it.name: it for it in self.items}
        aliases: dict[str, list[_T]] = {}
        for it in self.items:
            aliases.setdefault(it.alias, []).append(it)
        self.by_alias = {a: its[0] for a, its in aliases.items() if len(its) == 1 and a}

    def get(self, key: str | int) -> _T:
        found = self.by_id.get(key) if isinstance(key, int) else (
            self.by_name.get(key) or self.by_alias.get(key))
        if found is None:
            what = f"id {key} (0x{key:08x})" if isinstance(key, int) else repr(key)
            raise P4InfoLookupError(f"the P4Info has no {self.kind} {what}")
        return found


def _table_info(t: p4info_pb2.Table) -> TableInfo:
    fields = tuple(
        MatchFieldInfo(
            id=mf.id, name=mf.name, bitwidth=mf.bitwidth,
            match_kind=_MATCH_KINDS.get(mf.match_type, mf.other_match_type or "unspecified"),
        )
        for mf in t.match_fields
    )
    return TableInfo(
        id=t.preamble.id, name=t.preamble.name, alias=t.preamble.alias, match_fields=fields,
        action_scopes={ref.id: _SCOPES.get(ref.scope, "table_and_default") for ref in t.action_refs},
        const_default_action_id=t.const_default_action_id, size=t.size,
        is_const_table=t.is_const_table, implementation_id=t.implementation_id,
        direct_resource_ids=tuple(t.direct_resource_ids),
        supports_idle_timeout=t.idle_timeout_behavior == p4info_pb2.Table.NOTIFY_CONTROL,
    )


def _action_info(a: p4info_pb2.Action) -> ActionInfo:
    params = tuple(ParamInfo(id=p.id, name=p.name, bitwidth=p.bitwidth) for p in a.params)
    return ActionInfo(id=a.preamble.id, name=a.preamble.name, alias=a.preamble.alias, params=params)


def _register_bitwidth(r: p4info_pb2.Register) -> int | None:
    bits = r.type_spec.bitstring
    kind = bits.WhichOneof("type_spec")
    return getattr(bits, kind).bitwidth if kind in ("bit", "int") else None


class P4InfoIndex:
    """Lookups into one P4Info by fully qualified name, unique alias or id."""

    def __init__(self, p4info: p4info_pb2.P4Info) -> None:
        self.p4info = p4info
        self._tables = _Registry("table", (_table_info(t) for t in p4info.tables))
        self._actions = _Registry("action", (_action_info(a) for a in p4info.actions))
        self._counters = _Registry("counter", (
            CounterInfo(id=c.preamble.id, name=c.preamble.name, alias=c.preamble.alias,
                        unit=_COUNTER_UNITS.get(c.spec.unit, "unspecified"), size=c.size)
            for c in p4info.counters))
        self._registers = _Registry("register", (
            RegisterInfo(id=r.preamble.id, name=r.preamble.name, alias=r.preamble.alias,
                         size=r.size, bitwidth=_register_bitwidth(r))
            for r in p4info.registers))

    @classmethod
    def from_file(cls, path: str | Path) -> P4InfoIndex:
        """Index a P4Info text file."""
        return cls(load_p4info(path))

    @property
    def tables(self) -> tuple[TableInfo, ...]:
        return self._tables.items

    @property
    def actions(self) -> tuple[ActionInfo, ...]:
        return self._actions.items

    @property
    def counters(self) -> tuple[CounterInfo, ...]:
        return self._counters.items

    @property
    def registers(self) -> tuple[RegisterInfo, ...]:
        return self._registers.items

    def table(self, key: str | int) -> TableInfo:
        """A table by name, alias or id; raises ``P4InfoLookupError``."""
        return self._tables.get(key)

    def action(self, key: str | int) -> ActionInfo:
        """An action by name, alias or id; raises ``P4InfoLookupError``."""
        return self._actions.get(key)

    def counter(self, key: str | int) -> CounterInfo:
        """A counter by name, alias or id; raises ``P4InfoLookupError``."""
        return self._counters.get(key)

    def register(self, key: str | int) -> RegisterInfo:
        """A register by name, alias or id; raises ``P4InfoLookupError``."""
        return self._registers.get(key)

    def match_field(self, table: str | int, field: str | int) -> MatchFieldInfo:
        """A match field of a table, by name or id."""
        return self.table(table).match_field(field)

    def param(self, action: str | int, param: str | int) -> ParamInfo:
        """A parameter of an action, by name or id."""
        return self.action(action).param(param)


# --------------------------------------------------------------------------- pipeline comparison


def _describe_table(t: TableInfo) -> dict[str, object]:
    return {
        "name": t.name,
        "match field order": [mf.id for mf in t.match_fields],
        **{f"match field {mf.id}": (mf.name, mf.bitwidth, mf.match_kind) for mf in t.match_fields},
        "actions": sorted(t.action_scopes.items()),
        "const default action id": t.const_default_action_id,
        "size": t.size,
        "is_const_table": t.is_const_table,
        "implementation id": t.implementation_id,
        "direct resource ids": sorted(t.direct_resource_ids),
        "idle timeout support": t.supports_idle_timeout,
    }


def _describe_action(a: ActionInfo) -> dict[str, object]:
    return {"name": a.name, "param order": [p.id for p in a.params],
            **{f"param {p.id}": (p.name, p.bitwidth) for p in a.params}}


def _describe_counter(c: CounterInfo) -> dict[str, object]:
    return {"name": c.name, "unit": c.unit, "size": c.size}


def _describe_register(r: p4info_pb2.Register) -> dict[str, object]:
    return {"name": r.preamble.name, "size": r.size,
            "type": text_format.MessageToString(r.type_spec, as_one_line=True)}


def _diff_kind(kind: str, expected: Mapping[int, dict[str, object]],
               actual: Mapping[int, dict[str, object]]) -> list[str]:
    diffs: list[str] = []
    for obj_id in sorted(expected.keys() - actual.keys()):
        diffs.append(f"{kind} {expected[obj_id]['name']!r} (id {obj_id:#x}) is missing")
    for obj_id in sorted(actual.keys() - expected.keys()):
        diffs.append(f"unexpected {kind} {actual[obj_id]['name']!r} (id {obj_id:#x})")
    for obj_id in sorted(expected.keys() & actual.keys()):
        exp, act = expected[obj_id], actual[obj_id]
        for prop in [*exp, *(p for p in act if p not in exp)]:
            exp_value, act_value = exp.get(prop, _ABSENT), act.get(prop, _ABSENT)
            if act_value != exp_value:
                diffs.append(f"{kind} {exp['name']!r} (id {obj_id:#x}): {prop} differs: "
                             f"expected {exp_value!r}, got {act_value!r}")
    return diffs


class _Absent:
    def __repr__(self) -> str:
        return "nothing"


_ABSENT = _Absent()


#: P4Info sections compared only as a whole (netagg uses none of them).
_OTHER_SECTIONS = ("direct_counters", "meters", "direct_meters", "action_profiles",
                   "controller_packet_metadata", "value_sets", "digests", "externs")


def _by_id(items: Iterable[_U], describe: Callable[[_U], dict[str, object]],
           get_id: Callable[[_U], int]) -> dict[int, dict[str, object]]:
    return {get_id(it): describe(it) for it in items}


def p4info_differences(expected: p4info_pb2.P4Info, actual: p4info_pb2.P4Info) -> list[str]:
    """Human-readable differences between two P4Infos' pipelines; empty if they are the same.

    Compares the architecture and, by id, the tables (name, match fields, actions
    and scopes, const default action, size, ...), actions (name, params), counters
    (name, unit, size) and registers (name, size, type). Aliases, annotations and
    documentation are ignored; other sections are compared as a whole.
    """
    exp_index, act_index = P4InfoIndex(expected), P4InfoIndex(actual)
    diffs: list[str] = []
    if expected.pkg_info.arch != actual.pkg_info.arch:
        diffs.append(f"architecture differs: expected {expected.pkg_info.arch!r}, "
                     f"got {actual.pkg_info.arch!r}")
    by_id = _by_id
    diffs += _diff_kind("table", by_id(exp_index.tables, _describe_table, lambda t: t.id),
                        by_id(act_index.tables, _describe_table, lambda t: t.id))
    diffs += _diff_kind("action", by_id(exp_index.actions, _describe_action, lambda a: a.id),
                        by_id(act_index.actions, _describe_action, lambda a: a.id))
    diffs += _diff_kind("counter", by_id(exp_index.counters, _describe_counter, lambda c: c.id),
                        by_id(act_index.counters, _describe_counter, lambda c: c.id))
    diffs += _diff_kind(
        "register",
        by_id(expected.registers, _describe_register, lambda r: r.preamble.id),
        by_id(actual.registers, _describe_register, lambda r: r.preamble.id))
    for section in _OTHER_SECTIONS:
        exp_items, act_items = getattr(expected, section), getattr(actual, section)
        if [m.SerializeToString(deterministic=True) for m in exp_items] != [
                m.SerializeToString(deterministic=True) for m in act_items]:
            diffs.append(f"{section} differ ({len(exp_items)} expected, {len(act_items)} given)")
    return diffs


def same_pipeline(a: p4info_pb2.P4Info, b: p4info_pb2.P4Info) -> bool:
    """True if ``p4info_differences(a, b)`` is empty."""
    return not p4info_differences(a, b)
