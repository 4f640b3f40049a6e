"""The TNA program compiles for Tofino 1 with the open-source Tofino compiler and fits it.

Without bf-p4c the source-level checks below still run: the stateful ALUs the design expects
(one per register), the four-RegisterAction limit of an ALU, the tree paths
(docs/tofino.md, "Tree paths") with the v1model program's control-plane names, and the packet
widths (docs/tofino.md, "Wide packets": both shapes checked; a wide packet's passes, simulated
from the tables' entries, take each chunk once at its cell and leave with the sums in order).
"""

import itertools
import json
import random
import re
import shutil
from collections import Counter

import pytest

from netagg import dataplane as dp
from netagg.bmv2.tna_build import (
    TOFINO1_STAGES,
    TOFINO1_STATEFUL_ALUS_PER_STAGE,
    ResourceReport,
    TofinoCompileError,
    check_front_end,
    compile_tna,
    compiler_available,
    compiler_warnings,
    front_end_missing,
    missing_parser_states,
    program_parser_states,
)
from netagg.p4info import load_p4info

#: 32 value pairs; slot owner, two pools' rounds, bitmap (paired with the round's members: subset
#: rounds add no ALU), count and exponent; the round's exchange and flags (protocol version 3);
#: level_state (a tree of switches: OPEN / UP / FINAL per slot and pool).
EXPECTED_STATEFUL_ALUS = 32 + 9
#: A Tofino 1 stateful ALU holds at most four RegisterActions (stateful instructions).
MAX_REGISTER_ACTIONS = 4

TNA_DIR = dp.P4SRC_DIR / "tna"
#: The tree paths' control-plane objects, named as in the v1model program (and its P4Info).
TREE_TABLES = (dp.TABLE_UP_LINKS, dp.TABLE_DOWN_LINKS)


def _tna_sources() -> str:
    return "\n".join(p.read_text() for p in sorted(TNA_DIR.rglob("*.p4")))


def _macro_bodies(text: str) -> dict[str, str]:
    """Every function-like #define: name -> body (continuation lines joined)."""
    joined = text.replace("\\\n", " ")
    return dict(re.findall(r"^#define (\w+)\([^)]*\)(.*)$", joined, re.M))


def _expansions(text: str, macros: dict[str, str], name: str) -> int:
    """How often macro `name` is expanded: direct uses, and uses through a FOR_EACH_* list macro."""
    uses = text.replace("\\\n", " ")
    uses = "\n".join(line for line in uses.splitlines() if not line.startswith("#define"))
    count = len(re.findall(rf"\b{name}\(", uses))
    for lister, body in macros.items():
        if lister.startswith("FOR_EACH_"):
            count += len(re.findall(rf"\b{lister}\({name}\)", uses)) * len(re.findall(r"\bM\(", body))
    return count


def _registers(text: str) -> Counter:
    """Register name (a macro's with its ## left in) -> how many instances the program has."""
    macros = _macro_bodies(text)
    instances: Counter = Counter()
    for name in re.findall(r"\bRegister<.*?>\(.*?\)\s+([\w#]+)\s*;", text):
        if "##" in name:
            macro = next(m for m, body in macros.items() if re.search(rf"\s{re.escape(name)}\s*;", body))
            instances[name] += _expansions(text, macros, macro)
        else:
            instances[name] += 1
    return instances


def test_source_has_one_stateful_alu_per_register():
    """Each Register is one stateful ALU; the design's count, each within an ALU's four actions."""
    text = _tna_sources()
    registers = _registers(text)
    assert sum(registers.values()) == EXPECTED_STATEFUL_ALUS, registers
    assert registers["value_##i"] == 32 and registers["round_pool##p"] == 2
    actions = Counter(re.findall(r"\bRegisterAction<.*?>\(([\w#]+)\)\s+[\w#]+\s*=", text))
    assert set(actions) == set(registers)
    for name, count in actions.items():
        assert 1 <= count <= MAX_REGISTER_ACTIONS, (name, count)


