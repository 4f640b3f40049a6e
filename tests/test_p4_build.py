"""The P4 program compiles cleanly with p4c, and the committed P4Info is exactly p4c's output."""

import pytest

from netagg import dataplane as dp
from netagg.bmv2.p4build import compile_program, p4c_available
from netagg.p4info import load_p4info, p4info_differences

pytestmark = pytest.mark.bmv2


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    if not p4c_available():
        pytest.skip("p4c-bm2-ss is not on PATH: cannot compile p4src/netagg.p4 or check the committed P4Info "
                    "(install p4lang's p4c package)")
    return compile_program(tmp_path_factory.mktemp("p4c"))


def test_program_compiles_without_warnings(compiled):
    json_path, p4info_path = compiled
    assert json_path.stat().st_size > 0 and p4info_path.stat().st_size > 0


def test_committed_p4info_equals_generated(compiled):
    _, p4info_path = compiled
    generated, committed = load_p4info(p4info_path), load_p4info(dp.P4INFO_PATH)
    assert p4info_differences(generated, committed) == []
    assert generated == committed, "run `make p4info` and commit p4src/v1model/netagg.p4info.txtpb"
