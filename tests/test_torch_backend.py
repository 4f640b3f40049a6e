"""The ``netagg`` torch.distributed backend under torchrun: same training as Gloo, job created and deleted."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from netagg import dataplane as dp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
EXAMPLE = dp.REPO_ROOT / "examples" / "torchrun_ddp.py"
STEPS = 20


def _need_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("torch is not installed (optional extra: pip install -e '.[torch]')")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    _need_torch()
    from netagg.bmv2.deployment import LocalDeployment

    with LocalDeployment(tmp_path_factory.mktemp("torch-backend"), capacity=256) as local:
        yield local


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its ranks in sessions of their own: killpg misses them)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            out += [child, *_descendants(child)]
    return out


def _kill_tree(pid: int) -> None:
    """SIGKILL the launcher's process group and every rank below it (a hung rank would keep renewing its job's
    lease and hold the pipes open)."""
    for target in _descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _torchrun(deployment, nproc: int, save: Path, backend: str = "netagg", device: str = "cpu",
              extra: tuple[str, ...] = (), **env: str) -> tuple[list[dict], str]:
    """Run the example under torchrun; returns every rank's JSON line (rank order) and stderr."""
    from netagg.bmv2.deployment import TENANT_TOKEN

    environment = {**os.environ, "NETAGG_CONFIG": str(deployment.config_path), "NETAGG_TOKEN": TENANT_TOKEN,
                   "NETAGG_WORKER_HOST": "127.0.0.1", "OMP_NUM_THREADS": "1", **env}
    # In a session of its own, so that a timeout kills the ranks too (orphaned ranks would hold ports and CPU).
    process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                str(nproc), str(EXAMPLE), "--backend", backend, "--steps", str(STEPS), "--save",
                                str(save), "--device", device, *extra],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
                               cwd=dp.REPO_ROOT, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        _kill_tree(process.pid)
        stdout, stderr = process.communicate()
        for job in _jobs(deployment):  # the dead ranks' job would hold the switch until its lease lapsed
            deployment.cli("job", "delete", str(job["job_id"]))
        pytest.fail(f"torchrun with {nproc} ranks did not finish in 240 s:\n{stderr[-4000:]}")
    except BaseException:  # pytest's own timeout, ^C: no rank outlives the test
        _kill_tree(process.pid)
        raise
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((save / f"rank{r}.json").read_text()) for r in range(nproc)], result.stderr


def _params(save: Path, nproc: int) -> list[dict]:
    import torch

    return [torch.load(save / f"rank{r}.pt") for r in range(nproc)]


def _jobs(deployment) -> list[dict]:
    return json.loads(deployment.cli("--json", "job", "list"))


@pytest.mark.parametrize("nproc", [2, 3])
def test_ddp_on_netagg_backend_matches_gloo(deployment, tmp_path: Path, nproc: int) -> None:
    import torch

    ranks, _ = _torchrun(deployment, nproc, tmp_path / "netagg")
    _, _ = _torchrun(deployment, nproc, tmp_path / "gloo", backend="gloo")
    netagg, gloo = _params(tmp_path / "netagg", nproc), _params(tmp_path / "gloo", nproc)
    # Every gradient allreduce of DDP went through the switch, under one job that is gone now.
    assert {r["netagg"]["job_id"] for r in ranks} == {ranks[0]["netagg"]["job_id"]}
    assert all(r["backend"] == "netagg" and r["netagg"]["admission"] == "full" for r in ranks)
    assert all(r["netagg"]["netagg_allreduces"] >= STEPS for r in ranks)
    assert _jobs(deployment) == []
    # Identical parameters on every rank...
    for other in netagg[1:]:
        assert all(torch.equal(netagg[0][name], other[name]) for name in netagg[0])
    # ...equal to Gloo's within the quantization bound (block floating point, ~2**-28 relative per step).
    for name, value in netagg[0].items():
        torch.testing.assert_close(value, gloo[0][name], rtol=1e-4, atol=1e-5)
    # Collectives besides DDP's: half-precision SUM/AVG through netagg, the rest delegated to Gloo.
    total = nproc * (nproc + 1) / 2
    for r in ranks:
        assert r["collectives"] == {"fp16_avg": total / nproc, "bf16_sum": total, "max": nproc - 1,
                                    "int_sum": total, "broadcast": 10.0, "all_gather": list(range(nproc))}


