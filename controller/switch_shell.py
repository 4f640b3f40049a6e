"""``netagg switch shell``: p4runtime-shell on the configured switch, as a read-only backup client.

Operators inspect tables, multicast groups and counters with p4runtime-shell's interactive shell
(``table_entry[...].read()``, ``counter_entry[...].read()``...), named through the program's P4Info
(the controller's ``switch.p4info``). The shell arbitrates with an election id below the controller's,
so the controller stays primary (and takes over again should it connect after the shell); the shell
never pushes a pipeline and refuses writes itself, primary or not.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from netagg.controller.config import ControllerConfig
from netagg.controller.errors import ServiceError
from netagg.p4info import load_p4info


@dataclass(frozen=True)
class ShellSettings:
    """Where the shell connects and as whom: the switch, its device id, an election id below the controller's."""

    grpc_address: str
    device_id: int
    election_id: tuple[int, int]
    controller_election_id: tuple[int, int]
    p4info: Path

    @property
    def argv(self) -> list[str]:
        """p4runtime-shell's command line (no ``--config``: that would push a pipeline)."""
        return ["--grpc-addr", self.grpc_address, "--device-id", str(self.device_id),
                "--election-id", ",".join(str(n) for n in self.election_id)]


def shell_settings(config: ControllerConfig, election_id: int | None = None) -> ShellSettings:
    """The shell's settings from the controller's config; ``election_id`` default: the controller's minus 1."""
    controller = config.election_id
    chosen = controller - 1 if election_id is None else election_id
    if not 0 <= chosen < controller:
        raise ServiceError("invalid_argument", f"--election-id must be in 0..{controller - 1}: below the "
                           f"controller's ({controller}), so that the shell never becomes primary over it")
    return ShellSettings(config.grpc_address, config.device_id, (0, chosen), (0, controller), config.p4info)


def read_only_client(settings: ShellSettings) -> Any:
    """A connected p4runtime-shell client (it arbitrates on creation) that refuses every write."""
    from p4runtime_sh.p4runtime import P4RuntimeClient
    from p4runtime_sh.utils import UserError

    class ReadOnlyClient(P4RuntimeClient):  # type: ignore[misc]
        def _refuse(self, *args: object) -> None:
            raise UserError("netagg switch shell is read-only: the controller programs the switch")

        write = write_update = set_fwd_pipe_config = _refuse

    return ReadOnlyClient(settings.device_id, settings.grpc_address, settings.election_id)


def run_shell(settings: ShellSettings) -> None:
    """p4runtime-shell's interactive shell (IPython) with ``settings``, until the operator leaves it."""
    import p4runtime_sh.shell as sh

    p4info = load_p4info(settings.p4info)

    def setup(*args: object, verbose: bool = True, **kwargs: object) -> None:  # replaces p4runtime-shell's
        sh.client = read_only_client(settings)
        sh.context.set_p4info(p4info)
        sh.global_options["verbose"] = verbose

    saved = sh.setup, sys.argv
    sh.setup, sys.argv = setup, ["p4runtime-shell", *settings.argv]
    try:
        sh.main()
    finally:
        sh.setup, sys.argv = saved
