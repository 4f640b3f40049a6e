"""Another tenant's traffic on the emulated cluster: a paced TCP sender and a counting sink.

``python -m netagg.bmv2.background sink PORT`` accepts connections and counts bytes until
SIGTERM/SIGINT, then prints ``{"bytes": N, "seconds": S}``.
``python -m netagg.bmv2.background send HOST PORT MBIT`` sends at about MBIT Mbit/s (paced in
64 KB writes; TCP backs off further when the links are busy) until stopped, then prints
``{"bytes": N, "seconds": S}``. Both run inside a host's namespace (``cluster.host_command``).
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import sys
import time
from collections.abc import Sequence

from netagg.shutdown import stop_event

CHUNK = 64 * 1024


def sink(port: int) -> dict:
    stop = stop_event()
    server = socket.create_server(("0.0.0.0", port), reuse_port=False)
    server.setblocking(False)
    conns: list[socket.socket] = []
    total, started = 0, time.monotonic()
    print("sink: listening", flush=True)
    while not stop.is_set():
        readable, _, _ = select.select([server, *conns], [], [], 0.1)
        for sock in readable:
            if sock is server:
                conn, _ = server.accept()
                conn.setblocking(False)
                conns.append(conn)
                continue
            try:
                data = sock.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                conns.remove(sock)
                sock.close()
            total += len(data)
    return {"bytes": total, "seconds": round(time.monotonic() - started, 3)}


def send(host: str, port: int, mbit: float) -> dict:
    stop = stop_event()
    deadline = time.monotonic() + 10
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or stop.is_set():
                raise
            time.sleep(0.1)
    payload = bytes(CHUNK)
    total, started = 0, time.monotonic()
    interval = CHUNK * 8 / (mbit * 1e6)
    print("send: connected", flush=True)
    next_at = started
    while not stop.is_set():
        try:
            sock.settimeout(0.5)
            total += sock.send(payload)
        except TimeoutError:
            continue
        except OSError:
            break
        next_at += interval
        delay = next_at - time.monotonic()
        if delay > 0:
            stop.wait(delay)
        else:
            next_at = time.monotonic()  # behind (the links are busy): do not burst to catch up
    sock.close()
    return {"bytes": total, "seconds": round(time.monotonic() - started, 3)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="role", required=True)
    sink_args = sub.add_parser("sink")
    sink_args.add_argument("port", type=int)
    send_args = sub.add_parser("send")
    send_args.add_argument("host")
    send_args.add_argument("port", type=int)
    send_args.add_argument("mbit", type=float)
    args = parser.parse_args(argv)
    result = sink(args.port) if args.role == "sink" else send(args.host, args.port, args.mbit)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
