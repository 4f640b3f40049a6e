"""A job create's request and admission, without a switch: JobRequest checks, admit's full/partial/fallback."""

from __future__ import annotations

import pytest

from netagg.controller.admission import JobRequest, admit
from netagg.controller.allocator import SlotAllocator, SlotRange
from netagg.controller.config import load_config
from netagg.controller.errors import ServiceError

from conftest import controller_config


@pytest.fixture
def config(tmp_path):
    return load_config(controller_config(tmp_path, "127.0.0.1:1", aggregator_port=1, capacity=16, min_slots=4))


def test_request_is_frozen_and_sends_only_what_is_not_the_default():
    request = JobRequest(name="j", workers=["local:5000", "local:5001"], slots=8, ps="ps0", replica_ps=None)
    assert request.workers == ("local:5000", "local:5001")
    with pytest.raises(AttributeError):
        request.slots = 9  # type: ignore[misc]
    args = request.to_args()
    assert args == {"name": "j", "workers": ["local:5000", "local:5001"], "slots": 8, "ps": "ps0"}
    assert JobRequest(**args) == request


def test_validated_resolves_endpoints_and_owner(config):
    job = JobRequest(name="j", workers=["local:5000", "127.0.0.1:5001"], slots=8, ps="ps0").validated(config, "alice")
    assert job.owner == "alice" and [w.udp_port for w in job.workers] == [5000, 5001]
    assert (job.ps.ip, job.ps.udp_port) == ("127.0.0.1", 29001)
    assert job.lease == 3600 and job.distribution is None
    with pytest.raises(ServiceError, match="admin must name the tenant") as err:
        JobRequest(name="j", workers=["local:5000"], slots=8).validated(config, None)
    assert err.value.code == "invalid_argument"
    with pytest.raises(ServiceError, match="cannot create jobs for 'bob'") as err:
        JobRequest(name="j", workers=["local:5000"], slots=8, tenant="bob").validated(config, "alice")
    assert err.value.code == "permission_denied"
    with pytest.raises(ServiceError, match="mode 'ring' is not allreduce, ps or fallback"):
        JobRequest(name="j", workers=["local:5000"], slots=8, mode="ring").validated(config, "alice")


def test_admit_full_partial_fallback_refused(config):
    allocator = SlotAllocator(16)
    plain = JobRequest(name="j", workers=["local:5000"], slots=8, width=64).validated(config, "alice")
    with_ps = JobRequest(name="j", workers=["local:5000"], slots=8, ps="ps0", width=64).validated(config, "alice")
    full = admit(plain, allocator, 4)
    assert (full.mode, full.job.admission, full.job.slots, full.job.reason) == (
        "allreduce", "full", SlotRange(0, 8), "8 slots as asked")
    allocator.reserve(SlotRange(8, 4))
    partial = admit(plain, allocator, 4)
    assert (partial.job.admission, partial.job.slots.count) == ("partial", 4)
    fallback = admit(with_ps, allocator, 4)
    assert (fallback.mode, fallback.job.admission, fallback.job.slots) == ("fallback", "fallback", None)
    with pytest.raises(ServiceError, match="no --ps to fall back to") as err:
        admit(plain, allocator, 4)
    assert err.value.code == "capacity_exhausted"
    partial.release(allocator)
    assert allocator.free_slots == 4