def test_source_has_the_tree_paths():
    """up_links, down_links and level_state, as the v1model program names them (control instances and
    registers; the tables' keys and action parameters are checked with every other table's in
    tests/test_wire_p4_agreement.py::test_tna_tables_and_actions_match_the_p4info); the tree port parsed."""
    text = _tna_sources()
    info = load_p4info(dp.P4INFO_PATH)
    for table in (t for t in info.tables if t.preamble.name in TREE_TABLES):
        control, short = table.preamble.name.split(".")[1:]
        # The control instance keeps the v1model name, so that the bfrt name is the P4Info's.
        assert re.search(rf"^    \w+\(\) {control};$", text, re.M), control
        assert re.search(rf"\b{short}\.apply\(\)", text), short
    assert len([t for t in info.tables if t.preamble.name in TREE_TABLES]) == len(TREE_TABLES)
    register = next(r for r in info.registers if r.preamble.name == dp.REGISTER_LEVEL_STATE)
    assert re.search(r"\bLevelState\(\) level_state;", text)
    declared = re.search(r"\bRegister<bit<(\d+)>, pool_reg_index_t>\(NUM_POOL_SLOTS, \w+\) level_state;", text)
    assert declared and int(declared.group(1)) == register.type_spec.bitstring.bit.bitwidth
    parser = (TNA_DIR / "parser.p4").read_text()
    assert re.search(r"NETAGG_TREE_UDP_PORT:\s*parse_netagg;", parser)


def test_compiler_warnings_are_split_from_target_notes():
    output = "\n".join([
        "warning: Parser state min_parse_depth_accept_loop will be unrolled up to 4 times "
        "due to @pragma max_loop_depth.",
        "p4src/tna/x.p4(3): [--Wwarn=overflow] warning: 8s0x80: signed value does not fit in 8 bits",
        "0 errors, 2 warnings generated.",
        "error: something else",
    ])
    warnings, notes = compiler_warnings(output)
    assert warnings == ["p4src/tna/x.p4(3): [--Wwarn=overflow] warning: 8s0x80: signed value does not fit in 8 bits"]
    assert len(notes) == 1 and "min_parse_depth" in notes[0]
    # The assembler's merged hash groups are notes; an unmerged conflict is not a warning but an error,
    # and any other assembler warning stays a warning.
    bfas = ["/o/pipe/netagg.bfa:4143: warning: Input xbar hash group 0 mergeable conflict in stage 0",
            "/o/pipe/netagg.bfa:1378: warning: conflicting hash group definition here",
            "/o/pipe/netagg.bfa:16838: warning: exact hashtable 0 does not exist in table value_sum_values_11",
            "/o/pipe/netagg.bfa:99: warning: something the assembler has not said before"]
    warnings, notes = compiler_warnings("\n".join(bfas))
    assert notes == bfas[:3] and warnings == bfas[3:]


def _defines() -> dict[str, int]:
    """Every object-like numeric #define of the shared and TNA defines."""
    text = (dp.P4SRC_DIR / "shared" / "defines.p4").read_text() + (TNA_DIR / "defines.p4").read_text()
    return {name: int(value, 0) for name, value in re.findall(r"^#define (\w+) (0x[0-9a-fA-F]+|\d+)\s*$", text, re.M)}


def _table_entries(source: str, name: str) -> list[tuple[list[str], str]]:
    """A table's const entries in order, each (key tokens, action call); a one-key entry's parentheses
    are optional."""
    text = (TNA_DIR / source).read_text()
    table = text[text.index(f"table {name} {{"):]
    entries = table[table.index("const entries = {") + len("const entries = {"):table.index("const default_action")]
    entries = re.sub(r"/\*.*?\*/", "", entries, flags=re.S)
    return [([k.strip() for k in keys.strip().strip("()").split(",")], action)
            for keys, action in re.findall(r"([^:;{}]+?)\s*:\s*(\w+\([^)]*\));", entries)]


