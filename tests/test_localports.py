"""netagg.localports: ports outside the kernel's ephemeral range, handed out once, free when handed out."""

from __future__ import annotations

import socket
import threading

import pytest

from netagg import localports
from netagg.localports import PortAllocator, free_ports, port_window


def _bindable(port: int, sock_type: int) -> bool:
    with socket.socket(socket.AF_INET, sock_type) as sock:  # SO_REUSEADDR off, as the allocator checks
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_ports_lie_outside_the_ephemeral_range_in_the_window():
    low, high = localports.ephemeral_range()
    window = port_window()
    for kind in ("udp", "tcp", "both"):
        for port in free_ports(20, kind):
            assert not low <= port <= high, (port, low, high)
            assert port in window and port >= localports.FLOOR
            assert not localports.FIXED_PORTS[0] <= port < localports.FIXED_PORTS[1]


def test_the_window_avoids_any_ephemeral_range_and_the_fixed_ports():
    assert port_window((32768, 60999)) == range(*localports.PREFERRED_WINDOW)
    assert port_window((49152, 65535)) == range(*localports.PREFERRED_WINDOW)
    assert port_window((10000, 60999)) == range(61000, 65536)
    assert port_window((15000, 28000)) == range(30000, 65536)  # 28800-29999 stays out
    assert port_window((1024, 65000)) == range(65001, 65536)
    with pytest.raises(RuntimeError, match="no room for test ports"):
        port_window((1024, 65535))


def test_an_unreadable_range_file_means_linux_default(tmp_path):
    assert localports.ephemeral_range(str(tmp_path / "absent")) == localports.DEFAULT_EPHEMERAL_RANGE
    (tmp_path / "junk").write_text("not numbers\n")
    assert localports.ephemeral_range(str(tmp_path / "junk")) == localports.DEFAULT_EPHEMERAL_RANGE
    (tmp_path / "range").write_text("20000\t40000\n")
    assert localports.ephemeral_range(str(tmp_path / "range")) == (20000, 40000)


def test_no_port_is_handed_out_twice_across_calls_kinds_and_threads():
    got: list[int] = []
    for kind in ("udp", "tcp", "both"):
        got += free_ports(5, kind)
    results: list[list[int]] = []
    threads = [threading.Thread(target=lambda: results.append(free_ports(10, "both"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    got += [port for ports in results for port in ports]
    assert len(got) == 15 + 40 and len(set(got)) == len(got)


def test_both_gives_ports_free_for_udp_and_tcp():
    for port in free_ports(5, "both"):
        assert _bindable(port, socket.SOCK_DGRAM) and _bindable(port, socket.SOCK_STREAM), port


def test_a_port_held_by_another_socket_is_skipped():
    held_udp, held_tcp, spare = free_ports(3, "both")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, socket.socket() as tcp:
        udp.bind(("127.0.0.1", held_udp))
        tcp.bind(("127.0.0.1", held_tcp))
        tcp.listen()
        allocator = PortAllocator([held_udp, held_tcp, spare])
        assert allocator.take(1, "both") == [spare]  # both held ports come first and are skipped
        with pytest.raises(RuntimeError, match="only 0 of 1 both ports free"):
            allocator.take(1, "both")
        # A kind checks only its protocol: a TCP listener does not make the port busy for UDP.
        assert PortAllocator([held_udp, held_tcp]).take(1, "udp") == [held_tcp]
        assert PortAllocator([held_tcp, held_udp]).take(1, "tcp") == [held_udp]


def test_a_failed_request_hands_nothing_out():
    first, second = free_ports(2, "both")
    allocator = PortAllocator([first, second])
    with pytest.raises(RuntimeError):
        allocator.take(3, "udp")
    assert sorted(allocator.take(2, "udp")) == sorted([first, second])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="kind"):
        free_ports(1, "sctp")
    with pytest.raises(ValueError, match="count"):
        free_ports(-1)
    assert free_ports(0) == []
