"""The controller sizes a job's slots to its links when the create names none (controller/sizing.py,
docs/controller.md "How many slots").

``choose_slots`` alone (rates, widths, the minimum, the caps, no rate), then through a job create: the job's
hosts' slowest link (its PS's in ps/fallback modes), explicit slots kept and checked as before, the choice
stored with the job and shown by ``job show`` (over the API and the CLI), a distribution job defaulting to
its job's chosen slots, a tree of switches, and ``link_mbit``/``target_rtt_ms`` in the configs.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from netagg import dataplane as dp
from netagg.controller.admission import JobRequest, admit
from netagg.controller.allocator import FabricAllocator, TreeAllocator
from netagg.controller.api import ApiServer
from netagg.controller.cli import main
from netagg.controller.config import load_config, parse_config
from netagg.controller.errors import ServiceError
from netagg.controller.service import Caller, JobService
from netagg.controller.sizing import (
    DEFAULT_SLOTS,
    MAX_CHOSEN_SLOTS,
    MIN_CHOSEN_SLOTS,
    SlotChoice,
    choose_slots,
)
from netagg.controller.store import JobStore
from netagg.controller.topology import TreeWorker, dump_topology, parse_topology, plan_tree
from netagg.jobconfig import ConfigError

from conftest import ADMIN_TOKEN, TOKENS, TWO_RACKS, FakeFabric, controller_config, old_database

ALICE = Caller("alice")


# -- the arithmetic -----------------------------------------------------------------------------------
def test_the_docs_example_400_mbit_5_ms_wide_is_245_slots():
    # 400 Mbit/s for 5 ms: 250 000 bytes in flight; a wide packet carries 1024 bytes: 244.1 -> 245 slots.
    assert choose_slots([400.0], 256, 5.0) == SlotChoice(245, "link 400 Mbit/s x 5 ms")
    # Narrow packets carry a quarter of that: four times the slots (976.6 -> 977), each one cell.
    assert choose_slots([400.0], 64, 5.0).slots == 977


def test_the_slowest_known_link_decides_and_unknown_rates_are_skipped():
    assert choose_slots([1000.0, None, 400.0, 800], 256, 5.0) == SlotChoice(245, "link 400 Mbit/s x 5 ms")
    # The window scales with the rate and the round trip.
    assert choose_slots([800.0], 256, 5.0).slots == 489      # 500 000 / 1024 = 488.3
    assert choose_slots([400.0], 256, 10.0).slots == 489
    assert choose_slots([400.0], 256, 2.5).slots == 123      # 122.07
    assert choose_slots([100.5], 256, 5.0).chosen_by == "link 100.5 Mbit/s x 5 ms"


def test_at_least_16_and_min_per_job():
    # 40 Mbit/s x 5 ms wide needs 25 000 bytes: 25 slots (above the floor, as computed).
    assert choose_slots([40.0], 256, 5.0) == SlotChoice(25, "link 40 Mbit/s x 5 ms")
    # 10 Mbit/s needs 7: raised to 16.
    low = choose_slots([10.0], 256, 5.0)
    assert low.slots == MIN_CHOSEN_SLOTS == 16
    assert low.chosen_by == "link 10 Mbit/s x 5 ms (needs 7; at least 16)"
    # slots.min_per_job above 16 raises it further; below, 16 stays.
    assert choose_slots([10.0], 256, 5.0, min_slots=24).slots == 24
    assert choose_slots([10.0], 256, 5.0, min_slots=4).slots == 16
    assert choose_slots([40.0], 256, 5.0, min_slots=30).slots == 30


def test_at_most_the_cap_and_what_the_switch_holds():
    fast = choose_slots([10_000.0], 64, 5.0)  # 10 Gbit/s narrow: 24 415 slots wanted
    assert fast.slots == MAX_CHOSEN_SLOTS == 1024
    assert fast.chosen_by == "link 10000 Mbit/s x 5 ms (needs 24415; at most 1024)"
    # A switch of 512 cells holds 128 wide slots: no more is chosen (no partial grant of a chosen count).
    assert choose_slots([400.0], 256, 5.0, capacity_cells=512).slots == 128
    assert choose_slots([400.0], 64, 5.0, capacity_cells=512).slots == 512
    # The cap wins over the floor: a tiny switch.
    assert choose_slots([10.0], 256, 5.0, capacity_cells=8).slots == 2
    # A 16-bit slot field indexes 65536 slots: the cap is well inside it.
    assert MAX_CHOSEN_SLOTS <= 1 << 16


def test_no_rate_known_gives_the_default():
    assert choose_slots([], 256, 5.0).slots == DEFAULT_SLOTS == 64
    none = choose_slots([None, None], 64, 5.0, min_slots=100)
    assert none.slots == 64 and none.chosen_by.startswith("default")
    assert choose_slots([None], 256, 5.0, capacity_cells=128).slots == 32  # 128 cells: 32 wide slots


def test_bad_arguments():
    with pytest.raises(ValueError, match="width"):
        choose_slots([400.0], 128, 5.0)
    with pytest.raises(ValueError, match="target_rtt_ms"):
        choose_slots([400.0], 256, 0.0)


# -- through a job create ------------------------------------------------------------------------------
HOSTS = [
    {"name": "local", "ip": "127.0.0.1", "mac": "02:00:00:00:bb:01", "port": 1, "link_mbit": 400},
    {"name": "slow", "ip": "10.0.0.2", "mac": "02:00:00:00:bb:02", "port": 2, "link_mbit": 40.0},
    {"name": "norate", "ip": "10.0.0.3", "mac": "02:00:00:00:bb:03", "port": 3},
    {"name": "pshost", "ip": "10.0.0.4", "mac": "02:00:00:00:bb:04", "port": 4, "link_mbit": 100},
]


def _config_data(tmp_path: Path, capacity: int = 4096, min_slots: int = 4, **slots) -> dict:
    data = yaml.safe_load(controller_config(tmp_path, "127.0.0.1:1", aggregator_port=28900, capacity=capacity,
                                            min_slots=min_slots).read_text())
    data["hosts"] = copy.deepcopy(HOSTS)
    data["parameter_servers"] = [{"name": "ps0", "host": "local", "udp_port": 29001},
                                 {"name": "ps1", "host": "pshost", "udp_port": 29001}]
    # The examples below are worked at 5 ms; target_rtt_ms=None leaves it out (the default, 7.5 ms).
    data["slots"].update({"target_rtt_ms": 5, **slots})
    if data["slots"]["target_rtt_ms"] is None:
        del data["slots"]["target_rtt_ms"]
    return data


def _config(tmp_path: Path, **kwargs):
    path = tmp_path / "controller.yaml"
    path.write_text(yaml.safe_dump(_config_data(tmp_path, **kwargs)))
    return load_config(path)


def test_the_config_reads_link_rates_and_the_target_round_trip(tmp_path):
    config = _config(tmp_path)
    assert [config.hosts[h["name"]].link_mbit for h in HOSTS] == [400.0, 40.0, None, 100.0]
    assert config.target_rtt_ms == 5.0
    assert _config(tmp_path, target_rtt_ms=2).target_rtt_ms == 2.0
    default = _config(tmp_path, target_rtt_ms=None)
    assert default.target_rtt_ms == 7.5  # the default: room beside a TCP flow's queue (docs/controller.md)
    assert _valid(default, workers=["local:5000"]).slots_chosen_by == "link 400 Mbit/s x 7.5 ms"


@pytest.mark.parametrize(("where", "value", "key", "problem"), [
    ("host", 0, "hosts[0].link_mbit", "> 0"),
    ("host", -40, "hosts[0].link_mbit", "> 0"),
    ("host", "fast", "hosts[0].link_mbit", "expected a number"),
    ("host", True, "hosts[0].link_mbit", "expected a number"),
    ("host", float("inf"), "hosts[0].link_mbit", "> 0"),
    ("slots", 0, "slots.target_rtt_ms", "> 0"),
    ("slots", -1.5, "slots.target_rtt_ms", "> 0"),
    ("slots", "5ms", "slots.target_rtt_ms", "expected float"),
    ("slots", float("nan"), "slots.target_rtt_ms", "> 0"),
])
def test_bad_link_rates_and_round_trips_are_clear_errors(tmp_path, where, value, key, problem):
    data = _config_data(tmp_path)
    if where == "host":
        data["hosts"][0]["link_mbit"] = value
    else:
        data["slots"]["target_rtt_ms"] = value
    with pytest.raises(ConfigError) as err:
        parse_config(data, "configs/test.yaml")
    assert str(err.value).startswith(f"configs/test.yaml: {key}: "), str(err.value)
    assert problem in str(err.value)


def _valid(config, **request):
    return JobRequest(name="j", **request).validated(config, "alice")


def test_a_create_without_slots_sizes_them_to_its_hosts_links(tmp_path):
    config = _config(tmp_path)
    job = _valid(config, workers=["local:5000", "local:5001"])  # width 256 (the software target's)
    assert (job.slots, job.slots_chosen_by, job.width) == (245, "link 400 Mbit/s x 5 ms", 256)
    narrow = _valid(config, workers=["local:5000"], width=64)
    assert (narrow.slots, narrow.cells) == (977, 1)
    # The slowest worker's link decides; a host without a rate does not count.
    assert _valid(config, workers=["local:5000", "slow:5001", "norate:5002"]).slots == 25
    assert _valid(config, workers=["norate:5000"]).slots_chosen_by.startswith("default")
    assert _valid(config, workers=["norate:5000"]).slots == 64
    # slots.target_rtt_ms scales it.
    assert _valid(_config(tmp_path, target_rtt_ms=10), workers=["local:5000"]).slots == 489


def test_the_ps_host_counts_in_ps_and_fallback_modes(tmp_path):
    config = _config(tmp_path)
    # 100 Mbit/s at the PS: 62 500 bytes, 62 slots (61.04 -> 62).
    for mode in ("ps", "fallback"):
        job = _valid(config, workers=["local:5000", "local:5001"], mode=mode, ps="ps1")
        assert (job.slots, job.slots_chosen_by) == (62, "link 100 Mbit/s x 5 ms"), mode
    # In allreduce mode the PS is only there to fall back to: the workers' links decide.
    assert _valid(config, workers=["local:5000"], ps="ps1").slots == 245
    # A PS without a rate: the workers' rate alone.
    assert _valid(_config(tmp_path), workers=["slow:5000"], mode="ps", ps="norate:29000").slots == 25


def test_explicit_slots_are_kept_and_checked_as_before(tmp_path):
    config = _config(tmp_path)
    job = _valid(config, workers=["slow:5000"], slots=8)
    assert (job.slots, job.slots_chosen_by) == (8, "asked")
    for bad in (0, -3, True, "8", 2.5):
        with pytest.raises(ServiceError, match="slots must be >= 1") as err:
            _valid(config, workers=["local:5000"], slots=bad)
        assert err.value.code == "invalid_argument"
    # Left out, the request sends no slots at all (an older controller then complains, not guesses).
    assert "slots" not in JobRequest(name="j", workers=["local:5000"]).to_args()
    assert JobRequest(name="j", workers=["local:5000"], slots=8).to_args()["slots"] == 8


def _service(config, fabric: FakeFabric | None = None) -> JobService:
    service = JobService(config, JobStore(config.database), fabric or FakeFabric())  # type: ignore[arg-type]
    service.load()
    return service


def test_the_job_keeps_its_chosen_slots_and_says_why(tmp_path):
    config = _config(tmp_path)
    service = _service(config)
    made = service.create_job(ALICE, JobRequest(name="j", workers=["local:40000", "local:40001"]))
    job = made["job"]
    assert (made["admission"], job["slot_count"], job["slots_wanted"], job["cells"]) == ("full", 245, 245, 980)
    assert job["slots_chosen_by"] == "link 400 Mbit/s x 5 ms"
    assert made["reason"] == "245 slots as chosen by the controller"
    assert service.worker_config(ALICE, job["job_id"], 0).slot_count == 245
    # An asked count says so; both survive a restart of the controller (the database holds them).
    asked = service.create_job(ALICE, JobRequest(name="k", workers=["local:40002"], slots=8))
    assert (asked["job"]["slots_chosen_by"], asked["reason"]) == ("asked", "8 slots as asked")
    service.store.close()
    again = _service(config)
    shown = {j["job_id"]: j for j in again.list_jobs(ALICE)}
    assert shown[job["job_id"]]["slots_chosen_by"] == "link 400 Mbit/s x 5 ms"
    assert shown[asked["job"]["job_id"]]["slots_chosen_by"] == "asked"
    assert again.allocator.free_cells == 4096 - 980 - 32
    again.store.close()


def test_an_old_database_without_the_column_says_its_jobs_asked(tmp_path):
    config = _config(tmp_path)
    old_database(config.database, "slots_chosen_by")
    store = JobStore(config.database)
    assert store.get(4).slots_chosen_by == "asked"
    store.close()


def test_a_chosen_count_is_admitted_partially_like_any_other(tmp_path):
    config = _config(tmp_path, capacity=4096)
    service = _service(config)
    service.create_job(ALICE, JobRequest(name="big", workers=["local:40000"], slots=800))  # 3200 cells
    made = service.create_job(ALICE, JobRequest(name="j", workers=["local:40001"]))  # wants 245 slots
    assert (made["admission"], made["job"]["slot_count"], made["job"]["slots_wanted"]) == ("partial", 224, 245)
    assert made["reason"] == ("224 of 245 slots (largest free range; chosen by the controller); fewer packets "
                              "in flight")
    service.store.close()


def test_a_distribution_job_defaults_to_its_jobs_chosen_slots(tmp_path):
    config = _config(tmp_path, capacity=4096)
    service = _service(config)
    made = service.create_job(ALICE, JobRequest(
        name="d", workers=["slow:40000", "slow:40001"], ps="ps0", update_mode="async",
        distribution=["slow:41000", "slow:41001"], distribution_ps=["local:41002"]))
    job, dist = made["job"], made["distribution"]["job"]
    assert (job["slot_count"], dist["slot_count"], dist["slots_wanted"]) == (25, 25, 25)
    assert dist["slots_chosen_by"] == "its job's: link 40 Mbit/s x 5 ms"
    named = service.create_job(ALICE, JobRequest(
        name="e", workers=["slow:40010"], ps="ps0", update_mode="async", distribution=["slow:41010"],
        distribution_ps=["local:41012"], distribution_slots=5))
    assert (named["distribution"]["job"]["slot_count"], named["distribution"]["job"]["slots_chosen_by"]) == \
        (5, "asked")
    service.store.close()


# -- over a tree of switches -----------------------------------------------------------------------------
#: rack 0's hosts on 400 Mbit/s links, rack 1's on 200 Mbit/s; r1h1 has no rate.
TOPOLOGY = {**TWO_RACKS, "hosts": [
    {**host, **({} if host["name"] == "r1h1" else {"link_mbit": 400 if host["switch"] == "rack0" else 200})}
    for host in TWO_RACKS["hosts"]]}


def _tree_config(tmp_path: Path, topology: dict = TOPOLOGY):
    topo_path = tmp_path / "topology.yaml"
    topo_path.write_text(yaml.safe_dump(topology))
    return parse_config({
        "topology": str(topo_path), "switch": {"election_id": 10, "p4info": str(dp.P4INFO_PATH)},
        "slots": {"capacity": 4096, "min_per_job": 4, "target_rtt_ms": 5},
        "controller": {"database": str(tmp_path / "tree.db"), "api_socket": str(tmp_path / "tree.sock"),
                       "admin_token": ADMIN_TOKEN},
        "tenants": {"alice": {"token": "alice-test-token"}},
        "parameter_servers": [{"name": "ps0", "host": "r0h1", "udp_port": 29001}],
    }, "<tree>")


def test_a_topologys_hosts_carry_link_rates(tmp_path):
    topology = parse_topology(TOPOLOGY, "<test>")
    assert {h.name: h.link_mbit for h in topology.hosts.values()} == \
        {"r0h0": 400.0, "r0h1": 400.0, "r1h0": 200.0, "r1h1": None}
    assert parse_topology(dump_topology(topology), "<again>").hosts == topology.hosts  # written back as read
    bad = copy.deepcopy(TOPOLOGY)
    bad["hosts"][2]["link_mbit"] = -1
    with pytest.raises(ConfigError, match=r"^<test>: hosts\[2\]\.link_mbit: must be a number of Mbit/s > 0"):
        parse_topology(bad, "<test>")
    bad["hosts"][2]["link_mbit"] = "x"
    with pytest.raises(ConfigError, match=r"hosts\[2\]\.link_mbit: expected a number"):
        parse_topology(bad, "<test>")
    config = _tree_config(tmp_path)
    assert config.hosts["r1h0"].link_mbit == 200.0 and config.hosts["r1h1"].link_mbit is None


def test_a_tree_job_is_sized_over_all_its_hosts_and_gets_those_slots_on_every_switch(tmp_path):
    config = _tree_config(tmp_path)
    # One rack: its hosts' 400 Mbit/s; over both racks the slowest, 200 Mbit/s (122.07 -> 123 wide slots).
    assert _valid(config, workers=["r0h0:41000", "r0h1:41001"]).slots == 245
    job = _valid(config, workers=["r0h0:41000", "r1h0:41001", "r1h1:41002"])
    assert (job.slots, job.slots_chosen_by) == (123, "link 200 Mbit/s x 5 ms")
    switches = plan_tree(config.topology, [TreeWorker(w.rank, w.host, w.udp_port) for w in job.workers]).switches
    allocator = FabricAllocator({"root": 4096, "rack0": 4096, "rack1": 4096})
    grant = admit(job, TreeAllocator(allocator, switches), config.min_slots).job
    assert (grant.admission, grant.slot_count, grant.cells) == ("full", 123, 4)
    # Through the service: the same count on each switch of its tree, and why.
    service = _service(config, FakeFabric(("root", "rack0", "rack1"), tree=True))
    made = service.create_job(ALICE, JobRequest(name="t", workers=["r0h0:41000", "r1h0:41001"]))
    assert made["job"]["segments"] == {"root": (0, 123), "rack0": (0, 123), "rack1": (0, 123)}
    assert made["job"]["slots_chosen_by"] == "link 200 Mbit/s x 5 ms"
    service.store.close()


# -- the API and the CLI ---------------------------------------------------------------------------------
@pytest.fixture
def api(tmp_path):
    """A job service over a stand-in switch, served on its API socket in this process; the config's hosts have
    link rates."""
    config = _config(tmp_path)
    service = _service(config)
    server = ApiServer(config.api_socket, service, config.tenants, config.admin_token)
    server.start()
    yield config
    server.stop()
    service.store.close()


def _cli(capsys, config, *args: str) -> tuple[int, str, str]:
    code = main(["--config", config.source, "--token", TOKENS["alice"], *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_job_create_without_slots_gets_the_computed_count_and_job_show_says_why(capsys, api):
    code, out, err = _cli(capsys, api, "--json", "job", "create", "--name", "auto", "--workers",
                          "local:40000,local:40001")
    assert code == 0, err
    created = json.loads(out)
    job_id = created["job"]["job_id"]
    assert (created["job"]["slot_count"], created["job"]["cells"]) == (245, 980)
    assert created["job"]["slots_chosen_by"] == "link 400 Mbit/s x 5 ms"
    code, out, err = _cli(capsys, api, "--json", "job", "show", str(job_id))
    assert code == 0, err
    assert json.loads(out)["slots_chosen_by"] == "link 400 Mbit/s x 5 ms"
    code, out, err = _cli(capsys, api, "job", "show", str(job_id))
    assert code == 0, err
    assert "  cells 0..979 (245 of 245 slots wanted, 4 cells each), width 256" in out
    assert "  slots chosen by the controller: link 400 Mbit/s x 5 ms" in out
    # Asked: as before, and nothing said about a choice.
    code, out, err = _cli(capsys, api, "job", "create", "--workers", "slow:40002", "--slots", "8")
    assert code == 0, err
    assert "admission full (8 slots as asked)" in out and "chosen by the controller" not in out
    # A slow host's job: the floor, and why.
    code, out, err = _cli(capsys, api, "--json", "job", "create", "--workers", "slow:40003", "--width", "64")
    assert code == 0, err
    assert json.loads(out)["job"]["slot_count"] == 98  # 40 Mbit/s x 5 ms = 25 000 bytes: 97.7 narrow slots
    code, out, err = _cli(capsys, api, "job", "create", "--workers", "local:40004", "--slots", "0")
    assert code == 2 and "slots must be >= 1" in err