def _checks_entries() -> list[tuple[list[str], str]]:
    """Pass 1's checks table: its const entries in order, each (key tokens, action call)."""
    return _table_entries("netagg.p4", "checks")


def _key_value(token: str, defines: dict[str, int]) -> int:
    """An entry's key token as a number: a literal, a boolean, or a #define."""
    if token in ("true", "false"):
        return int(token == "true")
    return int(token, 0) if token[0].isdigit() else defines[token]


class _Table:
    """A table's const entries as match rules (None: a wildcard; (value,) or (value, mask)) and its default
    action: what the switch does with the key fields of one packet, first match first."""

    def __init__(self, source: str, name: str, defines: dict[str, int]):
        text = (TNA_DIR / source).read_text()
        table = text[text.index(f"table {name} {{"):]
        self.keys = re.findall(r"@name\(\"(\w+)\"\)", table[:table.index("actions")])
        self.default = re.search(r"const default_action = (\w+\([^)]*\));", table).group(1)
        self.rules = []
        for keys, action in _table_entries(source, name):
            assert len(keys) == len(self.keys), keys
            self.rules.append(([None if k == "_" else tuple(_key_value(x.strip(), defines) for x in k.split("&&&"))
                                for k in keys], action))

    def first_match(self, fields: dict[str, int]) -> str:
        for keys, action in self.rules:
            if all(k is None or (fields[n] & (k[1] if len(k) == 2 else -1)) == k[0] for n, k in zip(self.keys, keys)):
                return action
        return self.default


def _decision_chain() -> list[str]:
    """The drop reasons of pass 1's checks, in the order their entries are tried."""
    return [m.group(1) for _, action in _checks_entries() if (m := re.match(r"refuse\((DROP_\w+),", action))]


def _v1model_checks(p: dict, d: dict[str, int]) -> str:
    """The v1model program's if/else chain (v1model/netagg.p4), transcribed: the TNA checks table's reference."""
    if p["parser_err"] != 0:
        return "refuse(DROP_MALFORMED, 0)"
    if not p["ipv4"]:
        return "refuse(DROP_NOT_IPV4, 0)"
    if p["down"] == 0 and p["udp"] and p["udp_src"] == d["NETAGG_UDP_PORT"]:
        return "refuse(DROP_SPOOFED_SOURCE, 0)"
    if p["down"] == 0 and (p["spoof_address"] or p["spoof_port"]):
        return "refuse(DROP_SPOOFED_SOURCE, 0)"
    if not p["netagg"]:
        return "forward()"
    if p["version"] != d["NETAGG_VERSION"]:
        return "refuse(DROP_BAD_VERSION, 0)"
    if p["bad_shape"]:
        return "refuse(DROP_MALFORMED, 0)"
    if p["flags"] & d["FLAG_RESULT"] and p["down"] == 0:
        return "refuse(DROP_RESULT_FROM_HOST, 0)"
    if p["job_hit"] == 0:
        return "refuse(DROP_UNKNOWN_JOB, 0)"
    if p["worker_hit"] == 0 and p["down"] == 0:
        return "refuse(DROP_UNKNOWN_WORKER, 1)"
    if p["wrong_width"]:
        return "refuse(DROP_WRONG_WIDTH, 1)"
    if p["slot_out_of_range"]:
        return "refuse(DROP_SLOT_OUT_OF_RANGE, 1)"
    if p["pool"] >> 1:
        return "refuse(DROP_BAD_POOL, 1)"
    if p["rank_mismatch"] and p["down"] == 0:
        return "refuse(DROP_RANK_MISMATCH, 1)"
    if p["not_member"] and p["down"] == 0:
        return "refuse(DROP_NOT_A_MEMBER, 1)"
    if p["flags"] & d["FLAG_CLOSE"]:
        return "refuse(DROP_CLOSE_REFUSED, 1)"
    return "admit()"


