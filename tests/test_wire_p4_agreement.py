"""The P4 program, its committed P4Info and the Python contract agree."""

import re

from netagg import dataplane as dp
from netagg import wire
from netagg.dataplane import DropReason, Level, ValueOp
from netagg.p4info import load_p4info

INCLUDE = dp.SHARED_P4_DIR


def _defines() -> dict[str, int]:
    text = (INCLUDE / "defines.p4").read_text()
    return {name: int(value, 0) for name, value in re.findall(r"^#define (\w+) (0x[0-9a-fA-F]+|\d+)\s*$", text, re.M)}


def _p4_header_fields(name: str) -> list[tuple[str, int, bool]]:
    text = (INCLUDE / "headers.p4").read_text()
    body = re.search(rf"header {name} \{{(.*?)\}}", text, re.S).group(1)
    return [(field, int(bits), kind == "int") for kind, bits, field in re.findall(r"(bit|int)<(\d+)>\s+(\w+);", body)]


def test_netagg_header_mirrors_wire_fields():
    assert _p4_header_fields("netagg_h") == [(f.name, f.bits, f.signed) for f in wire.HEADER_FIELDS]


def test_value_count_is_k_everywhere():
    defines = _defines()
    assert defines["NETAGG_K"] == wire.K
    for_each = re.search(r"#define FOR_EACH_VALUE\(M\)(.*?)\n\n", (INCLUDE / "defines.p4").read_text(), re.S).group(1)
    indices = re.findall(r"M\((\d\d)\)", for_each)
    assert indices == [f"{i:02d}" for i in range(wire.K)]
    registers = [r.preamble.name for r in load_p4info(dp.P4INFO_PATH).registers if ".value_" in r.preamble.name]
    assert len(registers) == wire.K


def test_protocol_constants_agree():
    defines = _defines()
    assert defines["NETAGG_VERSION"] == wire.VERSION
    assert defines["NETAGG_UDP_PORT"] == wire.NETAGG_UDP_PORT
    assert defines["NETAGG_TREE_UDP_PORT"] == wire.NETAGG_TREE_UDP_PORT
    assert defines["MAX_WORKERS"] == wire.MAX_WORKERS
    assert defines["NUM_POOLS"] == wire.NUM_POOLS
    assert defines["NUM_POOL_SLOTS"] == defines["NUM_SLOTS"] * wire.NUM_POOLS
    assert defines["NETAGG_UDP_LENGTH"] == wire.UDP_LENGTH
    assert defines["NETAGG_IPV4_TOTAL_LENGTH"] == wire.IPV4_TOTAL_LENGTH
    assert defines["FLAG_RESULT"] == wire.FLAG_RESULT
    assert defines["FLAG_RETRANSMIT"] == wire.FLAG_RETRANSMIT
    assert defines["ETHERTYPE_IPV4"] == wire.ETHERTYPE_IPV4


def test_drop_reasons_and_ops_agree():
    defines = _defines()
    for reason in DropReason:
        assert defines[f"DROP_{reason.name}"] == reason.value, reason
    assert max(DropReason) < defines["DROP_REASONS"]
    for op in ValueOp:
        assert defines[f"OP_{op.name}"] == op.value, op
    for level in Level:
        assert defines[f"LEVEL_{level.name}"] == level.value, level


def test_p4info_sizes_match_defines():
    defines = _defines()
    info = load_p4info(dp.P4INFO_PATH)
    registers = {r.preamble.name: r.size for r in info.registers}
    assert registers[dp.REGISTER_SLOT_OWNER] == defines["NUM_SLOTS"]
    assert registers["NetaggIngress.worker_count.worker_count"] == defines["NUM_POOL_SLOTS"]
    counters = {c.preamble.name: c.size for c in info.counters}
    for name in dp.JOB_COUNTERS.values():
        assert counters[name] == defines["MAX_JOBS"]
    assert counters[dp.COUNTER_DROP_REASONS] == defines["DROP_REASONS"]
    tables = {t.preamble.name: t.size for t in info.tables}
    assert tables[dp.TABLE_JOBS] == defines["JOB_TABLE_SIZE"]
    assert tables[dp.TABLE_WORKERS] == defines["WORKER_TABLE_SIZE"]
    assert tables[dp.TABLE_REPLICAS] == defines["REPLICA_TABLE_SIZE"]
    assert tables[dp.TABLE_ROUTES] == defines["IPV4_TABLE_SIZE"]
    assert tables[dp.TABLE_SOURCES] == defines["SOURCE_TABLE_SIZE"]
    assert tables[dp.TABLE_UP_LINKS] == tables[dp.TABLE_DOWN_LINKS] == defines["TREE_LINK_TABLE_SIZE"]
    assert registers[dp.REGISTER_LEVEL_STATE] == defines["NUM_POOL_SLOTS"]


