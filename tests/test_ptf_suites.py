"""The PTF suite (ptf-tests/) against each target, on veth pairs in a private namespace.

The same suite runs against the software target (its compiled fast path, and its
readable reference model) and against BMv2; where they disagree, the software target
is wrong. Each run skips, saying why, when its
target cannot run here.
"""

import subprocess
import sys

import pytest

from netagg import dataplane as dp
from netagg.bmv2.ptf_runner import EXIT_SKIPPED, skip_reason
from netagg.bmv2.targets import SHARDED_SHARDS
from netagg.softswitch import fastpath


@pytest.mark.slow
@pytest.mark.parametrize("target", ["soft", "soft-ref", "soft-sharded", pytest.param("bmv2", marks=pytest.mark.bmv2)])
def test_ptf_suite(target, tmp_path):
    reason = skip_reason(target)
    if reason:
        pytest.skip(f"PTF suite on {target}: {reason}")
    result = subprocess.run(
        [sys.executable, "-m", "netagg.bmv2.ptf_runner", "--target", target, "--log-dir", str(tmp_path)],
        cwd=dp.REPO_ROOT, capture_output=True, text=True, timeout=1800,
    )
    output = result.stdout + result.stderr
    if result.returncode == EXIT_SKIPPED:
        pytest.skip(output.strip())
    assert result.returncode == 0, output[-6000:]
    assert "OK" in output
    if target.startswith("soft"):  # the engine that was asked for really ran the suite
        log = (tmp_path / f"{target}-switch.log").read_text()
        engine = "reference" if target == "soft-ref" or fastpath.unavailable() else "fast"
        assert f"{engine} engine" in log, log
        if target == "soft-sharded":
            assert f"{SHARDED_SHARDS} shards" in log, log
