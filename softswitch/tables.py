"""The software target's tables: installed entries and the lookups the packet pipeline makes.

An entry is a ``TableEntryRecord`` with a normalised match key (see ``MatchKey``);
``make_table`` picks the index a table's match kinds allow: one dict (exact), one dict
per prefix length (LPM), or a priority-ordered rule list (ternary, range, optional).
``netagg.softswitch.p4rt_codec`` turns P4Runtime entities into records and back;
``netagg.softswitch.forwarding_state`` validates writes and owns the tables.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from netagg.p4info import ActionInfo, P4InfoIndex, TableInfo

__all__ = [
    "ExactTable",
    "LookupResult",
    "LpmTable",
    "MatchKey",
    "Table",
    "TableEntryRecord",
    "TernaryTable",
    "make_table",
    "prefix_mask",
]

#: (full action name, params in P4Info order): what a table lookup yields.
LookupResult = tuple[str, tuple[int, ...]]

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


def prefix_mask(bitwidth: int, prefix_len: int) -> int:
    """The mask of a ``prefix_len``-bit prefix of a ``bitwidth``-bit field."""
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
        self._levels = [(self._by_len[n], prefix_mask(self._width, n))
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
                masks.append((i, prefix_mask(mf.bitwidth, v[1]), v[0]))  # type: ignore[index]
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


def make_table(info: TableInfo, index: P4InfoIndex) -> Table:
    """An empty table, indexed as its match kinds allow, with the program's default action."""
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

