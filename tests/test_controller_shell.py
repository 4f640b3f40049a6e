"""`netagg switch shell`: p4runtime-shell as a read-only backup client (no interactive shell is started here)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from p4.v1 import p4runtime_pb2 as p4rt
from p4runtime_sh.utils import UserError

from netagg import dataplane as dp
from netagg.controller import switch_shell
from netagg.controller.cli import EXIT_CODES, main
from netagg.controller.config import load_config
from netagg.controller.p4runtime_client import P4RuntimeClient
from netagg.p4info import P4InfoIndex
from netagg.softswitch.forwarding_state import ForwardingState
from netagg.softswitch.p4runtime_server import serve

from conftest import controller_config


def _config(tmp_path: Path, grpc_address: str = "127.0.0.1:1") -> Path:
    return controller_config(tmp_path, grpc_address, aggregator_port=1)  # election_id 10


def test_the_command_builds_settings_below_the_controller(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(switch_shell, "run_shell", seen.append)
    path = _config(tmp_path)
    assert main(["--config", str(path), "switch", "shell"]) == 0
    [settings] = seen
    assert settings.controller_election_id == (0, 10)
    assert settings.election_id == (0, 9) < settings.controller_election_id
    assert settings.p4info == dp.P4INFO_PATH and settings.device_id == 1
    assert settings.argv == ["--grpc-addr", "127.0.0.1:1", "--device-id", "1", "--election-id", "0,9"]
    assert "--config" not in settings.argv  # p4runtime-shell would push its pipeline
    assert main(["--config", str(path), "switch", "shell", "--election-id", "3"]) == 0
    assert seen[-1].election_id == (0, 3)


@pytest.mark.parametrize("election_id", [10, 11, -1])
def test_an_election_id_that_could_take_over_is_refused(tmp_path, monkeypatch, capsys, election_id):
    monkeypatch.setattr(switch_shell, "run_shell", lambda settings: pytest.fail("shell started"))
    code = main(["--config", str(_config(tmp_path)), "switch", "shell", "--election-id", str(election_id)])
    assert code == EXIT_CODES["invalid_argument"]
    assert "below the controller's (10)" in capsys.readouterr().err


def test_the_shell_client_is_a_read_only_backup(tmp_path):
    index = P4InfoIndex.from_file(dp.P4INFO_PATH)
    server, port = serve(ForwardingState(index), "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    settings = switch_shell.shell_settings(load_config(_config(tmp_path, address)))
    try:
        with P4RuntimeClient(address, election_id=settings.controller_election_id,
                             p4info_path=dp.P4INFO_PATH, timeout=3.0) as controller:
            controller.set_pipeline()
            controller.insert_entry(dp.TABLE_JOBS, {"job_id": 7}, dp.ACTION_SET_JOB,
                                    {"num_workers": 2, "slot_base": 0, "slot_count": 4, "mgid": 7, "generation": 1,
                                     "width": 0})
            shell = switch_shell.read_only_client(settings)
            try:
                assert controller.is_primary  # the shell did not take over
                read = p4rt.Entity(table_entry=p4rt.TableEntry(table_id=index.table(dp.TABLE_JOBS).id))
                [found] = list(shell.read_one(read))
                assert len(found.entities) == 1  # it reads the controller's entries
                with pytest.raises(UserError, match="read-only"):
                    shell.write_update(p4rt.Update())
                # Even bypassing its own refusal, the switch takes no write from its election id.
                request = p4rt.WriteRequest(device_id=1, election_id=p4rt.Uint128(
                    high=settings.election_id[0], low=settings.election_id[1]))
                with pytest.raises(grpc.RpcError) as err:
                    shell.stub.Write(request, timeout=3.0)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            finally:
                shell.tear_down()
            assert controller.is_primary
    finally:
        server.stop(0)
