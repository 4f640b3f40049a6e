"""``make chaos`` in short: every scenario once (one injection each), nothing lost; and its reporting."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import chaos
from netagg import dataplane as dp


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_short_chaos_run_injects_every_fault_and_loses_nothing(tmp_path):
    # 20 s of training per scenario (4): room for one injection and its recovery in each (chaos.RESERVE).
    marker = f"chaos-test-{os.getpid()}-{tmp_path.name}"  # inherited by every process it starts
    result = subprocess.run([sys.executable, "-m", "benchmarks.chaos", "--seconds", "80", "--seed", "11",
                             "--injections", "1", "--workdir", str(tmp_path / "chaos")],
                            capture_output=True, text=True, cwd=dp.REPO_ROOT, timeout=280,
                            env={**os.environ, "NETAGG_CHAOS_TEST": marker})
    out = result.stdout
    print(out)
    assert result.returncode == 0, out + result.stderr[-3000:]
    assert "result: OK, nothing lost (seed 11)" in out
    summary = out[out.index("\ninjections"):]
    for name in chaos.SCENARIOS:
        lines = [line for line in summary.splitlines() if line.startswith(f"  [{name:<6}] t=")]
        assert len(lines) == 1 and "recovered in" in lines[0], summary
    assert "kill -9 switch, down" in summary and "kill -9 controller + switch, restarted" in summary
    assert re.search(r"kill -9 PS (primary|middle|tail) :\d+", summary)
    for name in ("switch", "both", "away"):
        line = next(line for line in summary.splitlines() if line.startswith(f"  {name:<6} 1 injection in"))
        done = int(re.search(r"allreduces done (\d+)", line).group(1))
        assert done > 0 and "wrong sums 0, timeouts 0" in line, line
    failovers = re.search(r"failovers to the PS per worker \[([\d, ]+)\]", summary)
    assert failovers and all(int(n) >= 1 for n in failovers.group(1).split(",")), summary
    line = next(line for line in summary.splitlines() if line.startswith("  chain  1 injection in"))
    assert int(re.search(r"pushes acknowledged (\d+)", line).group(1)) > 0 and "lost 0, duplicated 0" in line
    assert "FAILED" not in out
    # Every process it started is gone.
    assert not processes_with(marker)


def processes_with(marker: str) -> list[str]:
    """Command lines of the processes whose environment holds ``marker``."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append((environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def test_a_loss_or_a_missing_recovery_fails_the_run():
    clean = chaos.Outcome("switch", injections=[chaos.Injection("switch", 1.0, "kill -9 switch", 2.0)])
    assert clean.ok
    assert not chaos.Outcome("switch", wrong=1).ok
    assert not chaos.Outcome("switch", timeouts=1).ok
    assert not chaos.Outcome("chain", lost=1).ok and not chaos.Outcome("chain", duplicated=1).ok
    late = chaos.Outcome("chain", injections=[chaos.Injection("chain", 1.0, "kill -9 PS tail", None)])
    assert not late.ok
    text = "\n".join(chaos.summary([clean, late]))
    assert "recovered in  2.00 s" in text and "NOT RECOVERED in time" in text


def test_bad_arguments_are_refused(capsys):
    for args in (["--scenarios", "switch,nope"], ["--scenarios", "chain,chain"], ["--seconds", "0"],
                 ["--injections", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            chaos.main(args)
        assert exit_info.value.code == 2
    assert "--scenarios" in capsys.readouterr().err