def test_checks_table_is_the_v1model_chain():
    """The checks table's first matching entry is the v1model chain's decision, for every combination of
    the values each key's tests tell apart (its "!=" checks are written as entries after the packets that
    pass: a slip there would pass the wrong packets on)."""
    d = _defines()
    checks = _Table("netagg.p4", "checks", d)
    names = checks.keys
    domains = {name: (0, 1) for name in names}
    domains.update(parser_err=(0, 2), udp_src=(d["NETAGG_UDP_PORT"], 1234), version=(d["NETAGG_VERSION"], 3),
                   flags=(0, d["FLAG_RESULT"], d["FLAG_CLOSE"], d["FLAG_RESULT"] | d["FLAG_CLOSE"], 0x78),
                   pool=(0, 1, 2, 3))
    for combo in itertools.product(*(domains[n] for n in names)):
        packet = dict(zip(names, combo))
        assert checks.first_match(packet) == _v1model_checks(packet, d), packet


def test_resource_report_without_metrics_counts_the_placement(tmp_path):
    """p4lang's open bf-p4c writes no metrics.json: the report is counted from resources.json and phv.json."""
    def stage(number, salus, tables, srams, tcams):
        return {"stage_number": number, "meter_alus": {"meters": [{}] * salus},
                "logical_tables": {"ids": [{"id": i} for i in range(tables)]},
                "rams": {"srams": [{}] * srams}, "tcams": {"tcams": [{}] * tcams}}
    (tmp_path / "resources.json").write_text(json.dumps({"resources": {"mau": {"mau_stages": [
        stage(0, 0, 3, 2, 1), stage(1, 4, 2, 5, 0), stage(2, 0, 0, 0, 0)]}}}))
    slice_ = lambda lsb, msb: {"slice_info": {"lsb": lsb, "msb": msb}}  # noqa: E731
    (tmp_path / "phv.json").write_text(json.dumps({"target": "tofino", "compiler_version": "9.13.4", "containers": [
        {"slices": [slice_(0, 7), slice_(0, 3)]},      # two fields overlaid: 8 bits occupied
        {"slices": [slice_(0, 8), slice_(12, 15)]}]}))  # 9 + 4
    report = ResourceReport.from_logs(tmp_path)
    assert (report.target, report.stages_used, report.stateful_alus, report.stateful_alus_by_stage) == \
        ("tofino", 2, 4, (0, 4, 0))
    assert (report.logical_tables, report.srams, report.tcams, report.phv_bits) == (5, 7, 1, 21)


def test_source_checks_both_widths():
    """Both widths' lengths and both codes (any other code is MALFORMED); set_job takes the job's width (its
    parameters match the P4Info's in test_wire_p4_agreement.py); a packet of another width than its job's is
    WRONG_WIDTH, a job reject, decided right before the slot range as in the v1model program; a wide one of its
    job's width is aggregated (its passes: the simulation below)."""
    text = _tna_sources()
    for define in ("NETAGG_WIDTH", "NETAGG_WIDTH_WIDE", "NETAGG_IPV4_TOTAL_LENGTH", "NETAGG_UDP_LENGTH",
                   "NETAGG_WIDE_IPV4_TOTAL_LENGTH", "NETAGG_WIDE_UDP_LENGTH"):
        assert re.search(rf"\b{define}\b", text), define
    set_job = re.search(r"\baction set_job\((.*?)\)", text, re.S).group(1)
    assert set_job.split(",")[-1].split() == ["bit<8>", "width"]
    assert re.search(r"if \(hdr\.netagg\.width != meta\.job_width\) \{\s*meta\.wrong_width = 1;", text)
    # Pass 1 starts a wide packet at chunk 0's step, a narrow one at 0 (its width code).
    assert re.search(r"hdr\.recirc\.step = hdr\.netagg\.width;", text)
    chain = _decision_chain()
    assert chain.index("DROP_WRONG_WIDTH") + 1 == chain.index("DROP_SLOT_OUT_OF_RANGE")
    assert chain.index("DROP_UNKNOWN_WORKER") < chain.index("DROP_WRONG_WIDTH")
    assert ("refuse(DROP_WRONG_WIDTH, 1)" in [action for _, action in _checks_entries()])


