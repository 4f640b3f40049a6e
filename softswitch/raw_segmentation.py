"""Segmentation offload for raw ports: a port's emitted frames of one UDP flow leave as one send.

A software switch on Linux interfaces pays the kernel's per-frame cost for every frame it sends
(an skb, the qdisc, the veth, the receiver's IP and UDP input): in the emulated cluster at 400 Mbit/s
that was a quarter of both cores, all of it on the switch's one thread (docs/benchmarks.md). Hosts
avoid it with ``UDP_SEGMENT``; an ``AF_PACKET`` socket can do the same with a virtio-net header
(``PACKET_VNET_HDR``) in front of each frame: ``gso_type`` UDP_L4 and ``gso_size`` say "cut this
frame's UDP payload into datagrams of this size". Where the egress device can carry such a frame
(a veth with ``tx-udp-segmentation``), it reaches the receiving host whole, which splits it (or hands
it to a ``UDP_GRO`` socket as one buffer, as a NIC's receive offload would); where it cannot, the
kernel cuts it in software before the device. Either way the wire (and the qdisc shaping it, which
counts every segment's headers) carries the same datagrams as frame-by-frame sends would, except
that the kernel numbers the segments' IPv4 identifications from the first frame's and fills in their
UDP checksums.

:func:`plan_sends` groups a batch of emitted frames by egress port (in emission order) and, within a port,
merges runs of consecutive frames that are one flow: IPv4 without options or fragments, UDP without a checksum
(the switch's results; a forwarded frame's checksum is never recomputed), equal Ethernet, IPv4 and UDP headers
but for the identification and checksums, equal length, and for netagg frames one steering block (job and
``slot >> wire.SEGMENT_BLOCK_SHIFT``: a host with several receive threads steers a coalesced buffer by its
first datagram). Any other frame leaves alone, with an empty virtio-net header: exactly the bytes the pipeline
emitted. The switch asks for this with ``--udp-segmentation``
(:class:`~netagg.softswitch.batch_switch.BatchSwitch`); the emulated cluster does, and turns on its switch-
side interfaces' segmentation offload (``bmv2.netns``).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
import struct

import numpy as np
from numba import njit

from netagg import layout, mmsg, wire
from netagg.softswitch.fastpath_defs import _ipv4_checksum, _u16
from netagg.softswitch.io_kernels import order_by_group

log = logging.getLogger(__name__)

SOL_PACKET = 263
PACKET_VNET_HDR = 15
#: struct virtio_net_hdr: flags, gso_type (u8); hdr_len, gso_size, csum_start, csum_offset (u16, host order).
VNET_BYTES = 10
#: Row of the virtio-net header array (aligned).
VNET_ROW = 16
VIRTIO_NET_HDR_F_NEEDS_CSUM = 1
VIRTIO_NET_HDR_GSO_UDP_L4 = 5
#: Segments of one send: the kernel's UDP_MAX_SEGMENTS (64).
MAX_SEGMENTS = 64
#: UDP payload bytes of one send (its IPv4 total length must fit 16 bits).
MAX_SEND_BYTES = 65000
ETH, IP, UDP, PAYLOAD = 0, 14, 34, 42
#: Errors that mean "this kernel cannot send such a merged frame" (not a full buffer).
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.EPROTONOSUPPORT, errno.EMSGSIZE, errno.ENOTSUP)
NETAGG_PORT = wire.NETAGG_UDP_PORT
BLOCK_SHIFT = wire.SEGMENT_BLOCK_SHIFT


def open_tx_socket(ifname: str) -> socket.socket:
    """A send-only AF_PACKET socket on ``ifname`` (protocol 0: it receives nothing) whose frames carry a
    virtio-net header; raises OSError where the kernel offers no ``PACKET_VNET_HDR``."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
    try:
        sock.bind((ifname, 0))
        sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class SegmentedSends:
    """Message headers, iovecs and virtio-net headers for the sends of up to ``capacity`` frames.

    :meth:`plan` fills them for a batch of emitted frames (:func:`plan_sends`); :meth:`send` sends one
    port's messages. Message ``h``'s first iovec is its virtio-net header (row ``h`` of :attr:`vnet`),
    the second its first frame, the others the UDP payloads of the frames merged into it.
    """

    def __init__(self, capacity: int, groups: int) -> None:
        if not mmsg.AVAILABLE:
            raise OSError("sendmmsg is not available on this platform")
        self.capacity = capacity
        self.vnet = np.zeros((capacity, VNET_ROW), np.uint8)
        self.iov = np.zeros(2 * capacity, mmsg.IOVEC_DTYPE)
        self.hdrs = np.zeros(capacity, mmsg.MMSGHDR_DTYPE)
        self.iov_words = self.iov.view("<u8").reshape(2 * capacity, 2)
        self.hdr_words = self.hdrs.view("<u8").reshape(capacity, 8)
        self.vnet_addr = np.uint64(self.vnet.ctypes.data)
        self.iov_addr = np.uint64(self.iov.ctypes.data)
        self._hdr_addr = self.hdrs.ctypes.data
        #: Messages of each port group after :meth:`plan`, groups in order.
        self.group_counts = np.zeros(max(1, groups), np.int64)
        self._order = np.zeros(capacity, np.int64)
        #: None while merged sends work; else why the kernel refused one (the switch then sends frame by frame).
        self.refused: str | None = None

    def plan(self, out_buf: np.ndarray, out_len: np.ndarray, out_port: np.ndarray, count: int,
             port_slot: np.ndarray, row_addr: np.ndarray) -> tuple[int, int]:
        """Messages for ``count`` emitted frames by group (``port_slot`` as in
        ``io_kernels.order_by_group``); returns (messages, frames to no port)."""
        return plan_sends(out_buf, out_len, out_port, count, port_slot, row_addr, self.group_counts, self._order,
                          self.vnet, self.vnet_addr, self.hdr_words, self.iov_words, self.iov_addr, MAX_SEGMENTS,
                          MAX_SEND_BYTES)

    def send(self, fd: int, count: int, first: int = 0) -> tuple[int, int]:
        """Send messages ``first .. first+count-1`` (the arguments of ``MsgBatch.send_prepared``); returns (frames
        sent, frames failed). A message the kernel refuses for a passing reason (its socket buffer full: the
        port's link is backed up) is skipped and its frames counted. A merged message it refuses as such (a kernel
        without UDP segmentation for packet sockets) sets :attr:`refused`, said once in the log, and goes frame by
        frame."""
        words = self.hdr_words
        sent_frames = failed_frames = 0
        h, end = first, first + count
        while h < end:
            done = mmsg._sendmmsg(fd, self._hdr_addr + h * mmsg.MMSGHDR_DTYPE.itemsize, end - h, 0)
            if done > 0:
                sent_frames += int(words[h:h + done, 3].sum()) - done
                h += done
                continue
            err = ctypes.get_errno() if done < 0 else 0
            if err == errno.EINTR:
                continue
            frames = int(words[h, 3]) - 1
            if frames > 1 and err in _REFUSED:
                if self.refused is None:
                    self.refused = f"the kernel refused a segmentation-offload send ({os.strerror(err)})"
                    log.warning("raw ports: %s; frames leave one by one from now on", self.refused)
                sent = self._send_apart(fd, h)
                sent_frames += sent
                failed_frames += frames - sent
            else:
                failed_frames += frames
            h += 1
        return sent_frames, failed_frames

    def _send_apart(self, fd: int, h: int) -> int:
        """Message ``h``'s frames one send each, its first frame's header as emitted again; returns how many
        left. (The merged frames' own headers are intact in their rows, in front of the payloads sent.)"""
        words = self.hdr_words
        first_iov = (int(words[h, 2]) - int(self.iov_addr)) // 16
        iovs = self.iov_words[first_iov + 1:first_iov + int(words[h, 3])]
        segment = int(iovs[1, 1])
        head = bytearray(ctypes.string_at(int(iovs[0, 0]), int(iovs[0, 1])))
        struct.pack_into("!H", head, IP + 2, 28 + segment)
        struct.pack_into("!HH", head, UDP + 4, 8 + segment, 0)  # UDP length; no checksum (IPv4 allows it)
        struct.pack_into("!H", head, IP + 10, 0)
        total = sum(struct.unpack_from("!10H", head, IP))
        while total >> 16:
            total = (total & 0xFFFF) + (total >> 16)
        struct.pack_into("!H", head, IP + 10, ~total & 0xFFFF)
        frames = [bytes(head)] + [ctypes.string_at(int(addr) - PAYLOAD, int(length) + PAYLOAD)
                                  for addr, length in iovs[1:]]
        sent = 0
        for frame in frames:
            try:
                os.write(fd, bytes(VNET_BYTES) + frame)
                sent += 1
            except OSError:
                pass
        return sent


