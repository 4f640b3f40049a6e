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
    assert defines["NETAGG_VERSION"] == wire.VERSION == 4
    assert defines["NETAGG_UDP_PORT"] == wire.NETAGG_UDP_PORT
    assert defines["NETAGG_TREE_UDP_PORT"] == wire.NETAGG_TREE_UDP_PORT
    assert defines["MAX_WORKERS"] == wire.MAX_WORKERS
    assert defines["NUM_POOLS"] == wire.NUM_POOLS
    assert defines["NUM_POOL_SLOTS"] == defines["NUM_SLOTS"] * wire.NUM_POOLS
    assert defines["NETAGG_UDP_LENGTH"] == wire.UDP_LENGTH == wire.udp_length(wire.K)
    assert defines["NETAGG_IPV4_TOTAL_LENGTH"] == wire.IPV4_TOTAL_LENGTH == wire.ipv4_total_length(wire.K)
    assert defines["NETAGG_WIDE_UDP_LENGTH"] == wire.udp_length(wire.WIDE_K)
    assert defines["NETAGG_WIDE_IPV4_TOTAL_LENGTH"] == wire.ipv4_total_length(wire.WIDE_K)
    assert defines["FLAG_RESULT"] == wire.FLAG_RESULT
    assert defines["FLAG_RETRANSMIT"] == wire.FLAG_RETRANSMIT
    assert defines["ETHERTYPE_IPV4"] == wire.ETHERTYPE_IPV4


def test_lengths_follow_the_header():
    defines = _defines()
    header_bits = sum(bits for _, bits, _ in _p4_header_fields("netagg_h"))
    assert header_bits // 8 == wire.HEADER_BYTES == 24
    assert defines["NETAGG_UDP_LENGTH"] == wire.UDP_HEADER_BYTES + wire.HEADER_BYTES + wire.K * wire.VALUE_BYTES == 288
    assert defines["NETAGG_IPV4_TOTAL_LENGTH"] == wire.IPV4_HEADER_BYTES + defines["NETAGG_UDP_LENGTH"] == 308
    wide_udp = wire.UDP_HEADER_BYTES + wire.HEADER_BYTES + wire.WIDE_K * wire.VALUE_BYTES
    assert defines["NETAGG_WIDE_UDP_LENGTH"] == wide_udp == 1056
    assert defines["NETAGG_WIDE_IPV4_TOTAL_LENGTH"] == wire.IPV4_HEADER_BYTES + wide_udp == 1076
    assert wire.frame_bytes(wire.K) == 322 and wire.frame_bytes(wire.WIDE_K) == 1090


def test_width_codes_agree():
    """Both width codes, and nothing else, name a width; a wide packet is NETAGG_WIDE_CELLS cells."""
    defines = _defines()
    p4_widths = {defines["NETAGG_WIDTH"]: defines["NETAGG_K"], defines["NETAGG_WIDTH_WIDE"]: defines["NETAGG_WIDE_K"]}
    assert p4_widths == wire.WIDTHS
    assert (defines["NETAGG_WIDTH"], defines["NETAGG_WIDTH_WIDE"]) == (0, 1)
    assert defines["NETAGG_WIDE_K"] == wire.WIDE_K == defines["NETAGG_WIDE_CELLS"] * defines["NETAGG_K"]
    assert defines["NETAGG_WIDE_CELLS"] == wire.cells_of(wire.WIDE_K) and wire.cells_of(wire.K) == 1


def test_wide_packets_carry_one_values_header_per_cell():
    """headers_t has values (chunk 0) and values1..values3; the parser extracts the three only for the wide
    code, the deparser emits them, and ValueSum has write/merge/read for every chunk."""
    defines = _defines()
    chunks = ["values"] + [f"values{c}" for c in range(1, defines["NETAGG_WIDE_CELLS"])]
    headers = re.search(r"struct headers_t \{(.*?)\}", (INCLUDE / "headers.p4").read_text(), re.S).group(1)
    assert re.findall(r"values_h (\w+);", headers) == chunks
    parser = (dp.P4SRC_DIR / "v1model" / "parser.p4").read_text()
    assert re.search(r"NETAGG_WIDTH_WIDE:\s*parse_wide;", parser)
    wide_state = re.search(r"state parse_wide \{(.*?)\}", parser, re.S).group(1)
    assert re.findall(r"packet\.extract\(hdr\.(\w+)\)", wide_state) == chunks[1:]
    assert re.findall(r"packet\.emit\(hdr\.(values\d*)\)", parser) == chunks
    actions = {a.preamble.name.rsplit(".", 1)[1] for a in load_p4info(dp.P4INFO_PATH).actions
               if a.preamble.name.startswith("NetaggIngress.value_sum.")}
    suffixes = [""] + [f"_{c}" for c in range(1, defines["NETAGG_WIDE_CELLS"])]
    assert actions == {f"{op}_values{s}" for op in ("write", "merge", "read") for s in suffixes}


def test_set_job_takes_the_width_last():
    info = load_p4info(dp.P4INFO_PATH)
    set_job = next(a for a in info.actions if a.preamble.name == dp.ACTION_SET_JOB)
    assert [p.name for p in set_job.params] == ["num_workers", "slot_base", "slot_count", "mgid", "generation",
                                                "width"]
    assert set_job.params[-1].bitwidth == 8 == next(f.bits for f in wire.HEADER_FIELDS if f.name == "width")


