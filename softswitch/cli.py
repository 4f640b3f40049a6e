"""``netagg-softswitch``: run the software target (the embedded default switch).

Like ``simple_switch_grpc --no-p4``: it starts without a pipeline and waits for a
controller to push the P4Info over P4Runtime; packets arriving before that are dropped.
"""

from __future__ import annotations

import argparse
import logging
import sys

from netagg import wire
from netagg.jobconfig import endpoint_arg
from netagg.shutdown import stop_event
from netagg.softswitch.shards import ShardedSwitch
from netagg.softswitch.target import ENGINES, Faults, SoftwareTarget


def _interface(text: str) -> tuple[int, str]:
    number, sep, ifname = text.partition("@")
    if not sep or not number.isdigit() or not ifname:
        raise argparse.ArgumentTypeError(f"expected PORT@IFNAME like 1@veth1, got {text!r}")
    return int(number), ifname


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"a fraction in [0, 1), got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="netagg-softswitch", description=__doc__)
    parser.add_argument("--grpc-addr", default="127.0.0.1:9559", help="P4Runtime listen address")
    parser.add_argument("--device-id", type=int, default=1)
    parser.add_argument("-i", "--interface", type=_interface, action="append", default=[],
                        help="PORT@IFNAME: attach a Linux interface as a switch port (raw socket)")
    parser.add_argument("--loopback", type=endpoint_arg,
                        help=f"HOST:PORT of the loopback UDP port (e.g. 127.0.0.1:{wire.NETAGG_UDP_PORT})")
    parser.add_argument("--drop", type=_fraction, default=0.0, help="fraction of packets dropped (in and out)")
    parser.add_argument("--duplicate", type=_fraction, default=0.0, help="fraction of packets duplicated")
    parser.add_argument("--reorder", type=_fraction, default=0.0, help="fraction of packets reordered")
    parser.add_argument("--burst", type=_fraction, default=0.0,
                        help="fraction of packets that start a burst loss of --burst-length packets (a lost GSO send)")
    parser.add_argument("--burst-length", type=int, default=64, help="packets lost per burst (default 64)")
    parser.add_argument("--seed", type=int, default=1, help="fault injection seed")
    parser.add_argument("--engine", choices=ENGINES, default="auto",
                        help="fast: compiled batch pipeline (numba); reference: the readable per-packet model; "
                             "auto: fast where it can run (default)")
    parser.add_argument("--shards", type=int, default=None,
                        help="pipeline shards, one core each (default: half this machine's CPUs, at most 8; "
                             "1 with --engine reference or fault injection)")
    parser.add_argument("--udp-segmentation", action="store_true",
                        help="raw ports send each run of one UDP flow's frames as one segmentation-offload send "
                             "(virtio-net header; the egress interface's tx-udp-segmentation, else the kernel, "
                             "cuts it): far fewer sends per result (docs/softswitch.md)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s softswitch %(levelname)s %(message)s")
    interfaces = dict(args.interface)
    if len(interfaces) != len(args.interface):
        parser.error("two interfaces share a port number")
    try:
        faults = Faults(args.drop, args.duplicate, args.reorder, args.seed, args.burst, args.burst_length)
        target = SoftwareTarget(args.grpc_addr, interfaces, args.loopback.as_tuple() if args.loopback else None,
                                faults, args.device_id,
                                engine=args.engine, shards=args.shards, udp_segmentation=args.udp_segmentation)
        target.start()
    except (OSError, ValueError) as err:
        print(f"netagg-softswitch: {err}", file=sys.stderr)
        return 1
    stop = stop_event()
    if isinstance(target.switch, ShardedSwitch):
        target.switch.on_failure = lambda _why: stop.set()
    where = f", loopback {target.loopback.address[0]}:{target.loopback.address[1]}" if target.loopback else ""
    logging.info("ready: P4Runtime on %s, ports %s%s, %s engine (%s loop, %d shard%s)", target.grpc_address,
                 sorted(target.switch.ports), where, target.engine, type(target.switch).__name__, target.shards,
                 "" if target.shards == 1 else "s")
    losses = getattr(target.switch, "port_losses", None)
    reported: dict[int, tuple[int, int]] = {}
    while not stop.wait(LOSS_REPORT_SECONDS):
        if losses is not None:
            reported = _report_losses(losses(), reported)
    target.stop()
    failed = getattr(target.switch, "failed", None)
    if failed:
        print(f"netagg-softswitch: {failed}", file=sys.stderr)
        return 1
    s = target.switch.stats
    logging.info("stopped: %d frames in, %d out, %d to unknown ports, %d failed", s.received, s.transmitted,
                 s.unknown_port, s.transmit_failed)
    return 0


#: How often the switch logs the frames its raw ports lost since the last report (if any).
LOSS_REPORT_SECONDS = 5.0


def _report_losses(now: dict[int, tuple[int, int]], before: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Log, per raw port, the frames lost since ``before``: sends the kernel refused (the port's link backed up)
    and frames its receive ring had no room for; returns ``now`` for the next report."""
    parts = []
    for port, (failed, dropped) in sorted(now.items()):
        was = before.get(port, (0, 0))
        if (failed, dropped) != was:
            parts.append(f"port {port}: {failed - was[0]} not sent, {dropped - was[1]} not received "
                         f"(total {failed}, {dropped})")
    if parts:
        logging.warning("raw port losses in the last %.0f s: %s", LOSS_REPORT_SECONDS, "; ".join(parts))
    return now


if __name__ == "__main__":
    sys.exit(main())