def test_missing_parser_states_finds_a_select_the_compiler_cut_off():
    """A compiler that drops a select's match registers (p4lang/p4c#5753) emits bare `*` transitions and
    only the first branch; the build check names the program's states its parsers lost."""
    program = (TNA_DIR / "parser.p4").read_text()
    assert program_parser_states(program) == {
        "ingress": {"parse_recirc", "parse_recirc_values", "parse_recirc_read", "parse_ethernet", "parse_ipv4",
                    "parse_udp", "parse_netagg", "parse_values", "probe_wide"},
        "egress": {"parse_ethernet"}}

    def bfa(ingress: list[str], egress: list[str]) -> str:
        def states(names):
            return "".join(f"    {n}:\n      *:\n        shift: 1\n" for n in names)
        return (f"version: 1\nparser ingress:\n  start: $init_match\n  states:\n{states(['$init_match', *ingress])}"
                f"deparser ingress:\n  emit: []\nparser egress:\n  states:\n{states(egress)}deparser egress:\n")
    whole = ["parse_recirc", "parse_recirc.$split_0", "parse_recirc_values", "parse_recirc_read", "parse_ethernet",
             "parse_ethernet.$split_0", "parse_ipv4", "parse_udp", "parse_netagg", "parse_values.$split_3",
             "parse_values", "probe_wide.$split_20"]
    assert missing_parser_states(program, bfa(whole, ["parse_ethernet"])) == []
    cut = [s for s in whole if not s.startswith(("parse_ethernet", "parse_ipv4", "parse_udp", "parse_netagg", "probe"))]
    assert missing_parser_states(program, bfa(cut, ["min_parse_depth_accept_initial"])) == [
        "egress: parse_ethernet", "ingress: parse_ethernet", "ingress: parse_ipv4", "ingress: parse_netagg",
        "ingress: parse_udp", "ingress: probe_wide"]


@pytest.fixture
def front_end():
    missing = front_end_missing()
    if missing is not None:
        pytest.skip(f"{missing}: cannot run p4c's front end over p4src/tna/netagg.p4 for Tofino")


def test_front_and_mid_end_pass_without_a_warning(front_end):
    """p4c's front and mid end accept the TNA program against the real tna.p4, warnings included."""
    check_front_end()


def test_front_end_check_fails_on_a_warning(front_end, tmp_path):
    """The check is not vacuous: the same sources with one metadata field left uninitialised in the
    ingress parser (TNA leaves metadata undefined) fail it."""
    shutil.copytree(dp.P4SRC_DIR, tmp_path / "p4src")
    parser = tmp_path / "p4src" / "tna" / "parser.p4"
    text = parser.read_text()
    assert text.count("meta.flags_round = 0;\n") == 1
    parser.write_text(text.replace("meta.flags_round = 0;\n", ""))
    with pytest.raises(TofinoCompileError, match="uninitialized"):
        check_front_end(tmp_path / "p4src" / "tna" / "netagg.p4", tmp_path / "p4src")


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    if not compiler_available():
        pytest.skip("bf-p4c is not on PATH: cannot compile p4src/tna/netagg.p4 for Tofino "
                    "(build p4lang/p4c with its tofino backend; see docs/tofino.md)")
    return compile_tna(tmp_path_factory.mktemp("tofino"))


