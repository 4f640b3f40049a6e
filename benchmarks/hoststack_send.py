"""Packets/s of the host stack's send path vs bare send loops of the same packet size.

All send to a local UDP sink that nobody reads (the kernel drops what overflows its
buffer, so no side is clocked by a receiver). The send path is the transport's own code
for a window refill (``Exchange.emit``): quantize a batch of blocks into their slots'
preallocated packets and fill the headers in one pass, send the batch with one
``sendmmsg`` (one ``send`` per packet without it), set the expectations and arm the batch's
retransmission timer. Prints ``ratio = send path pps / bare sendto pps`` (goal >= 0.8), and
for reference the ratios to a bare ``send`` loop on a connected socket and to bare
``sendmmsg`` calls of prebuilt packets in batches of the same window (the syscalls alone:
what remains is the cost of building the packets).
Run: ``python -m benchmarks.hoststack_send``.
"""

from __future__ import annotations

import argparse
import socket
import time

import numpy as np

from netagg import mmsg, wire
from netagg.hoststack import quantization as qz
from netagg.hoststack.transport import Exchange, Transport
from netagg.jobconfig import Endpoint, WorkerConfig


def bare_sendto(sock: socket.socket, dest: tuple[str, int], count: int) -> float:
    """Packets/s of ``sendto`` of one prebuilt packet in a loop."""
    packet = wire.pack(wire.Header(job_id=1, slot=0, pool=0, rank=0, seq=0), np.zeros(wire.K, np.int32))
    send = sock.sendto
    start = time.perf_counter()
    for _ in range(count):
        send(packet, dest)
    return count / (time.perf_counter() - start)


def bare_send_connected(sock: socket.socket, count: int) -> float:
    """Packets/s of ``send`` on a connected socket (what the transport uses with a single peer)."""
    packet = wire.pack(wire.Header(job_id=1, slot=0, pool=0, rank=0, seq=0), np.zeros(wire.K, np.int32))
    send = sock.send
    start = time.perf_counter()
    for _ in range(count):
        send(packet)
    return count / (time.perf_counter() - start)


def bare_sendmmsg(sock: socket.socket, count: int, window: int) -> float:
    """Packets/s of sendmmsg of ``window`` prebuilt packets per call on a connected socket."""
    batch = mmsg.MsgBatch(window, wire.NETAGG_BYTES)
    packet = wire.pack(wire.Header(job_id=1, slot=0, pool=0, rank=0, seq=0), np.zeros(wire.K, np.int32))
    batch.buf[:] = np.frombuffer(packet, np.uint8)
    batch.tx_iov_words[:, 0] = batch.row_addr
    batch.tx_iov_words[:, 1] = wire.NETAGG_BYTES
    fd, send = sock.fileno(), batch.send_prepared
    start = time.perf_counter()
    for _ in range(count // window):
        send(fd, window)
    return count // window * window / (time.perf_counter() - start)


def send_path(transport: Transport, count: int) -> float:
    """Packets/s of the transport's window refill (``Exchange.emit``) over ``count`` blocks."""
    slots = transport.slot_count
    rng = np.random.default_rng(0)
    blocks = rng.standard_normal((count, wire.K)).astype(np.float32)
    exponents = qz.block_exponents(blocks)
    round_ = Exchange(transport, blocks, exponents)
    round_.global_exp[:] = exponents  # as if the switch had answered with these maxima
    batches = [(list(range(slots)), list(range(first, first + slots))) for first in range(0, count, slots)]
    start = time.perf_counter()
    for slot_list, block_list in batches:
        round_.emit(slot_list, block_list)
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--packets", type=int, default=100_000)
    parser.add_argument("--slots", type=int, default=128, help="window (packets per refill batch)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating measurements; best of each is kept")
    args = parser.parse_args()
    count = args.packets // args.slots * args.slots
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    dest = sink.getsockname()
    config = WorkerConfig(job_id=1, rank=0, num_workers=8, slot_count=args.slots, mode="allreduce",
                          aggregator=Endpoint(*dest), bind=Endpoint("127.0.0.1", 0))
    with Transport(config) as transport:
        bare_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        bare_sock.bind(("127.0.0.1", 0))
        connected = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        connected.connect(dest)
        bare, bare_connected, bare_mmsg, ours = 0.0, 0.0, 0.0, 0.0
        for _ in range(args.rounds):
            bare = max(bare, bare_sendto(bare_sock, dest, count))
            bare_connected = max(bare_connected, bare_send_connected(connected, count))
            if mmsg.AVAILABLE:
                bare_mmsg = max(bare_mmsg, bare_sendmmsg(connected, count, args.slots))
            ours = max(ours, send_path(transport, count))
        bare_sock.close()
        connected.close()
    sink.close()
    print(f"packet {wire.NETAGG_BYTES} bytes, {count} packets, window {args.slots}")
    print(f"bare sendto loop          : {bare:>10.0f} packets/s")
    print(f"bare send loop, connected : {bare_connected:>10.0f} packets/s  (the transport connects its socket)")
    if bare_mmsg:
        print(f"bare sendmmsg, connected  : {bare_mmsg:>10.0f} packets/s  (prebuilt packets, {args.slots} per call)")
    print(f"send path                 : {ours:>10.0f} packets/s  "
          f"({'sendmmsg' if transport.batched else 'one send per packet'})")
    print(f"ratio to sendto           : {ours / bare:.3f}  (goal >= 0.8)")
    print(f"ratio to connected send   : {ours / bare_connected:.3f}")
    if bare_mmsg:
        print(f"ratio to bare sendmmsg    : {ours / bare_mmsg:.3f}")


if __name__ == "__main__":
    main()
