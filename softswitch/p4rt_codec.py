"""P4Runtime entities to the software target's table structures and back, with P4Runtime's checks.

Decoding validates the way P4Runtime 1.3 and PI/BMv2 do and raises ``StateError`` (a gRPC
code and a precise message): match fields into a normalised ``MatchKey``, actions and their
params, multicast replicas, counter indices. Encoding fills the messages a Read answers with.
``netagg.softswitch.forwarding_state`` applies the results to its tables.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
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
from netagg.softswitch.tables import MatchKey, Table, TableEntryRecord, prefix_mask

__all__ = [
    "MAX_MULTICAST_GROUP_ID",
    "MAX_REPLICA_INSTANCE",
    "StateError",
    "check_counter_index",
    "check_extras",
    "check_group_id",
    "describe_key",
    "fill_default_entry",
    "fill_entry",
    "invalid",
    "multicast_entry",
    "parse_action",
    "parse_match",
    "parse_priority",
    "parse_replicas",
]

#: Multicast group ids must be below this (PI reserves [2**15, ...) for clone sessions).
MAX_MULTICAST_GROUP_ID = 1 << 15
#: v1model's egress_rid is 16 bits wide.
MAX_REPLICA_INSTANCE = 0xFFFF

_Code = grpc.StatusCode


class StateError(Exception):
    """A P4Runtime failure: the gRPC status code to answer and a precise message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


def invalid(message: str) -> StateError:
    """An INVALID_ARGUMENT failure."""
    return StateError(_Code.INVALID_ARGUMENT, message)


# --------------------------------------------------------------------------- match / action parsing


def _value(data: bytes, bitwidth: int, what: str) -> int:
    """Decode a byte string that must fit ``bitwidth`` bits (canonical or padded)."""
    if not data:
        raise invalid(f"{what}: empty byte string")
    value = decode_int(data)
    if value >> bitwidth:
        raise invalid(f"{what}: value {value:#x} does not fit in {bitwidth} bits")
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
        raise invalid(f"{what}: prefix length {prefix_len} is not in 1..{mf.bitwidth}{hint}")
    if value & ~prefix_mask(mf.bitwidth, prefix_len):
        raise invalid(f"{what}: value {value:#x} has bits set beyond the prefix length {prefix_len}")
    return value, prefix_len


def _parse_ternary(fm: p4rt.FieldMatch, mf: MatchFieldInfo, what: str) -> tuple[int, int]:
    value = _value(fm.ternary.value, mf.bitwidth, what)
    mask = _value(fm.ternary.mask, mf.bitwidth, f"{what} mask")
    if mask == 0:
        raise invalid(f"{what}: mask 0 (omit the field for a don't-care match)")
    if value & ~mask:
        raise invalid(f"{what}: value {value:#x} has bits set outside mask {mask:#x}")
    return value, mask


def _parse_range(fm: p4rt.FieldMatch, mf: MatchFieldInfo, what: str) -> tuple[int, int]:
    low = _value(fm.range.low, mf.bitwidth, f"{what} low")
    high = _value(fm.range.high, mf.bitwidth, f"{what} high")
    if low > high:
        raise invalid(f"{what}: low {low:#x} > high {high:#x}")
    if (low, high) == (0, (1 << mf.bitwidth) - 1):
        raise invalid(f"{what}: full range (omit the field for a don't-care match)")
    return low, high


def _parse_field(info: TableInfo, mf: MatchFieldInfo, fm: p4rt.FieldMatch | None) -> object:
    what = _field_what(info, mf)
    kind = mf.match_kind
    if kind not in ("exact", "lpm", "ternary", "range", "optional"):
        raise StateError(_Code.UNIMPLEMENTED, f"{what}: match kind {kind!r} is not supported")
    if fm is None:
        if kind == "exact":
            raise invalid(f"{what} is missing (exact fields are mandatory)")
        return _dont_care(mf)
    given = fm.WhichOneof("field_match_type")
    if given != kind:
        raise invalid(f"{what}: got a {given or 'empty'} match")
    if kind == "exact":
        return _value(fm.exact.value, mf.bitwidth, what)
    if kind == "optional":
        return _value(fm.optional.value, mf.bitwidth, what)
    return {"lpm": _parse_lpm, "ternary": _parse_ternary, "range": _parse_range}[kind](fm, mf, what)


def parse_match(info: TableInfo, te: p4rt.TableEntry) -> MatchKey:
    given: dict[int, p4rt.FieldMatch] = {}
    for fm in te.match:
        if fm.field_id in given:
            raise invalid(f"table '{info.name}': match field id {fm.field_id} is given twice")
        try:
            info.match_field(fm.field_id)
        except P4InfoLookupError:
            raise invalid(f"table '{info.name}' has no match field with id {fm.field_id}") from None
        given[fm.field_id] = fm
    return tuple(_parse_field(info, mf, given.get(mf.id)) for mf in info.match_fields)


def parse_priority(info: TableInfo, priority: int) -> int:
    if info.needs_priority and priority <= 0:
        raise invalid(f"table '{info.name}' has ternary/range/optional fields: "
                       f"entries need a priority > 0, got {priority}")
    if not info.needs_priority and priority != 0:
        raise invalid(f"table '{info.name}' has no ternary/range/optional field: "
                       f"priority must be 0, got {priority}")
    return priority


def describe_key(info: TableInfo, key: MatchKey) -> str:
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