@pytest.mark.tofino
@pytest.mark.slow
def test_program_fits_tofino1(build):
    report = build.report
    assert report.target == "tofino"
    assert 0 < report.stages_used <= TOFINO1_STAGES, report.summary()
    assert max(report.stateful_alus_by_stage) <= TOFINO1_STATEFUL_ALUS_PER_STAGE
    assert report.stateful_alus == EXPECTED_STATEFUL_ALUS, report.summary()


@pytest.mark.tofino
@pytest.mark.slow
def test_only_target_notes_no_warnings(build):
    # compile_tna raised on any other warning; the notes are the compiler's own padding and the
    # assembler's merged hash groups (tna_build.COMPILER_NOTES).
    assert all("min_parse_depth" in note or ".bfa:" in note for note in build.notes)


@pytest.mark.tofino
@pytest.mark.slow
def test_control_plane_tables_match_the_v1model_program(build):
    bfrt = json.loads((build.out_dir / "bfrt.json").read_text())
    tables = {t["name"].removeprefix("pipe."): t for t in bfrt["tables"]}
    for table in load_p4info(dp.P4INFO_PATH).tables:
        name = table.preamble.name
        assert name in tables, name
        keys = [k["name"] for k in tables[name]["key"]]
        assert keys == [m.name for m in table.match_fields], name


class _Pass:
    """One pass after the first, as p4src/tna writes it: the recirculation parser, ResultDelivery's
    `delivery` table, the value pairs (keyed by the operation), then the branch after them in netagg.p4 and
    WideStep's `wide_next` table. Values are modelled as a cell's low words (values 0 .. 31 of it) and high
    words (32 .. 63), each half a tuple with its header's validity apart (an action writes a field whether or
    not its header is valid; the deparser emits only valid ones); the registers as {cell: [low, high]}."""

    def __init__(self):
        self.d = _defines()
        self.delivery = _Table("control/result_delivery.p4", "delivery", self.d)
        self.next = {_key_value(keys[0], self.d): action
                     for keys, action in _table_entries("control/wide_steps.p4", "wide_next")}

    def decide(self, packet: dict) -> str:
        return self.delivery.first_match({"deliver": packet["deliver"], "value_op": packet["op"], "round_ce": 0,
                                          "step": packet["step"], "parser_err": packet["parser_err"]})

    def run(self, packet: dict, cells: dict) -> str:
        """One pass: the packet changed in place; returns the delivery action taken."""
        d = self.d
        packet["parser_err"] = 0
        packet["lo"] = packet["hi"] = ()
        valid = set()
        if not packet["step"] & 0x8:  # parse_recirc_values: one cell's values from the front
            if len(packet["payload"]) < 2:
                packet["parser_err"] = 2  # PARTIAL_HDR
            else:
                packet["lo"], packet["hi"] = packet["payload"][:2]
                packet["payload"] = packet["payload"][2:]
                valid = {"lo", "hi"}
        action = self.decide(packet)
        name = action.split("(")[0]
        if name == "malformed":
            packet["op"] = d["OP_NONE"]
        if name == "again_high":
            valid.add("hi")
        if name == "again_low" or name.startswith(("to_", "up")):
            valid.add("lo")
        # The value pairs, at the recirc header's index.
        op, cell = packet["op"], packet["reg_index"]
        add = lambda a, b: tuple((x + y) & 0xFFFFFFFF for x, y in zip(a, b))  # noqa: E731
        if op == d["OP_WRITE"]:
            cells[cell] = [packet["lo"], packet["hi"]]
        elif op == d["OP_MERGE"]:
            cells[cell] = [add(cells[cell][0], packet["lo"]), add(cells[cell][1], packet["hi"])]
            packet["lo"] = cells[cell][0]
        elif op == d["OP_READ"]:
            packet["lo"] = cells[cell][0]
        elif op == d["OP_READ_HI"]:
            packet["hi"] = cells[cell][1]
        # netagg.p4's branch after the pairs.
        if packet["step"] == 0:
            if packet["deliver"] != d["DELIVER_NONE"] and op in (d["OP_MERGE"], d["OP_READ"]):
                packet["op"] = d["OP_READ_HI"]
        elif packet["step"] != d["WIDE_STEP_LAST"]:
            step_action = self.next.get(packet["step"], "NoAction()")
            verb, arg = re.match(r"(\w+)\((\w*)\)", step_action).groups()
            if verb in ("next_chunk", "chunks_done"):
                valid.clear()
            if verb == "next_chunk":
                packet["reg_index"] += packet["stride"]
            if verb == "chunks_done":
                packet["step"], packet["op"] = d["WIDE_STEP_READ_FIRST"], d["OP_READ_HI"]
            elif verb in ("low_half", "previous_chunk"):
                packet["op"] = d["OP_READ"] if verb == "low_half" else d["OP_READ_HI"]
                if verb == "previous_chunk":
                    packet["reg_index"] -= packet["stride"]
            if arg:
                packet["step"] = _key_value(arg, d)
        # The deparser: the valid halves in front of the payload.
        packet["payload"] = [packet[h] for h in ("lo", "hi") if h in valid] + packet["payload"]
        return action

    def through(self, packet: dict, cells: dict) -> tuple[str, int]:
        """Passes until the packet is dropped or delivered: (the last action, passes taken)."""
        for passes in range(1, 20):
            action = self.run(packet, cells)
            if not action.startswith("again"):
                return action, passes
        raise AssertionError(f"a packet recirculated 20 times: {packet}")


