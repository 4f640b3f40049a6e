"""The TNA program compiles for Tofino 1 with the open-source Tofino compiler and fits it."""

import json

import pytest

from netagg import dataplane as dp
from netagg.bmv2.tna_build import (
    TOFINO1_STAGES,
    TOFINO1_STATEFUL_ALUS_PER_STAGE,
    compile_tna,
    compiler_available,
    compiler_warnings,
)
from netagg.p4info import load_p4info

#: 32 value pairs; slot owner, two pools' rounds, bitmap (paired with the round's members: subset
#: rounds add no ALU), count and exponent; the round's exchange and flags (protocol version 3).
EXPECTED_STATEFUL_ALUS = 32 + 8


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
    # compile_tna raised on any other warning; the notes are the compiler's own padding.
    assert all("min_parse_depth" in note for note in build.notes)


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