@pytest.mark.timeout(600)  # two torchruns of 3 ranks
def test_amp_overflows_skip_the_same_steps_on_every_rank_as_with_gloo(deployment, tmp_path: Path) -> None:
    """Mixed precision: rank 0's gradients overflow alone (examples/torchrun_ddp.py --amp); the allreduce carries
    inf/NaN to every rank, so every rank's GradScaler skips the same steps as with Gloo, and the parameters end up
    where Gloo's do (without the flags the other ranks would step on finite sums and drift apart)."""
    import torch

    nproc = 3
    ranks, _ = _torchrun(deployment, nproc, tmp_path / "netagg", extra=("--amp",))
    gloo_ranks, _ = _torchrun(deployment, nproc, tmp_path / "gloo", backend="gloo", extra=("--amp",))
    skipped = ranks[0]["skipped"]
    assert 0 < len(skipped) < STEPS  # some steps overflowed, not all
    assert all(r["skipped"] == skipped for r in ranks)
    assert gloo_ranks[0]["skipped"] == skipped
    netagg, gloo = _params(tmp_path / "netagg", nproc), _params(tmp_path / "gloo", nproc)
    for other in netagg[1:]:
        assert all(torch.equal(netagg[0][name], other[name]) for name in netagg[0])
    for name, value in netagg[0].items():
        assert torch.isfinite(value).all()
        torch.testing.assert_close(value, gloo[0][name], rtol=1e-4, atol=1e-5)


def test_partial_admission_warns_once_and_trains(deployment, tmp_path: Path) -> None:
    ranks, stderr = _torchrun(deployment, 2, tmp_path / "partial", NETAGG_SLOTS="1000")
    # The software target's default width: 256 cells hold 64 wide slots.
    assert all(r["netagg"]["admission"] == "partial" and r["netagg"]["slots"] == 64 for r in ranks)
    assert stderr.count("got 64 of 1000 slots") == 1
    assert ranks[0]["param_checksum"] == ranks[1]["param_checksum"]
    assert _jobs(deployment) == []


def test_no_free_slots_and_no_ps_delegates_to_gloo(deployment, tmp_path: Path) -> None:
    blocker = json.loads(deployment.cli("--json", "job", "create", "--name", "blocker", "--slots", "64",
                                        "--workers", "local:9,local:10"))["job"]["job_id"]
    try:
        ranks, stderr = _torchrun(deployment, 2, tmp_path / "none")
    finally:
        deployment.cli("job", "delete", str(blocker))
    assert all(r["netagg"]["mode"] == "gloo" and r["netagg"]["job_id"] is None for r in ranks)
    assert stderr.count("allreduce is delegated to Gloo") == 1
    assert ranks[0]["param_checksum"] == ranks[1]["param_checksum"]
    assert ranks[0]["collectives"]["fp16_avg"] == 1.5
    assert _jobs(deployment) == []


def test_cuda_tensors_go_through_host_memory(deployment, tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA path (copy through host memory) is not exercised here")
    ranks, _ = _torchrun(deployment, 2, tmp_path / "cuda", device="cuda")
    assert all(r["netagg"]["netagg_allreduces"] >= STEPS for r in ranks)
    assert _jobs(deployment) == []


def test_lease_expires_when_the_ranks_die(deployment, tmp_path: Path) -> None:
    import signal
    import time

    from netagg.bmv2.deployment import TENANT_TOKEN

    environment = {**os.environ, "NETAGG_CONFIG": str(deployment.config_path), "NETAGG_TOKEN": TENANT_TOKEN,
                   "NETAGG_WORKER_HOST": "127.0.0.1", "OMP_NUM_THREADS": "1", "NETAGG_LEASE": "3"}
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                 "2", str(EXAMPLE), "--steps", "1000000"], env=environment, cwd=dp.REPO_ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _jobs(deployment):
            assert launcher.poll() is None and time.monotonic() < deadline, "the job was never created"
            time.sleep(0.2)
        time.sleep(4)  # longer than the lease: rank 0 renews it
        assert _jobs(deployment), "the lease expired although rank 0 renews it"
    finally:  # SIGKILL the ranks (no shutdown path runs), then the launcher
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
        for pid in (children.read_text().split() if children.exists() else []):
            os.kill(int(pid), signal.SIGKILL)
        launcher.kill()
        launcher.wait(timeout=30)
    deadline = time.monotonic() + 15
    while _jobs(deployment):
        assert time.monotonic() < deadline, "the dead job's lease did not expire"
        time.sleep(0.2)