def _wide_packet(values: list[int], op: int, deliver: int, cell: int, stride: int, step: int = 1) -> dict:
    halves = [tuple(values[i:i + 32]) for i in range(0, len(values), 32)]
    return {"op": op, "deliver": deliver, "step": step, "reg_index": cell, "stride": stride, "payload": halves}


def test_wide_packets_take_each_chunk_once_and_leave_with_the_sums_in_order():
    """A wide round on the TNA twin, pass by pass from the tables' entries: each contribution's chunk c is
    added at cell + c * stride (the job's slot count), an absorbed one is dropped after its chunk 3 (5 passes
    in all), the completing one leaves for the group after 8 read passes with the 256 sums in the wire's order
    (13 passes); a resend reads the same sums back to its sender; a parent's result is written and goes to
    the group as it came; a packet shorter than its lengths say (the first arrival's probe refuses it before
    pass 1; this is the later passes' guard) is dropped as MALFORMED at its missing chunk, touching no cell there;
    and a narrow packet still takes two passes after the first."""
    sim, d = _Pass(), _defines()
    rng = random.Random(7)
    cell, stride = 40, 12  # the slot's cell, and a job of 12 wide slots
    contributions = [[rng.randrange(-2**31, 2**31) for _ in range(256)] for _ in range(3)]
    total = [sum(v[i] for v in contributions) & 0xFFFFFFFF for i in range(256)]
    cells: dict = {}
    for values, op in zip(contributions[:2], ("OP_WRITE", "OP_MERGE")):
        packet = _wide_packet(values, d[op], d["DELIVER_NONE"], cell, stride)
        assert sim.through(packet, cells) == ("absorb()", 4)
    assert sorted(cells) == [cell + c * stride for c in range(4)]
    last = _wide_packet(contributions[2], d["OP_MERGE"], d["DELIVER_GROUP"], cell, stride)
    assert sim.through(last, cells) == ("to_group()", 12)
    assert [v for half in last["payload"] for v in half] == total
    assert sorted(cells) == [cell + c * stride for c in range(4)]
    resend = _wide_packet(contributions[0], d["OP_READ"], d["DELIVER_SENDER"], cell, stride)
    assert sim.through(resend, cells) == ("to_sender()", 12)
    assert resend["payload"] == last["payload"]
    parent = [rng.randrange(2**32) for _ in range(256)]
    down = _wide_packet(parent, d["OP_WRITE"], d["DELIVER_GROUP"], cell, stride)
    assert sim.through(down, cells) == ("to_group()", 12)
    assert [v for half in down["payload"] for v in half] == parent
    # Truncated after chunk 1: chunks 0 and 1 taken, then MALFORMED with the pairs left alone.
    before = {c: list(v) for c, v in cells.items()}
    short = _wide_packet(contributions[1][:128], d["OP_MERGE"], d["DELIVER_NONE"], cell, stride)
    assert sim.through(short, cells) == ("malformed()", 3)
    assert [cells[cell + c * stride] == before[cell + c * stride] for c in range(4)] == [False, False, True, True]
    # Narrow: merge (low words) and once more for the high words, at the slot's cell only.
    narrow = _wide_packet(contributions[0][:64], d["OP_MERGE"], d["DELIVER_GROUP"], 7, stride, step=0)
    cells[7] = [tuple([1] * 32), tuple([2] * 32)]
    assert sim.through(narrow, cells) == ("to_group()", 2)
    assert [v for half in narrow["payload"] for v in half] == \
        [(v + (1 if i < 32 else 2)) & 0xFFFFFFFF for i, v in enumerate(contributions[0][:64])]


