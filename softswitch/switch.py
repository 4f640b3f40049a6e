"""The software target's packet loop: ports in, pipeline, ports out."""

from __future__ import annotations

import logging
import selectors
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from netagg.faults import FaultInjector
from netagg.softswitch.ports import Port

log = logging.getLogger(__name__)

#: Idle time after which packets held back for reordering are released.
REORDER_FLUSH_SECONDS = 0.002


@dataclass
class PortStats:
    """Frames through the switch, for benchmarks and operators."""

    received: int = 0
    transmitted: int = 0
    unknown_port: int = 0
    transmit_failed: int = 0


class PortLoop:
    """One thread serving a set of ports until stop(): what every packet loop of the target shares."""

    #: The serving thread's name.
    thread_name = "softswitch"

    def __init__(self, ports: Sequence[Port]) -> None:
        self.ports = {port.number: port for port in ports}
        if len(self.ports) != len(ports):
            raise ValueError("two ports share a number")
        self.stats = PortStats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for port in self.ports.values():
            port.close()


class SoftSwitch(PortLoop):
    """Moves frames between ports through ``process(frame, port) -> [(port, frame)]``.

    One thread serves all ports with a selector, so the pipeline sees one packet
    at a time, like BMv2's single ingress thread. ``rx_faults``/``tx_faults``
    inject loss, duplication and reordering on the way in and out.
    """

    def __init__(
        self,
        process: Callable[[bytes, int], list[tuple[int, bytes]]],
        ports: Sequence[Port],
        rx_faults: FaultInjector[tuple[bytes, int]] | None = None,
        tx_faults: FaultInjector[tuple[int, bytes]] | None = None,
    ) -> None:
        super().__init__(ports)
        self.process = process
        self.rx_faults = rx_faults if rx_faults and rx_faults.active else None
        self.tx_faults = tx_faults if tx_faults and tx_faults.active else None

    def run(self) -> None:
        """Serve until stop(); one packet at a time."""
        selector = selectors.DefaultSelector()
        for port in self.ports.values():
            selector.register(port.fileno(), selectors.EVENT_READ, port)
        while not self._stop.is_set():
            events = selector.select(timeout=REORDER_FLUSH_SECONDS if self._holding() else 0.1)
            if not events:
                self._flush_faults()
                continue
            for key, _ in events:
                port: Port = key.data
                for frame in port.receive():
                    self._ingress(frame, port.number)
        selector.close()

    def _holding(self) -> bool:
        return self.rx_faults is not None or self.tx_faults is not None

    def _flush_faults(self) -> None:
        if self.rx_faults is not None:
            for frame, number in self.rx_faults.flush():
                self._pipeline(frame, number)
        if self.tx_faults is not None:
            for number, frame in self.tx_faults.flush():
                self._transmit(number, frame)

    def _ingress(self, frame: bytes, number: int) -> None:
        self.stats.received += 1
        if self.rx_faults is None:
            self._pipeline(frame, number)
            return
        for held_frame, held_number in self.rx_faults.filter((frame, number)):
            self._pipeline(held_frame, held_number)

    def _pipeline(self, frame: bytes, number: int) -> None:
        try:
            outputs = self.process(frame, number)
        except Exception:  # a model bug must not stop the switch
            log.exception("pipeline failed on a %d-byte frame from port %d", len(frame), number)
            return
        for out_number, out_frame in outputs:
            if self.tx_faults is None:
                self._transmit(out_number, out_frame)
            else:
                for held_number, held_frame in self.tx_faults.filter((out_number, out_frame)):
                    self._transmit(held_number, held_frame)

    def _transmit(self, number: int, frame: bytes) -> None:
        port = self.ports.get(number)
        if port is None:
            self.stats.unknown_port += 1
            return
        if port.transmit(frame):
            self.stats.transmitted += 1
        else:
            self.stats.transmit_failed += 1