@njit(cache=True)
def segment_bytes(b, length):
    """The UDP payload length of a frame that may be merged with others (IPv4 without options or fragments,
    UDP without a checksum, lengths consistent with the frame's), or -1. The switch's own results carry no UDP
    checksum; a frame it forwards with one leaves alone, so that a segment's checksum, which the kernel computes,
    never vouches for bytes the sender's checksum did not."""
    if length <= PAYLOAD or _u16(b, 12) != 0x0800 or b[IP] != 0x45 or b[IP + 9] != 17 or _u16(b, UDP + 6):
        return -1
    if _u16(b, IP + 6) & 0x3FFF or _u16(b, IP + 2) != length - IP or _u16(b, UDP + 4) != length - UDP:
        return -1
    return length - PAYLOAD


@njit(cache=True)
def _steering(b, length):
    """The steering block of a netagg frame (job, slot >> BLOCK_SHIFT), or -1."""
    if length < PAYLOAD + layout.SLOT_AT + 2:
        return -1
    return (_u16(b, PAYLOAD + layout.JOB_AT) << 32) | (_u16(b, PAYLOAD + layout.SLOT_AT) >> BLOCK_SHIFT)


@njit(cache=True)
def same_flow(a, b, length):
    """Whether two frames of ``length`` bytes have the same headers but for IPv4 identification and checksums."""
    for i in range(IP + 4):  # Ethernet; version, TOS, total length
        if a[i] != b[i]:
            return False
    for i in range(IP + 6, IP + 10):  # flags and fragment, TTL, protocol
        if a[i] != b[i]:
            return False
    for i in range(IP + 12, UDP + 6):  # addresses, ports, UDP length
        if a[i] != b[i]:
            return False
    return _steering(a, length) == _steering(b, length)