def test_a_wide_packets_first_arrival_is_probed_whole_before_pass_1():
    """Pass 1 extracts 64 of a wide packet's values, so a truncated one would be found only after its slot
    counted it. Its first arrival is a probe instead: the parser skips to the last value and extracts it (a
    shorter packet is a parser error, MALFORMED in the checks before any register changes), and the ingress
    resubmits the packet, whose resubmitted pass (resubmit_flag set) parses the usual way and is its pass 1."""
    d = _defines()
    text = (TNA_DIR / "defines.p4").read_text()
    skip = re.search(r"^#define WIDE_PROBE_SKIP_BITS \(\((\w+) - (\d+)\) \* 32\)$", text, re.M)
    skip_bits = (d[skip.group(1)] - int(skip.group(2))) * 32
    assert skip_bits + 32 == d["NETAGG_WIDE_K"] * 32  # the probe's extract ends where the 256th value does
    parser = (TNA_DIR / "parser.p4").read_text()
    assert re.search(r"select\(ig_intr_md\.resubmit_flag, hdr\.netagg\.width\) \{\s*\(0, NETAGG_WIDTH_WIDE\): "
                     r"probe_wide;\s*default: parse_values;", parser)
    probe = re.search(r"state probe_wide \{(.*?)\}", parser, re.S).group(1)
    assert [s.strip() for s in probe.strip().splitlines() if s.strip()] == [
        "packet.advance(WIDE_PROBE_SKIP_BITS);", "packet.extract(hdr.wide_last);", "meta.wide_whole = 1;",
        "transition accept;"]
    # The recirculation port's path is taken only by a packet that was not resubmitted.
    assert re.search(r"select\(ig_intr_md\.resubmit_flag, ig_intr_md\.ingress_port\[6:0\]\) \{\s*"
                     r"\(0, RECIRC_PORT_LOCAL\): parse_recirc;\s*default: parse_ethernet;", parser)
    assert re.search(r"if \(ig_dprsr_md\.resubmit_type == RESUBMIT_WIDE\) \{\s*resubmit\.emit\(\);", parser)
    top = (TNA_DIR / "netagg.p4").read_text()
    # Before pass 1 and after the later passes' branch: a whole wide packet does nothing but resubmit.
    branch = re.search(r"\} else if \(meta\.wide_whole == 1 && ig_prsr_md\.parser_err == 0\) \{(.*?)\} else \{\s*"
                       r"/\* Pass 1\.", top, re.S)
    assert branch and re.sub(r"/\*.*?\*/", "", branch.group(1), flags=re.S).split() == [
        "ig_dprsr_md.resubmit_type", "=", "RESUBMIT_WIDE;"]
