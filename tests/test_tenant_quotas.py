"""Tenant quotas and fair shares at admission (docs/controller.md, "Quotas and fair shares"; issue 40, part 1).

The job service over a stand-in switch (``conftest.FakeFabric``) and a real SQLite file: a tenant's
``max_jobs`` refuses one job too many; ``max_cells`` caps what its jobs hold together (a request beyond it gets
what is left, then the PS, or a refusal without one); ``slots.fair_share`` splits the switch by the tenants'
weights; the jobs a restarted controller finds in its database count.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from netagg.controller.admission import JobRequest
from netagg.controller.config import TenantLimits, load_config
from netagg.controller.errors import ServiceError
from netagg.controller.service import Caller, JobService
from netagg.controller.store import JobStore
from netagg.jobconfig import ConfigError

from conftest import FakeFabric, controller_config

ALICE, BOB = Caller("alice"), Caller("bob")


def _config_path(tmp_path: Path, capacity: int = 64, fair_share: bool | None = None, **tenants: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = controller_config(tmp_path, "127.0.0.1:1", aggregator_port=28900, capacity=capacity, min_slots=4)
    data = yaml.safe_load(path.read_text())
    for name, limits in tenants.items():
        data["tenants"][name].update(limits)
    if fair_share is not None:
        data["slots"]["fair_share"] = fair_share
    path.write_text(yaml.safe_dump(data))
    return path


def _service(path: Path) -> JobService:
    config = load_config(path)
    service = JobService(config, JobStore(config.database), FakeFabric())  # type: ignore[arg-type]
    service.load()
    return service


_PORT = [41000]


def _create(service: JobService, caller: Caller, slots: int, ps: str | None = None) -> dict:
    _PORT[0] += 2
    return service.create_job(caller, JobRequest(name="j", workers=[f"local:{_PORT[0]}", f"local:{_PORT[0] + 1}"],
                                                 slots=slots, width=64, ps=ps))


def test_limits_are_read_and_bad_ones_refused(tmp_path: Path) -> None:
    config = load_config(_config_path(tmp_path, alice={"max_jobs": 2, "max_cells": 32, "weight": 3}))
    assert config.tenant_limits["alice"] == TenantLimits(2, 32, 3.0)
    assert config.tenant_limits["bob"] == TenantLimits()
    assert not config.fair_share
    for bad, message in (({"max_jobs": 0}, "max_jobs"), ({"max_cells": -4}, "max_cells"),
                         ({"weight": 0}, "weight"), ({"weight": "heavy"}, "weight"), ({"slots": 9}, "tenants.alice")):
        with pytest.raises(ConfigError, match=message):
            load_config(_config_path(tmp_path / message, alice=bad))


def test_max_jobs_refuses_one_job_too_many_and_a_deleted_job_makes_room(tmp_path: Path) -> None:
    service = _service(_config_path(tmp_path, alice={"max_jobs": 1}))
    first = _create(service, ALICE, 4)
    with pytest.raises(ServiceError) as refused:
        _create(service, ALICE, 4)
    assert refused.value.code == "quota_exceeded"
    assert "max_jobs" in str(refused.value)
    assert _create(service, BOB, 4)["admission"] == "full"  # another tenant is not limited by alice's quota
    service.delete_job(ALICE, first["job"]["job_id"])
    assert _create(service, ALICE, 4)["admission"] == "full"


def test_max_cells_caps_a_tenants_jobs_together(tmp_path: Path) -> None:
    service = _service(_config_path(tmp_path, alice={"max_cells": 24}))
    greedy = _create(service, ALICE, 99_999_999)
    assert greedy["admission"] == "partial"
    assert greedy["job"]["slot_count"] == 24
    assert "quota of 24 cells" in greedy["reason"]
    # Nothing left under the quota: with a PS the next job falls back; without one it is refused.
    fallback = _create(service, ALICE, 8, ps="ps0")
    assert (fallback["admission"], fallback["job"]["mode"]) == ("fallback", "fallback")
    assert "quota of 24 cells" in fallback["reason"]
    with pytest.raises(ServiceError) as refused:
        _create(service, ALICE, 8)
    assert refused.value.code == "quota_exceeded"
    # The switch still has room for another tenant.
    assert _create(service, BOB, 40)["job"]["slot_count"] == 40


def test_fair_share_splits_the_switch_by_weight(tmp_path: Path) -> None:
    service = _service(_config_path(tmp_path, capacity=64, fair_share=True, alice={"weight": 1}, bob={"weight": 3}))
    assert _create(service, ALICE, 1000)["job"]["slot_count"] == 16
    bob = _create(service, BOB, 1000)
    assert bob["job"]["slot_count"] == 48
    assert "fair share of 48 cells" in bob["reason"]
    # Without fair_share the first tenant takes the whole free range, as before.
    plain = _service(_config_path(tmp_path / "plain", capacity=64))
    assert _create(plain, ALICE, 1000)["job"]["slot_count"] == 64


def test_a_restarted_controller_counts_the_jobs_in_its_database(tmp_path: Path) -> None:
    path = _config_path(tmp_path, alice={"max_jobs": 2, "max_cells": 16})
    service = _service(path)
    _create(service, ALICE, 12)
    service.store.close()
    again = _service(path)
    assert _create(again, ALICE, 12)["job"]["slot_count"] == 4  # 16 less the 12 its first job holds
    with pytest.raises(ServiceError, match="max_jobs"):
        _create(again, ALICE, 4)


def test_the_job_view_the_cli_and_the_metrics_show_what_a_tenant_holds_against_its_limit(tmp_path: Path) -> None:
    from netagg.controller.cli import _format_job
    from netagg.controller.metrics import ControllerCollector

    service = _service(_config_path(tmp_path, capacity=64, fair_share=True, alice={"max_cells": 24}))
    job = _create(service, ALICE, 16)["job"]
    _create(service, ALICE, 4)
    view = service.show_job(ALICE, job["job_id"])
    assert (view["tenant_cells"], view["tenant_limit_cells"], view["tenant_limit"]) == (20, 24, "quota")
    assert "tenant alice holds 20 of its 24 cells (quota)" in _format_job(view)
    bob = service.show_job(BOB, _create(service, BOB, 8)["job"]["job_id"])
    assert (bob["tenant_cells"], bob["tenant_limit_cells"], bob["tenant_limit"]) == (8, 32, "fair share")
    families = {f.name: {s.labels["tenant"]: s.value for s in f.samples}
                for f in ControllerCollector(service)._tenants(service.store.all())}
    assert families["netagg_tenant_cells"] == {"alice": 20, "bob": 8}
    assert families["netagg_tenant_limit_cells"] == {"alice": 24, "bob": 32}


def test_a_grant_cut_by_the_free_range_says_so_not_the_quota(tmp_path: Path) -> None:
    service = _service(_config_path(tmp_path, capacity=64, alice={"max_cells": 24}))
    _create(service, BOB, 54)
    alice = _create(service, ALICE, 99)
    assert alice["job"]["slot_count"] == 10
    assert "largest free range" in alice["reason"] and "quota" not in alice["reason"]
