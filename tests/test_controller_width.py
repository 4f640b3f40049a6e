"""Wide packets in the controller (docs/protocol.md, "Wide packets"; docs/controller.md): a job's width, switch
memory counted in cells, without a switch.

The job service runs here over a stand-in for its switches (``FakeFabric``: it records what would be installed)
and a real SQLite file: a wide job of 8 slots takes 32 cells; a full switch admits partially in whole slots, and
falls back to the PS when not even ``min_per_job`` slots fit; the width survives a controller restart and an old
database without the column opens; ``set_job`` carries the width code and the slot base in cells; trees of
switches count cells per switch with one width at every level.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from netagg import dataplane as dp
from netagg import wire
from netagg.controller.admission import JobRequest, admit
from netagg.controller.allocator import AllocationError, FabricAllocator, SlotAllocator, SlotRange, TreeAllocator
from netagg.controller.cli import _format_job, main
from netagg.controller.config import DEFAULT_WIDTHS, default_width, load_config, parse_config
from netagg.controller.errors import ServiceError
from netagg.controller.service import Caller, JobService
from netagg.controller.store import JobRecord, JobStore, PsEndpoint, WorkerEndpoint
from netagg.controller.switch_programmer import job_state
from netagg.controller.topology import Allocation, TreeWorker, parse_topology, plan_tree, tree_state, worker_config
from netagg.jobconfig import ConfigError

from conftest import ADMIN_TOKEN, TWO_RACKS, FakeFabric, controller_config, old_database

ALICE = Caller("alice")


def _config_path(tmp_path: Path, capacity: int = 64, min_slots: int = 4, **switch) -> Path:
    path = controller_config(tmp_path, "127.0.0.1:1", aggregator_port=28900, capacity=capacity, min_slots=min_slots)
    if switch:
        data = yaml.safe_load(path.read_text())
        data["switch"].update(switch)
        path.write_text(yaml.safe_dump(data))
    return path


def _service(tmp_path: Path, **kwargs) -> tuple[JobService, FakeFabric]:
    config = load_config(_config_path(tmp_path, **kwargs))
    fabric = FakeFabric()
    service = JobService(config, JobStore(config.database), fabric)  # type: ignore[arg-type]
    service.load()
    return service, fabric


def _create(service: JobService, slots: int, width: int | None = None, ports: int = 2, **options) -> dict:
    base = _create.port
    _create.port += ports
    return service.create_job(ALICE, JobRequest(name="j", workers=[f"local:{base + i}" for i in range(ports)],
                                                slots=slots, width=width, **options))


_create.port = 40000  # type: ignore[attr-defined]


# -- the default width and checking it --------------------------------------------------------------
def test_the_default_width_is_one_table_of_the_switch_targets(tmp_path):
    assert DEFAULT_WIDTHS == {"soft": 256, "soft-ref": 256, "soft-sharded": 256, "bmv2": 256, "tofino": 64}
    assert [default_width(t) for t in ("soft", "bmv2", "tofino")] == [256, 256, 64]
    with pytest.raises(ValueError, match="unknown switch target 'ipu'"):
        default_width("ipu")
    # switch.target: left out, the software target (bmv2 with a BMv2 JSON); named, that one's.
    assert load_config(_config_path(tmp_path)).target == "soft"
    assert load_config(_config_path(tmp_path)).default_width == 256
    assert load_config(_config_path(tmp_path, bmv2_json="build/netagg.json")).target == "bmv2"
    tofino = load_config(_config_path(tmp_path, target="tofino"))
    assert (tofino.target, tofino.default_width) == ("tofino", 64)
    with pytest.raises(ConfigError, match=r"switch\.target: 'ipu' is not one of soft, soft-ref, soft-sharded, bmv2, "
                                          "tofino"):
        load_config(_config_path(tmp_path, target="ipu"))
    job = JobRequest(name="j", workers=["local:5000"], slots=8).validated(tofino, "alice")
    assert (job.width, job.cells) == (64, 1)
    job = JobRequest(name="j", workers=["local:5000"], slots=8, width=256).validated(tofino, "alice")
    assert (job.width, job.cells) == (256, 4)


@pytest.mark.parametrize("width", [128, 0, 65, True, "256", 256.0, -64])
def test_the_api_refuses_a_width_that_is_not_64_or_256(tmp_path, width):
    config = load_config(_config_path(tmp_path))
    with pytest.raises(ServiceError, match=r"width must be one of 64, 256 \(values per packet\), got") as err:
        JobRequest(name="j", workers=["local:5000"], slots=8, width=width).validated(config, "alice")
    assert err.value.code == "invalid_argument"


def test_the_cli_refuses_width_128_before_asking_the_controller(tmp_path, capsys):
    config = _config_path(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["--config", str(config), "--token", ADMIN_TOKEN, "job", "create", "--workers", "local:5000",
              "--slots", "8", "--width", "128"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--width" in err and "values per packet must be one of 64, 256, got '128'" in err


def test_a_request_sends_its_width_only_when_named():
    request = JobRequest(name="j", workers=["local:5000"], slots=8)
    assert "width" not in request.to_args()  # an older controller still takes a plain create
    wide = JobRequest(name="j", workers=["local:5000"], slots=8, width=256)
    assert wide.to_args()["width"] == 256 and JobRequest(**wide.to_args()) == wide


# -- cells ---------------------------------------------------------------------------------------------
def test_allocators_grant_whole_slots_of_cells():
    alloc = SlotAllocator(22)
    assert alloc.allocate(32, 4, unit=4) == SlotRange(0, 20)  # 5 slots of 4 cells, not 22 cells
    assert alloc.free_cells == 2 and alloc.largest_free_units(4) == 0
    assert alloc.allocate(4, 4, unit=4) is None
    with pytest.raises(AllocationError, match="not whole slots of 4 cells"):
        alloc.allocate(6, 4, unit=4)
    fabric = FabricAllocator({"root": 64, "leaf": 64})
    fabric.reserve({"leaf": SlotRange(0, 41)})  # the leaf has 23 cells left, the root 64
    tree = TreeAllocator(fabric, ["root", "leaf"])
    assert tree.largest_free() == 23 and tree.largest_free_units(4) == 5
    got = tree.allocate(32, 4, unit=4)
    assert got is not None and got.as_dict() == {"root": SlotRange(0, 20), "leaf": SlotRange(41, 20)}
    assert tree.allocate(4, 4, unit=4) is None  # the leaf's 3 cells hold no wide slot
    assert tree.allocate(3, 1) is not None  # narrow slots still fit


def test_a_wide_job_of_8_slots_takes_32_cells_and_a_full_switch_admits_whole_slots(tmp_path):
    service, _ = _service(tmp_path, capacity=64, min_slots=4)
    wide = _create(service, 8)  # the software target's default: wide
    job = wide["job"]
    assert (wide["admission"], job["width"], job["slot_base"], job["slot_count"], job["cells"]) == (
        "full", 256, 0, 8, 32)
    assert job["slots"] == "0..31"
    assert service.allocator.free_ranges == (SlotRange(32, 32),)
    narrow = _create(service, 10, width=64)["job"]
    assert (narrow["width"], narrow["slot_base"], narrow["slot_count"], narrow["cells"]) == (64, 32, 10, 10)
    # 22 cells left: a wide job asking 8 slots gets 5 (20 cells), whole slots only.
    partial = _create(service, 8, width=256)
    job = partial["job"]
    assert (partial["admission"], job["slot_base"], job["slot_count"], job["cells"]) == ("partial", 42, 5, 20)
    assert partial["reason"] == "5 of 8 slots (largest free range); fewer packets in flight"
    assert service.allocator.free_ranges == (SlotRange(62, 2),)
    # 2 cells left: not one wide slot (min_per_job is in the job's slots), so the PS, keeping the width.
    fallback = _create(service, 1, width=256, ps="ps0")
    assert (fallback["admission"], fallback["job"]["mode"], fallback["job"]["width"]) == ("fallback", "fallback", 256)
    assert "no range of 1+ free slots of width 256 (4+ cells) (largest free: 2 cells, 0 slots of width 256)" \
        in fallback["reason"]
    config = service.worker_config(ALICE, fallback["job"]["job_id"], 0)
    assert (config.mode, config.width, config.aggregator.port) == ("fallback", 256, 29001)
    with pytest.raises(ServiceError, match="no --ps to fall back to") as err:
        _create(service, 4)
    assert err.value.code == "capacity_exhausted"
    # ... while a narrow job still fits the 2 cells.
    assert _create(service, 2, width=64)["admission"] == "full"
    # Deleting the partial wide job gives its 20 cells back.
    assert service.delete_job(ALICE, partial["job"]["job_id"])["released_slots"] == 5
    assert service.allocator.free_cells == 20
    # 6 wide slots (24 cells) asked of those 20 cells: 5 (min_per_job, 4, counts the job's slots).
    assert _create(service, 6, width=256)["job"]["slot_count"] == 5


def test_set_job_carries_the_width_code_and_the_slot_base_in_cells(tmp_path):
    service, fabric = _service(tmp_path, capacity=64)
    _create(service, 3, width=64)
    wide = _create(service, 4, width=256)["job"]
    record = fabric.installed[wide["job_id"]]
    [entry] = [e for e in job_state(service.config, record).entries.values() if e.table == dp.TABLE_JOBS]
    assert entry.action == dp.ACTION_SET_JOB
    assert dict(entry.params) == {"num_workers": 2, "slot_base": 3, "slot_count": 4, "mgid": wide["job_id"],
                                  "generation": wide["generation"], "width": wire.width_code(256)}
    narrow = fabric.installed[1]
    [entry] = [e for e in job_state(service.config, narrow).entries.values() if e.table == dp.TABLE_JOBS]
    assert dict(entry.params)["width"] == wire.width_code(64) == 0
    # Every worker's config says the width; the slot count is the job's slots.
    for rank in range(2):
        config = service.worker_config(ALICE, wide["job_id"], rank)
        assert (config.width, config.slot_count) == (256, 4)
        assert yaml.safe_load(config.to_yaml())["width"] == 256


def test_the_width_survives_a_controller_restart(tmp_path):
    service, _ = _service(tmp_path, capacity=64)
    first = _create(service, 8, width=256)["job"]
    second = _create(service, 5, width=64)["job"]
    free_before = service.allocator.free_ranges
    service.store.close()
    # A new controller on the same SQLite file (switch.target tofino now: stored jobs keep their width).
    config = load_config(_config_path(tmp_path, capacity=64, target="tofino"))
    assert config.database == tmp_path / "ctl.db" and config.database.is_file()
    again = JobService(config, JobStore(config.database), FakeFabric())  # type: ignore[arg-type]
    again.load()
    assert again.allocator.free_ranges == free_before == (SlotRange(37, 27),)
    listed = {j["job_id"]: j for j in again.list_jobs(Caller(None))}
    assert (listed[first["job_id"]]["width"], listed[first["job_id"]]["cells"]) == (256, 32)
    assert (listed[second["job_id"]]["width"], listed[second["job_id"]]["cells"]) == (64, 5)
    assert again.worker_config(ALICE, first["job_id"], 1).width == 256
    assert again.store.get(first["job_id"]).width == 256
    # A new job there takes the target's default; the deleted wide job's 32 cells come back.
    assert _create(again, 2)["job"]["width"] == 64
    again.delete_job(ALICE, first["job_id"])
    assert again.allocator.free_cells == 64 - 5 - 2


def test_an_old_database_without_the_width_column_opens_with_narrow_jobs(tmp_path):
    old_database(tmp_path / "ctl.db", "width")
    config = load_config(_config_path(tmp_path, capacity=64))
    store = JobStore(config.database)
    columns = {row["name"]: row for row in store._conn.execute("PRAGMA table_info(jobs)")}
    assert "width" in columns and columns["width"]["dflt_value"] == "64"
    old = store.get(4)
    assert (old.width, old.cells, old.cell_count) == (64, 1, 8)
    service = JobService(config, store, FakeFabric())  # type: ignore[arg-type]
    service.load()
    assert service.allocator.free_ranges == (SlotRange(0, 16), SlotRange(24, 40))
    assert service.worker_config(ALICE, 4, 0).width == 64
    store.close()
    JobStore(config.database).close()  # opening it again: nothing left to migrate


def test_a_distribution_job_has_its_jobs_width(tmp_path):
    service, _ = _service(tmp_path, capacity=64, min_slots=1)
    made = _create(service, 6, width=256, ports=3, ps="ps0", update_mode="async",
                   distribution=["local:41000", "local:41001", "local:41002"], distribution_ps=["local:41003"],
                   distribution_slots=4)
    job, dist = made["job"], made["distribution"]["job"]
    assert (job["width"], job["cells"], dist["width"], dist["slot_count"], dist["cells"]) == (256, 24, 256, 4, 16)
    assert dist["slot_base"] == job["slot_base"] + 24
    assert service.worker_config(ALICE, job["job_id"], 0, distribution=True).width == 256
    # The distribution job partially: whole wide slots of what is left (20 cells: 5 slots, asked 8).
    made = _create(service, 1, width=256, ports=1, ps="ps0", update_mode="async",
                   distribution=["local:41010"], distribution_ps=["local:41011"], distribution_slots=8)
    assert (made["distribution"]["admission"], made["distribution"]["job"]["slot_count"]) == ("partial", 5)


def test_the_cli_shows_the_width_and_the_cells(tmp_path):
    service, _ = _service(tmp_path, capacity=64)
    narrow = _create(service, 4, width=64)["job"]
    wide = _create(service, 8, width=256)["job"]
    assert "  slots 0..3 (4 of 4 wanted), width 64, generation" in _format_job(narrow)
    assert "  cells 4..35 (8 of 8 slots wanted, 4 cells each), width 256, generation" in _format_job(wide)
    fallback = _create(service, 64, width=256, ps="ps0", mode="fallback")["job"]
    assert "  slots - (0 of 64 wanted), width 256, generation" in _format_job(fallback)
    old = {k: v for k, v in narrow.items() if k not in ("width", "cells")}  # a controller from before widths
    assert "  slots 0..3 (4 of 4 wanted), width 64" in _format_job(old)


# -- trees of switches ----------------------------------------------------------------------------------
TOPOLOGY = TWO_RACKS


def test_a_wide_tree_job_has_one_width_at_every_level_and_cells_per_switch():
    topology = parse_topology(TOPOLOGY, "<test>")
    workers = [TreeWorker(0, "r0h0", 41000), TreeWorker(1, "r1h0", 41001), TreeWorker(2, "r0h1", 41002)]
    plan = plan_tree(topology, workers)
    allocations = {"root": Allocation(7, 64, 8, 1001, 256), "rack0": Allocation(3, 0, 8, 1002, 256),
                   "rack1": Allocation(9, 32, 8, 1003, 256)}
    states = tree_state(topology, plan, allocations, workers)
    for switch, alloc in allocations.items():
        [entry] = [e for e in states[switch].entries.values() if e.table == dp.TABLE_JOBS]
        params = dict(entry.params)
        assert (params["slot_base"], params["slot_count"], params["width"]) == (alloc.slot_base, 8, 1)
    config = worker_config(topology, plan, allocations, workers[2], len(workers))
    assert (config.width, config.slot_count, config.job_id) == (256, 8, 3)
    mixed = {**allocations, "rack1": Allocation(9, 32, 8, 1003, 64)}
    with pytest.raises(ValueError, match="same width on every switch"):
        tree_state(topology, plan, mixed, workers)


def test_tree_admission_and_a_restart_count_cells_on_each_switch(tmp_path):
    topo_path = tmp_path / "topology.yaml"
    topo_path.write_text(yaml.safe_dump(TOPOLOGY))
    data = {
        "topology": str(topo_path), "switch": {"election_id": 10, "p4info": str(dp.P4INFO_PATH)},
        "slots": {"capacity": 64, "min_per_job": 2},
        "controller": {"database": str(tmp_path / "tree.db"), "api_socket": str(tmp_path / "tree.sock"),
                       "admin_token": ADMIN_TOKEN},
        "tenants": {"alice": {"token": "alice-test-token"}},
        "parameter_servers": [{"name": "ps0", "host": "r0h1", "udp_port": 29001}],
    }
    config = parse_config(data, "<tree>")
    assert config.default_width == 256
    fabric = FabricAllocator({"root": 64, "rack0": 64, "rack1": 64})
    fabric.reserve({"rack1": SlotRange(0, 30)})  # rack1 has 34 cells: 8 wide slots
    job = JobRequest(name="t", workers=["r0h0:41000", "r1h0:41001"], slots=12).validated(config, "alice")
    switches = plan_tree(config.topology, [TreeWorker(w.rank, w.host, w.udp_port) for w in job.workers]).switches
    admitted = admit(job, TreeAllocator(fabric, switches), config.min_slots)
    grant = admitted.job
    assert (grant.admission, grant.slot_count, grant.cells) == ("partial", 8, 4)
    assert grant.slots.as_dict() == {"root": SlotRange(0, 32), "rack0": SlotRange(0, 32), "rack1": SlotRange(30, 32)}

    # The stored job (segments: first cell and slots per switch) reserves its cells on each switch at start.
    store = JobStore(config.database)
    with store.transaction() as conn:
        store.insert(conn, JobRecord(
            job_id=5, tenant="alice", name="t", mode="allreduce", state="active", slot_base=0, slot_count=8,
            slots_wanted=12, generation=store.next_generation(conn),
            workers=[WorkerEndpoint(0, "r0h0", "10.61.0.1", 41000), WorkerEndpoint(1, "r1h0", "10.62.0.1", 41001)],
            ps=PsEndpoint("r0h1", "10.61.0.2", 29001), lease_seconds=60, lease_expires=time.time() + 60,
            created=time.time(), width=256, segments={"root": (0, 8), "rack0": (0, 8), "rack1": (30, 8)}))
    store.close()
    service = JobService(config, JobStore(config.database))
    try:
        service.load()
        free = {s: a.free_ranges for s, a in service.allocator.allocators.items()}
        assert free == {"root": (SlotRange(32, 32),), "rack0": (SlotRange(32, 32),),
                        "rack1": (SlotRange(0, 30), SlotRange(62, 2))}
        shares = service.fabric.job_share(service.store.get(5))
        assert {s: dict(next(e for e in state.entries.values() if e.table == dp.TABLE_JOBS).params)["width"]
                for s, state in shares.items()} == {"root": 1, "rack0": 1, "rack1": 1}
        config0 = service.worker_config(Caller("alice"), 5, 1)
        assert (config0.width, config0.slot_count, config0.aggregator.host) == (256, 8, "10.62.0.254")
        assert "  switches root 0..31, rack0 0..31, rack1 30..61" in _format_job(service.list_jobs(Caller(None))[0])
    finally:
        service.fabric.close()
        service.store.close()
