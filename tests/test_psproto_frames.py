"""The TCP framing every netagg server speaks (netagg/psproto.py): timeouts bound progress, not size."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from netagg.psproto import recv_frame, send_frame

pytestmark = pytest.mark.timeout(60)


def _pair(buffer: int = 64 << 10) -> tuple[socket.socket, socket.socket]:
    """A connected TCP pair on loopback with small kernel buffers (so a frame cannot sit in them whole)."""
    listener = socket.create_server(("127.0.0.1", 0))
    sender = socket.socket()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
    sender.connect(listener.getsockname())
    receiver, _ = listener.accept()
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
    listener.close()
    return sender, receiver


def test_a_frame_that_keeps_moving_is_sent_however_long_it_takes():
    sender, receiver = _pair()
    blob = bytes(range(256)) * (16 << 10)  # 4 MiB: over a second at the reader's pace below
    got = bytearray()

    def slow_reader() -> None:
        receiver.settimeout(10)
        while data := receiver.recv(32 << 10):  # ~3 MB/s: the sender waits for room again and again
            got.extend(data)
            time.sleep(0.01)

    reader = threading.Thread(target=slow_reader)
    reader.start()
    sender.settimeout(0.5)  # far less than the whole frame takes, more than any single wait for room
    began = time.monotonic()
    send_frame(sender, {"op": "push"}, blob)  # Python's sendall would time out: its timeout is for the total
    took = time.monotonic() - began
    sender.close()
    reader.join(30)
    receiver.close()
    assert took > 0.5  # longer than the timeout in all, yet not cut off
    assert bytes(got[-len(blob):]) == blob


def test_a_frame_that_stops_moving_fails_after_the_timeout():
    sender, receiver = _pair()
    sender.settimeout(0.3)
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        send_frame(sender, {"op": "push"}, bytes(8 << 20))  # nobody reads: the buffers fill, then nothing moves
    assert time.monotonic() - began < 5
    sender.close()
    receiver.close()


def test_frames_round_trip_through_a_slow_reader():
    sender, receiver = _pair()
    blob = bytes(range(256)) * (4 << 10)
    out: dict = {}

    def read() -> None:
        receiver.settimeout(10)
        out["frame"] = recv_frame(receiver)

    reader = threading.Thread(target=read)
    reader.start()
    sender.settimeout(2)
    send_frame(sender, {"op": "push", "n": 1}, blob)
    reader.join(30)
    header, data = out["frame"]
    assert header == {"op": "push", "n": 1} and bytes(data) == blob
    sender.close()
    receiver.close()