@njit(cache=True)
def _pseudo_header_sum(b, udp_length):
    """The one's-complement sum (folded, not inverted) of the IPv4 pseudo header with ``udp_length``: what a
    checksum-offloaded UDP header carries for the device (here the segmentation) to finish."""
    s = np.int64(0)
    for i in range(IP + 12, IP + 20, 2):
        s += _u16(b, i)
    s += 17 + udp_length
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


@njit(cache=True, nogil=True)
def plan_sends(out_buf, out_len, out_port, count, port_slot, row_addr, group_counts, order, vnet, vnet_addr,
               hdr_words, iov_words, iov_addr, max_segments, max_bytes):
    """Group the emitted frames by egress port group (``port_slot[port]``: the group, -2 sent elsewhere, -1 no
    such port) keeping their order, and fill one message per run of one flow (see the module's docs) and per
    other frame. Group ``g``'s messages are ``group_counts[g]`` consecutive headers, groups in order; a
    message's iovec count is its frames + 1. A merged run's first frame gets the run's IPv4 and UDP lengths and
    the pseudo-header sum as its UDP checksum (the kernel finishes every segment's). Returns (messages,
    frames to no port)."""
    groups = group_counts.shape[0]
    frames = np.zeros(groups, np.int64)
    unknown = order_by_group(out_port, count, port_slot, frames, order)
    group_counts[:] = 0
    h = 0
    iv = 0
    pos = 0
    for g in range(groups):
        end = pos + frames[g]
        j = pos
        while j < end:
            i = order[j]
            b = out_buf[i]
            length = out_len[i]
            seg = segment_bytes(b, length)
            size = 1
            if seg > 0:
                while (j + size < end and size < max_segments and (size + 1) * seg <= max_bytes
                       and out_len[order[j + size]] == length and same_flow(b, out_buf[order[j + size]], length)):
                    size += 1
            v = vnet[h]
            v[:VNET_BYTES] = 0
            iov_words[iv, 0] = vnet_addr + np.uint64(VNET_ROW * h)
            iov_words[iv, 1] = VNET_BYTES
            iov_words[iv + 1, 0] = row_addr[i]
            iov_words[iv + 1, 1] = length
            if size > 1:
                for k in range(1, size):
                    r = order[j + k]
                    iov_words[iv + 1 + k, 0] = row_addr[r] + np.uint64(PAYLOAD)
                    iov_words[iv + 1 + k, 1] = seg
                udp_length = 8 + size * seg
                ip_length = 20 + udp_length
                b[IP + 2] = ip_length >> 8
                b[IP + 3] = ip_length & 0xFF
                b[UDP + 4] = udp_length >> 8
                b[UDP + 5] = udp_length & 0xFF
                _ipv4_checksum(b)
                check = _pseudo_header_sum(b, udp_length)
                b[UDP + 6] = check >> 8
                b[UDP + 7] = check & 0xFF
                v[0] = VIRTIO_NET_HDR_F_NEEDS_CSUM
                v[1] = VIRTIO_NET_HDR_GSO_UDP_L4
                v[2] = PAYLOAD  # hdr_len, little-endian u16s from here on
                v[4] = seg & 0xFF
                v[5] = seg >> 8
                v[6] = UDP
                v[8] = 6  # csum_offset: the UDP checksum
            hdr_words[h, 0] = 0
            hdr_words[h, 1] = 0
            hdr_words[h, 2] = iov_addr + np.uint64(16 * iv)
            hdr_words[h, 3] = size + 1
            hdr_words[h, 4] = 0
            hdr_words[h, 5] = 0
            hdr_words[h, 6] = 0
            group_counts[g] += 1
            iv += size + 1
            h += 1
            j += size
        pos = end
    return h, unknown
