"""Switch ports of the software target.

* :class:`RawSocketPort` attaches to a Linux interface (one end of a veth pair,
  as BMv2's ``-i 1@veth1``) with an AF_PACKET socket: whole Ethernet frames.
* :class:`LoopbackUdpPort` is the unprivileged embedded default: hosts send real
  UDP datagrams to one socket on 127.0.0.1; each arrives at the pipeline as the
  Ethernet/IPv4/UDP frame the kernel would have put on a wire, and every frame
  the pipeline emits leaves as the UDP datagram its IPv4/UDP headers describe.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from typing import Protocol

from netagg import steering, wire

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
#: MACs the loopback port puts into synthesized frames.
LOOPBACK_SWITCH_MAC = bytes.fromhex("02000000aa01")
LOOPBACK_HOST_MAC = bytes.fromhex("02000000bb01")
_ETH = struct.Struct("!6s6sH")
_IPV4 = struct.Struct("!BBHHHBBH4s4s")
_UDP = struct.Struct("!HHHH")


class Port(Protocol):
    """What the switch loop needs from a port."""

    number: int

    def fileno(self) -> int: ...

    def receive(self) -> list[bytes]:
        """Frames waiting on the port (non-blocking; empty when none)."""

    def transmit(self, frame: bytes) -> bool:
        """Send one frame; False when it could not leave (counted by the caller)."""

    def close(self) -> None: ...


class RawSocketPort:
    """A port on a Linux interface via AF_PACKET (needs CAP_NET_RAW)."""

    def __init__(self, number: int, ifname: str) -> None:
        self.number = number
        self.ifname = ifname
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.bind((ifname, 0))
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self) -> list[bytes]:
        frames = []
        for _ in range(64):
            try:
                frame, address = self.sock.recvfrom(65535)
            except BlockingIOError:
                break
            if address[2] != PACKET_OUTGOING:
                frames.append(frame)
        return frames

    def transmit(self, frame: bytes) -> bool:
        try:
            self.sock.send(frame)
        except OSError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()


class LoopbackUdpPort:
    """The embedded default port: real UDP on loopback, frames inside the switch."""

    def __init__(self, number: int, host: str = "127.0.0.1", udp_port: int = wire.NETAGG_UDP_PORT,
                 sock: socket.socket | None = None) -> None:
        """``sock``: a bound, non-blocking UDP socket to serve (one of a shard group's: ``netagg.steering``)."""
        self.number = number
        self.sock = sock if sock is not None else steering.udp_group(host, udp_port, 1)[0]
        self.address = self.sock.getsockname()
        self._switch_ip = socket.inet_aton(self.address[0])
        self.undeliverable = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self) -> list[bytes]:
        frames = []
        for _ in range(64):
            try:
                data, (src_ip, src_port) = self.sock.recvfrom(65535)
            except BlockingIOError:
                break
            except ConnectionRefusedError:  # ICMP from an earlier send; nothing to read
                continue
            frames.append(self._frame_for(data, src_ip, src_port))
        return frames

    def _frame_for(self, data: bytes, src_ip: str, src_port: int) -> bytes:
        """The frame a host's kernel would have sent for this datagram."""
        udp_len = wire.UDP_HEADER_BYTES + len(data)
        ip = [0x45, 0, wire.IPV4_HEADER_BYTES + udp_len, 0, 0x4000, 64, wire.IPPROTO_UDP, 0,
              socket.inet_aton(src_ip), self._switch_ip]
        ip[7] = wire.ipv4_checksum(_IPV4.pack(*ip))
        return b"".join((
            _ETH.pack(LOOPBACK_SWITCH_MAC, LOOPBACK_HOST_MAC, wire.ETHERTYPE_IPV4),
            _IPV4.pack(*ip),
            _UDP.pack(src_port, wire.NETAGG_UDP_PORT, udp_len, 0),
            data,
        ))

    def transmit(self, frame: bytes) -> bool:
        """Send the frame's UDP payload to its IPv4 destination and UDP port."""
        if len(frame) < wire.ETH_HEADER_BYTES + wire.IPV4_HEADER_BYTES + wire.UDP_HEADER_BYTES:
            self.undeliverable += 1
            return False
        ether_type = _ETH.unpack_from(frame, 0)[2]
        ip = _IPV4.unpack_from(frame, wire.ETH_HEADER_BYTES)
        ihl = (ip[0] & 0x0F) * 4
        if ether_type != wire.ETHERTYPE_IPV4 or ip[6] != wire.IPPROTO_UDP:
            self.undeliverable += 1
            return False
        udp_offset = wire.ETH_HEADER_BYTES + ihl
        dst_port = _UDP.unpack_from(frame, udp_offset)[1]
        dst_ip = str(ipaddress.IPv4Address(ip[9]))
        try:
            self.sock.sendto(frame[udp_offset + wire.UDP_HEADER_BYTES:], (dst_ip, dst_port))
        except OSError:
            self.undeliverable += 1
            return False
        return True

    def close(self) -> None:
        self.sock.close()
