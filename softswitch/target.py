"""The software target assembled: P4Runtime server + pipeline + ports + fault injection.

Two engines run the same program: ``fast`` (the compiled batch pipeline and the batched
packet loop, :mod:`~netagg.softswitch.fastpath`) and ``reference`` (the readable
per-packet model, :mod:`~netagg.softswitch.pipeline`). ``auto`` takes the fast one when
it can run here and otherwise says why and uses the reference. With fault injection the
per-packet loop runs (its faults are per packet), driving whichever engine was chosen.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from netagg import dataplane as dp
from netagg.faults import Faults
from netagg.p4info import P4InfoIndex
from netagg.softswitch import fastpath
from netagg.softswitch.forwarding_state import ForwardingState
from netagg.softswitch.p4runtime_server import P4RuntimeDevice, ServerHandle, serve
from netagg.softswitch.pipeline import NetaggPipeline
from netagg.softswitch.ports import LoopbackUdpPort, Port, RawSocketPort
from netagg.softswitch.shards import ShardedSwitch, ShardingUnavailable, shard_counts
from netagg.softswitch.switch import SoftSwitch

if TYPE_CHECKING:
    from netagg.softswitch.batch_switch import BatchSwitch

log = logging.getLogger(__name__)

#: Switch port number of the loopback UDP port (the controller's hosts use it).
LOOPBACK_PORT_NUMBER = 1


ENGINES = ("auto", "fast", "reference")


class SoftwareTarget:
    """A running software switch: ``start()``, then reach it over P4Runtime at ``grpc_address``."""

    def __init__(self, grpc_address: str = "127.0.0.1:9559", interfaces: Mapping[int, str] | None = None,
                 loopback: tuple[str, int] | None = None, faults: Faults | None = None, device_id: int = 1,
                 p4info_path: Path = dp.P4INFO_PATH, engine: str = "auto", shards: int | None = None,
                 udp_segmentation: bool = False) -> None:
        """``shards``: pipeline shards on as many cores (:mod:`~netagg.softswitch.shards`; None: what the
        machine can spare); 1 where the per-packet loop runs (the reference engine, fault injection).
        ``udp_segmentation``: raw ports send runs of one UDP flow as segmentation-offload sends
        (:mod:`~netagg.softswitch.raw_segmentation`; the batched loops only)."""
        if engine not in ENGINES:
            raise ValueError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}")
        index = P4InfoIndex.from_file(p4info_path)
        self.state = ForwardingState(index)
        reason = fastpath.unavailable() if engine != "reference" else "asked for the reference model"
        if reason and engine == "fast":
            raise ValueError(f"the fast engine cannot run here: {reason}")
        #: Which engine runs the program, and why not the fast one (None when it runs).
        self.engine = "reference" if reason else "fast"
        self.fast_unavailable = reason
        if reason and engine == "auto":
            log.warning("software target: fast path unavailable (%s); using the reference model", reason)
        self.pipeline: NetaggPipeline | fastpath.FastPipeline = (
            NetaggPipeline(self.state, index.p4info) if reason else fastpath.FastPipeline(self.state, index.p4info))
        self.state.add_reset_hook(self.pipeline.reset_registers)
        self.device = P4RuntimeDevice(self.state, device_id=device_id)
        self._grpc_request = grpc_address
        if loopback is not None and LOOPBACK_PORT_NUMBER in (interfaces or {}):
            raise ValueError(f"port {LOOPBACK_PORT_NUMBER} is the loopback port; number interfaces from 2")
        if loopback is None and not interfaces:
            raise ValueError("the software target needs at least one port (-i N@IFNAME or --loopback)")
        rx, tx = (faults or Faults()).injectors()
        per_packet = ("the reference engine runs per packet" if reason
                      else "fault injection runs per packet" if rx.active or tx.active else None)
        #: Pipeline shards (cores) serving the ports.
        self.shards = shard_counts(shards, per_packet)
        self.switch: SoftSwitch | BatchSwitch | ShardedSwitch
        self.loopback: LoopbackUdpPort | None = None
        if self.shards > 1:
            from netagg.softswitch.batch_switch import warm_up

            warm_up()
            assert isinstance(self.pipeline, fastpath.FastPipeline)
            try:
                self.switch = ShardedSwitch(self.pipeline, self.shards, interfaces or {},
                                            (LOOPBACK_PORT_NUMBER, *loopback) if loopback is not None else None,
                                            udp_segmentation=udp_segmentation)
            except ShardingUnavailable as err:
                # The pipeline keeps shard 0's lock and counters: the control plane still takes every lock.
                log.warning("software target: 1 shard, not %d (%s)", self.shards, err)
                self.shards = 1
            else:
                port = self.switch.ports.get(LOOPBACK_PORT_NUMBER)
                self.loopback = port if isinstance(port, LoopbackUdpPort) else None
                self.server = None
                return
        ports: list[Port] = [RawSocketPort(n, ifname) for n, ifname in sorted((interfaces or {}).items())]
        if loopback is not None:
            self.loopback = LoopbackUdpPort(LOOPBACK_PORT_NUMBER, *loopback)
            ports.append(self.loopback)
        if isinstance(self.pipeline, fastpath.FastPipeline) and not (rx.active or tx.active):
            from netagg.softswitch.batch_switch import BatchSwitch, enable_batching, warm_up  # needs numba

            if (why := enable_batching(ports)) is None:
                warm_up()
                self.switch = BatchSwitch(self.pipeline, ports, udp_segmentation=udp_segmentation)
            else:
                log.warning("software target: per-packet loop (%s)", why)
                self.switch = SoftSwitch(self.pipeline.process, ports, rx, tx)
        else:
            self.switch = SoftSwitch(self.pipeline.process, ports, rx, tx)
        self.server: ServerHandle | None = None

    @property
    def grpc_address(self) -> str:
        if self.server is None or self._grpc_request.startswith("unix:"):
            return self._grpc_request
        return f"{self._grpc_request.rsplit(':', 1)[0]}:{self.server.port}"

    def start(self) -> SoftwareTarget:
        self.server = serve(self.device, self._grpc_request, device_id=self.device.device_id)
        self.switch.start()
        return self

    def stop(self) -> None:
        self.switch.stop()
        if self.server is not None:
            self.server.server.stop(grace=0.5)

    def __enter__(self) -> SoftwareTarget:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