def test_round_flags_agree():
    defines = _defines()
    for name in ("NAN", "POS_INF", "NEG_INF", "OUT_OF_STEP"):
        assert defines[f"FLAG_{name}"] == getattr(wire, f"FLAG_{name}"), name
    assert defines["ROUND_FLAGS"] == wire.ROUND_FLAGS == 0x78
    assert defines["ROUND_FLAGS"] == (defines["FLAG_NAN"] | defines["FLAG_POS_INF"] | defines["FLAG_NEG_INF"]
                                      | defines["FLAG_OUT_OF_STEP"])
    host_flags = defines["FLAG_RESULT"] | defines["FLAG_RETRANSMIT"] | wire.FLAG_PS_FORWARDED
    assert defines["ROUND_FLAGS"] & host_flags == 0
    assert defines["FLAG_CLOSE"] == wire.FLAG_CLOSE == 0x80
    assert defines["STORED_FLAGS"] == wire.STORED_FLAGS == defines["ROUND_FLAGS"] | defines["FLAG_CLOSE"]
    assert defines["FLAG_CLOSE"] & (host_flags | defines["ROUND_FLAGS"]) == 0


def test_drop_reasons_and_ops_agree():
    defines = _defines()
    for reason in DropReason:
        assert defines[f"DROP_{reason.name}"] == reason.value, reason
    assert max(DropReason) < defines["DROP_REASONS"]
    assert DropReason.EXCHANGE_MISMATCH == 16 and defines["DROP_REASONS"] == 32
    assert DropReason.WRONG_WIDTH == defines["DROP_WRONG_WIDTH"] == 17
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
    assert counters[dp.COUNTER_EGRESS_DROP_REASONS] == defines["DROP_REASONS"]
    tables = {t.preamble.name: t.size for t in info.tables}
    assert tables[dp.TABLE_JOBS] == defines["JOB_TABLE_SIZE"]
    assert tables[dp.TABLE_WORKERS] == defines["WORKER_TABLE_SIZE"]
    assert tables[dp.TABLE_REPLICAS] == defines["REPLICA_TABLE_SIZE"]
    assert tables[dp.TABLE_ROUTES] == defines["IPV4_TABLE_SIZE"]
    assert tables[dp.TABLE_SOURCES] == defines["SOURCE_TABLE_SIZE"]
    assert tables[dp.TABLE_UP_LINKS] == tables[dp.TABLE_DOWN_LINKS] == defines["TREE_LINK_TABLE_SIZE"]
    assert registers[dp.REGISTER_LEVEL_STATE] == defines["NUM_POOL_SLOTS"]


#: The per-(slot, pool) registers of the round flags (docs/protocol.md, "Round flags"): name -> bit width.
ROUND_FLAG_REGISTERS = {
    "NetaggIngress.exchange_check.round_exchange": 32,
    "NetaggIngress.round_flags.round_flags": 8,
}


def test_p4info_has_the_round_flag_registers():
    defines = _defines()
    info = load_p4info(dp.P4INFO_PATH)
    registers = {r.preamble.name: r for r in info.registers}
    for name, bits in ROUND_FLAG_REGISTERS.items():
        register = registers[name]
        assert register.size == defines["NUM_POOL_SLOTS"], name
        assert register.type_spec.bitstring.bit.bitwidth == bits, name
        assert register.preamble.alias == name.rsplit(".", 1)[1]
    exchange = next(f for f in wire.HEADER_FIELDS if f.name == "exchange")
    assert ROUND_FLAG_REGISTERS["NetaggIngress.exchange_check.round_exchange"] == exchange.bits
    assert 1 << ROUND_FLAG_REGISTERS["NetaggIngress.round_flags.round_flags"] > wire.ROUND_FLAGS


def test_p4info_ids_match_the_program_and_are_unique():
    """The committed P4Info's ids are those of the @id annotations (hand-edited entries included)."""
    info = load_p4info(dp.P4INFO_PATH)
    objects = [o for group in (info.tables, info.actions, info.counters, info.registers) for o in group]
    ids = [o.preamble.id for o in objects]
    assert len(ids) == len(set(ids))
    sources = "\n".join(p.read_text() for p in sorted((dp.P4SRC_DIR / "v1model").rglob("*.p4")))
    declared = {int(v, 16) for v in re.findall(r"@id\((0x[0-9a-fA-F]{8})\)", sources)}
    # value_sum.p4's CHUNK_ACTIONS(c, write_id, merge_id, read_id) passes a wide chunk's ids to its @ids.
    for ids in re.findall(r"^\s*CHUNK_ACTIONS\(\d+, (0x\w{8}), (0x\w{8}), (0x\w{8})\)", sources, re.M):
        declared |= {int(v, 16) for v in ids}
    for o in objects:
        if ".value_" in o.preamble.name:
            continue  # FOR_EACH_VALUE pastes the index into the id
        assert o.preamble.id in declared, o.preamble.name
    for register in info.registers:
        assert register.preamble.id >> 24 == 0x16, register.preamble.name


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


#: Tables of the v1model program that the TNA twin does not carry (none since its tree paths,
#: docs/tofino.md "Tree paths"): every table must match.
NOT_IN_TNA: set[str] = set()


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