def test_every_contract_name_is_in_p4info():
    info = load_p4info(dp.P4INFO_PATH)
    names = {o.preamble.name for group in (info.tables, info.actions, info.counters, info.registers) for o in group}
    prefixes = ("TABLE_", "ACTION_", "COUNTER_", "REGISTER_")
    contract = [value for key, value in vars(dp).items() if key.startswith(prefixes)]
    assert contract and set(contract) <= names


# The TNA program (p4src/tna/) shares the wire headers and defines and keeps the control plane.

TNA_DIR = dp.P4SRC_DIR / "tna"
TYPE_WIDTHS = {"slot_index_t": 32, "worker_mask_t": 32, "port_t": 9, "mac_addr_t": 48, "ipv4_addr_t": 32}


def _tna_sources() -> str:
    return "\n".join(p.read_text() for p in sorted(TNA_DIR.rglob("*.p4")))


def test_tna_program_includes_the_shared_wire_format():
    top = (TNA_DIR / "netagg.p4").read_text()
    assert '#include "shared/defines.p4"' in top and '#include "shared/headers.p4"' in top
    sources = _tna_sources()
    for header in ("ethernet_h", "ipv4_h", "udp_h", "netagg_h", "values_h"):
        assert f"header {header} " not in sources, f"the TNA program redefines {header}"


def test_tna_value_pairs_cover_every_value_once():
    defines = (TNA_DIR / "defines.p4").read_text()
    body = re.search(r"#define FOR_EACH_PAIR\(M\)(.*?)\n\n", defines, re.S).group(1)
    pairs = [(int(a), int(b)) for a, b in re.findall(r"M\((\d\d), (\d\d)\)", body)]
    assert pairs == [(i, i + wire.K // 2) for i in range(wire.K // 2)]
    tna_ops = {name: int(v) for name, v in re.findall(r"^#define (OP_\w+) (\d+)", defines, re.M)}
    assert set(tna_ops.values()).isdisjoint(op.value for op in ValueOp)


def _width(type_name: str) -> int:
    match = re.fullmatch(r"bit<(\d+)>", type_name)
    return int(match.group(1)) if match else TYPE_WIDTHS[type_name]


#: Tables of the v1model program that the TNA twin does not carry yet: a tree of switches
#: (docs/tofino.md, "Not in the TNA twin"). Every other table must match.
NOT_IN_TNA = {dp.TABLE_UP_LINKS, dp.TABLE_DOWN_LINKS}


def test_tna_tables_and_actions_match_the_p4info():
    """Same table names, key names and action parameters as the v1model program's P4Info."""
    sources = _tna_sources()
    info = load_p4info(dp.P4INFO_PATH)
    actions = {a.preamble.id: a for a in info.actions}
    for table in info.tables:
        if table.preamble.name in NOT_IN_TNA:
            assert not re.search(rf"\btable {table.preamble.name.rsplit('.', 1)[1]}\b", sources), \
                "the TNA twin has this table now: check it like the others"
            continue
        short = table.preamble.name.rsplit(".", 1)[1]
        body = re.search(rf"\btable {short} \{{(.*?)\n    \}}", sources, re.S)
        assert body, f"no table {short} in the TNA program"
        keys = re.findall(r'@name\("(\w+)"\)', body.group(1))
        assert keys == [m.name for m in table.match_fields], short
        for ref in table.action_refs:
            action = actions[ref.id]
            name = action.preamble.name.rsplit(".", 1)[1]
            declared = re.search(rf"\baction {name}\((.*?)\)", sources, re.S)
            assert declared, f"no action {name} in the TNA program"
            params = [p.strip().rsplit(" ", 1) for p in declared.group(1).split(",") if p.strip()]
            assert [(n, _width(t)) for t, n in params] == [(p.name, p.bitwidth) for p in action.params], name
