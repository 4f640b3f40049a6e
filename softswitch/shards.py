"""The software target over several cores: N pipeline shards, each a batch loop on its own thread.

Every shard is a :class:`~netagg.softswitch.batch_switch.BatchSwitch` with sockets of its own
on the same ports, and the kernel steers each packet to the shard that owns its slot
(:mod:`netagg.steering`: ``(job_id + (slot >> 6)) mod N``): the loopback port is an
``SO_REUSEPORT`` group with a classic BPF program that reads the netagg header, each raw port a
``PACKET_FANOUT`` group in ``PACKET_FANOUT_CBPF`` mode with the same rule on the frame. So a
slot's registers are only ever written by one core, and the compiled kernels run without
Python's GIL. The shards share the tables and registers (disjoint slots) and count into
counters of their own, which P4Runtime reads add up; a control-plane write takes every
shard's lock, so it reaches every shard before it is acknowledged
(:class:`~netagg.softswitch.forwarding_state.StateLock`).

A shard whose thread ends while the switch runs takes the whole switch down, loudly: the
other shards stop, their ports close, ``failed`` says why and ``on_failure`` is called (the
``netagg-softswitch`` process exits with status 1). Hosts then see a dead switch, which
they survive (failover to the PS), rather than a switch that aggregates part of the slots.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING

from netagg import steering
from netagg.softswitch.fastpath import FastPipeline
from netagg.softswitch.ports import LoopbackUdpPort, Port, RawSocketPort
from netagg.softswitch.switch import PortStats

if TYPE_CHECKING:
    from netagg.softswitch.batch_switch import BatchSwitch

log = logging.getLogger(__name__)

def default_shards() -> int:
    """What the machine can spare: half the CPUs this process may run on (the rest for the hosts and the
    control plane), at least 1, at most 8 (past that the Python part of each batch, under the GIL, caps it)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // 2))


class ShardingUnavailable(ValueError):
    """These ports cannot be served by several shards here (the target then runs one, saying why)."""


class ShardedSwitch:
    """N shards serving the same ports (the interface of ``SoftSwitch``/``BatchSwitch``: start, stop, ports,
    stats)."""

    #: No fault injection here (the target runs one per-packet loop for that).
    rx_faults = None
    tx_faults = None

    def __init__(self, pipeline: FastPipeline, shards: int, interfaces: Mapping[int, str],
                 loopback: tuple[int, str, int] | None = None, raw_io: str | None = None,
                 udp_segmentation: bool = False) -> None:
        from netagg.softswitch.batch_switch import BatchSwitch  # needs numba

        if shards < 2:
            raise ValueError("a sharded switch has at least 2 shards")
        self.pipelines = [pipeline, *(pipeline.add_shard() for _ in range(shards - 1))]
        per_shard: list[list[Port]] = [[] for _ in range(shards)]
        opened: list[Port] = []
        try:
            if loopback is not None:
                number, host, udp_port = loopback
                for i, sock in enumerate(steering.udp_group(host, udp_port, shards)):
                    port = LoopbackUdpPort(number, sock=sock)
                    opened.append(port)
                    per_shard[i].append(port)
            for number, ifname in sorted(interfaces.items()):
                members = [RawSocketPort(number, ifname) for _ in range(shards)]
                opened.extend(members)
                for i, port in enumerate(members):
                    per_shard[i].append(port)
            self.shards: list[BatchSwitch] = [BatchSwitch(p, ports, raw_io, peers=self.pipelines,
                                                                   udp_segmentation=udp_segmentation)
                           for p, ports in zip(self.pipelines, per_shard, strict=True)]
            # Rings are set up; now the raw ports' sockets join one steered fanout group per interface.
            for number in sorted(interfaces):
                members = [shard.ports[number] for shard in self.shards]
                group = None
                for shard, port in zip(self.shards, members, strict=True):
                    group, hides = steering.join_fanout(port.sock, group, shards)  # type: ignore[union-attr]
                    if not hides and shard._rings is None:
                        raise ShardingUnavailable(f"raw port {number}: this kernel shows a fanout group the frames "
                                                  "it sends, and only packet rings filter them (NETAGG_RAW_IO=ring)")
        except BaseException:
            for port in opened:
                port.close()
            raise
        #: Why the switch went down (a shard ended), or None while it runs.
        self.failed: str | None = None
        #: Called once, from the dying shard's thread, when a shard ends while the switch runs.
        self.on_failure: Callable[[str], None] | None = None
        self._stopping = threading.Event()
        self._halt_lock = threading.Lock()
        self._halted = False

    @property
    def ports(self) -> dict[int, Port]:
        """Shard 0's ports by number (every shard has one socket per port number)."""
        return self.shards[0].ports

    @property
    def stats(self) -> PortStats:
        """Frames through the switch, summed over shards."""
        return PortStats(*(sum(getattr(shard.stats, f.name) for shard in self.shards) for f in fields(PortStats)))

    def port_losses(self) -> dict[int, tuple[int, int]]:
        """Per raw port: (transmit failures, receive-ring drops), summed over shards."""
        total: dict[int, tuple[int, int]] = {}
        for shard in self.shards:
            for port, (failed, dropped) in shard.port_losses().items():
                was = total.get(port, (0, 0))
                total[port] = (was[0] + failed, was[1] + dropped)
        return total

    @property
    def foreign_frames(self) -> int:
        """Frames that reached a shard for another shard's slots (run there under both shards' locks)."""
        return sum(shard.foreign_frames for shard in self.shards)

    def start(self) -> None:
        for i, shard in enumerate(self.shards):
            shard._thread = threading.Thread(target=self._serve, args=(i,), name=f"softswitch-shard{i}", daemon=True)
            shard._thread.start()

    def _serve(self, index: int) -> None:
        reason = "its loop returned"
        try:
            self.shards[index].run()
        except BaseException as err:  # any end of a shard takes the switch down
            reason = f"{type(err).__name__}: {err}"
        if self._stopping.is_set():
            return
        self.failed = f"shard {index} stopped ({reason}); the switch is down: no partial aggregation"
        log.critical("software target: %s", self.failed)
        self._halt()
        if self.on_failure is not None:
            self.on_failure(self.failed)

    def _halt(self) -> None:
        """Stop every shard, wait for their threads (not the calling one), then close their ports."""
        with self._halt_lock:
            if self._halted:
                return
            self._halted = True
        self._stopping.set()
        for shard in self.shards:
            shard._stop.set()
        me = threading.current_thread()
        for shard in self.shards:
            if shard._thread is not None and shard._thread is not me:
                shard._thread.join(timeout=5)
            shard._thread = None  # joined (or this one): BatchSwitch.stop closes rings and ports
            shard.stop()

    def stop(self) -> None:
        self._halt()


def shard_counts(shards: int | None, why_not: str | None) -> int:
    """The shard count to run: ``shards`` (None: :func:`default_shards`), or 1 with a log line when the
    loop cannot be sharded (``why_not``)."""
    wanted = default_shards() if shards is None else shards
    if wanted < 1:
        raise ValueError(f"shards must be at least 1, got {wanted}")
    if wanted > steering.MAX_SHARDS:
        raise ValueError(f"shards must be at most {steering.MAX_SHARDS}, got {wanted}")
    if wanted > 1 and why_not:
        log.warning("software target: 1 shard, not %d (%s)", wanted, why_not)
        return 1
    return wanted


__all__: Sequence[str] = ("ShardedSwitch", "ShardingUnavailable", "default_shards", "shard_counts")
