"""The DDP communication hook: torch trains through netagg with the same result as DDP's own allreduce."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from netagg import dataplane as dp
from netagg.localports import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
EXAMPLE = dp.REPO_ROOT / "examples" / "torch_ddp_digits.py"


def _train(configs, hook: str, tmp_path) -> list[dict]:
    master = f"127.0.0.1:{free_ports(1, 'tcp')[0]}"
    procs = []
    for cfg in configs:
        path = tmp_path / f"{hook}-rank{cfg.rank}.yaml"
        cfg.save(path)
        procs.append(subprocess.Popen([sys.executable, str(EXAMPLE), "--config", str(path), "--master", master,
                                       "--steps", "20", "--hook", hook], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=dp.REPO_ROOT))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_ddp_with_netagg_hook_matches_gloo(tmp_path):
    pytest.importorskip("torch", reason="torch is optional: pip install torch==2.13.0")
    pytest.importorskip("sklearn", reason="the example's data set comes with scikit-learn")
    from netagg.testing.softswitch import LoopbackSwitch

    with LoopbackSwitch() as switch:
        netagg = _train(switch.add_job(2, slot_count=32), "netagg", tmp_path)
        counters = switch.counters(1)
    gloo = _train(netagg_configs_without_switch(tmp_path), "none", tmp_path)
    assert all(r["buckets_through_netagg"] >= 20 for r in netagg)
    assert counters["results"] > 0 and counters["contributions"] == 2 * counters["results"]
    # Every rank applied the same averaged gradient...
    assert netagg[0]["param_checksum"] == netagg[1]["param_checksum"]
    # ...which is DDP's own average up to quantization.
    assert netagg[0]["param_checksum"] == pytest.approx(gloo[0]["param_checksum"], rel=1e-3)
    assert netagg[0]["test_accuracy"] == pytest.approx(gloo[0]["test_accuracy"], abs=0.02)


def netagg_configs_without_switch(tmp_path):
    """Configs for the Gloo-only run (the hook is not registered, so no switch is contacted)."""
    from netagg.jobconfig import Endpoint, WorkerConfig

    return [WorkerConfig(job_id=1, rank=r, num_workers=2, slot_count=1, mode="allreduce",
                         aggregator=Endpoint("127.0.0.1", 9), bind=Endpoint("127.0.0.1", 9)) for r in range(2)]