def check_extras(table: Table, te: p4rt.TableEntry) -> None:
    """Refuse what a table entry may carry but this target does not support."""
    if te.idle_timeout_ns and not table.info.supports_idle_timeout:
        raise invalid(f"table '{table.name}' does not support idle timeout: "
                       f"idle_timeout_ns must be 0")
    for field in ("meter_config", "counter_data", "meter_counter_data"):
        if te.HasField(field):
            raise invalid(f"table '{table.name}': {field} given, but this target supports "
                           f"no direct resources")


def parse_action(index: P4InfoIndex, table: Table, te: p4rt.TableEntry, *, default_entry: bool,
                 ) -> tuple[ActionInfo, tuple[int, ...]]:
    """The action and params of an entry (or of the default entry), checked against the table's scopes."""
    kind = te.action.WhichOneof("type")
    if kind != "action":
        raise invalid(f"table '{table.name}' is a direct table: its entries need an Action, "
                       f"got {kind or 'no action'}")
    proto = te.action.action
    try:
        action = index.action(proto.action_id)
    except P4InfoLookupError:
        raise invalid(f"the P4Info has no action with id {proto.action_id:#x}") from None
    scope = table.info.action_scopes.get(action.id)
    if scope is None:
        raise invalid(f"action '{action.name}' is not an action of table '{table.name}'")
    if scope == "default_only" and not default_entry:
        raise StateError(_Code.PERMISSION_DENIED, f"action '{action.name}' is @defaultonly in "
                         f"table '{table.name}': it cannot be used in a table entry")
    if scope == "table_only" and default_entry:
        raise StateError(_Code.PERMISSION_DENIED, f"action '{action.name}' is @tableonly in "
                         f"table '{table.name}': it cannot be the default action")
    return action, _parse_params(action, proto.params)


# --------------------------------------------------------------------------- reads


def fill_entry(te: p4rt.TableEntry, info: TableInfo, e: TableEntryRecord) -> p4rt.TableEntry:
    te.table_id = info.id
    te.priority = e.priority
    te.controller_metadata = e.controller_metadata
    te.metadata = e.metadata
    for mf, v in zip(info.match_fields, e.key, strict=True):
        _add_field_match(te, mf, v)
    _set_action(te, e.action, e.params)
    return te


def fill_default_entry(te: p4rt.TableEntry, table: Table) -> p4rt.TableEntry:
    te.table_id = table.info.id
    te.is_default_action = True
    if table.default_action is not None:
        _set_action(te, table.default_action, table.default_params)
    return te


# --------------------------------------------------------------------------- helpers


def check_counter_index(info: CounterInfo, index: int) -> int:
    if index < 0:
        raise invalid(f"counter '{info.name}': negative index {index}")
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
            raise invalid(f"action '{action.name}' has no parameter with id {p.param_id}") from None
        if p.param_id in values:
            raise invalid(f"action '{action.name}': parameter '{info.name}' is given twice")
        values[p.param_id] = _value(p.value, info.bitwidth,
                                    f"action '{action.name}' parameter '{info.name}' "
                                    f"({info.bitwidth} bits)")
    missing = [p.name for p in action.params if p.id not in values]
    if missing:
        raise invalid(f"action '{action.name}': missing parameter(s) {', '.join(missing)}")
    return tuple(values[p.id] for p in action.params)


def _set_action(te: p4rt.TableEntry, action: ActionInfo, params: tuple[int, ...]) -> None:
    te.action.action.action_id = action.id
    for info, value in zip(action.params, params, strict=True):
        te.action.action.params.add(param_id=info.id, value=encode_int(value, info.bitwidth))


def multicast_entry(entity: p4rt.Entity) -> p4rt.MulticastGroupEntry:
    pre = entity.packet_replication_engine_entry
    kind = pre.WhichOneof("type")
    if kind == "multicast_group_entry":
        return pre.multicast_group_entry
    if kind == "clone_session_entry":
        raise StateError(_Code.UNIMPLEMENTED, "clone sessions are not supported by this target")
    raise invalid("PacketReplicationEngineEntry holds neither a multicast group nor a clone session")


def check_group_id(gid: int, *, allow_zero: bool) -> int:
    if gid == 0 and not allow_zero:
        raise invalid("0 is not a valid multicast group id")
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
        raise invalid(f"{what}: no port (set `port` or the deprecated `egress_port`)")
    if not replica.port:
        raise invalid(f"{what}: port must not be the empty string")
    if len(replica.port) > 4:
        raise StateError(_Code.UNIMPLEMENTED,
                         f"{what}: port of {len(replica.port)} bytes, only 4 bytes are supported")
    port = decode_int(replica.port)
    if not 0 < port < 1 << 31:
        raise invalid(f"{what}: port {port} must be positive (as a 32-bit signed int)")
    return port, len(replica.port)


def parse_replicas(gid: int, replicas: Iterable[p4rt.Replica],
                    ) -> tuple[list[tuple[int, int]], list[int | None]]:
    ports: list[tuple[int, int]] = []
    forms: list[int | None] = []
    seen: set[tuple[int, int]] = set()
    for n, replica in enumerate(replicas):
        port, form = _replica_port(gid, n, replica)
        if replica.instance > MAX_REPLICA_INSTANCE:
            raise invalid(f"multicast group {gid} replica #{n}: instance {replica.instance} does "
                           f"not fit v1model's 16-bit egress_rid")
        if (port, replica.instance) in seen:
            raise invalid(f"multicast group {gid}: duplicate replica (port {port}, "
                           f"instance {replica.instance})")
        seen.add((port, replica.instance))
        ports.append((port, replica.instance))
        forms.append(form)
    return ports, forms
