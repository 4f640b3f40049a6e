"""A packet-level model of ``p4src/v1model/netagg.p4``: parser, ingress, replication, egress, deparser.

Every branch here corresponds to a line of the P4 program (named in the comments)
and the same PTF suite runs against this model and against BMv2, so where the two
differ the model is wrong. Tables, counters and multicast groups live in the
``ForwardingState`` that the P4Runtime server writes; registers live here, as in
the P4 program, where only the data plane touches them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from p4.config.v1 import p4info_pb2

from netagg import dataplane as dp
from netagg import wire
from netagg.dataplane import DropReason
from netagg.slots import Delivery, SlotRegisters
from netagg.softswitch.forwarding_state import ForwardingState

_ETH = struct.Struct("!6s6sH")
_IPV4 = struct.Struct("!BBHHHBBH4s4s")
_UDP = struct.Struct("!HHHH")
_VALUES_DTYPE = wire.WIRE_VALUE_DTYPE
_MF_BIT = 0x2000
_FRAG_OFFSET_MASK = 0x1FFF
#: UDP destination ports the parser takes for netagg packets (the tree port: tree_links.p4).
_NETAGG_PORTS = (wire.NETAGG_UDP_PORT, wire.NETAGG_TREE_UDP_PORT)


@dataclass(slots=True)
class ParsedPacket:
    """Headers as the P4 parser leaves them; None = invalid header."""

    eth: list | None = None  # [dst, src, ether_type]
    ipv4: list | None = None  # [ver_ihl, tos, total_len, ident, flags_frag, ttl, proto, csum, src, dst]
    udp: list | None = None  # [src_port, dst_port, length, checksum]
    netagg: list | None = None  # wire.HEADER_FIELDS order
    values: np.ndarray | None = None  # int32[k]: values_h, and values1..3 of a wide packet
    payload: bytes = b""
    parser_error: bool = False


def parse(frame: bytes) -> ParsedPacket:
    """NetaggParser: ethernet -> ipv4 (ihl 5, UDP) -> udp -> netagg + values (+ three more value headers when
    the width code is the wide one's)."""
    pkt = ParsedPacket()
    if len(frame) < wire.ETH_HEADER_BYTES:
        pkt.parser_error = True
        return pkt
    pkt.eth = list(_ETH.unpack_from(frame, 0))
    offset = wire.ETH_HEADER_BYTES
    if pkt.eth[2] == wire.ETHERTYPE_IPV4:
        if len(frame) < offset + wire.IPV4_HEADER_BYTES:
            pkt.parser_error = True
            return pkt
        pkt.ipv4 = list(_IPV4.unpack_from(frame, offset))
        offset += wire.IPV4_HEADER_BYTES
        if pkt.ipv4[0] & 0x0F == 5 and pkt.ipv4[6] == wire.IPPROTO_UDP:
            if len(frame) < offset + wire.UDP_HEADER_BYTES:
                pkt.parser_error = True
                return pkt
            pkt.udp = list(_UDP.unpack_from(frame, offset))
            offset += wire.UDP_HEADER_BYTES
            if pkt.udp[1] in _NETAGG_PORTS:
                if len(frame) < offset + wire.HEADER_BYTES:
                    pkt.parser_error = True
                    return pkt
                pkt.netagg = list(wire.HEADER_STRUCT.unpack_from(frame, offset))
                offset += wire.HEADER_BYTES
                k = wire.WIDE_K if pkt.netagg[_WIDTH] == _WIDE else wire.K
                if len(frame) < offset + k * wire.VALUE_BYTES:
                    pkt.parser_error = True
                    return pkt
                pkt.values = np.frombuffer(frame, _VALUES_DTYPE, k, offset).astype(np.int32)
                offset += k * wire.VALUE_BYTES
    pkt.payload = frame[offset:]
    return pkt


def deparse(pkt: ParsedPacket) -> bytes:
    """NetaggDeparser plus NetaggComputeChecksum (csum16 over option-less IPv4)."""
    parts = [_ETH.pack(*pkt.eth)]
    if pkt.ipv4 is not None:
        ip = pkt.ipv4
        if ip[0] & 0x0F == 5:
            ip[7] = 0
            ip[7] = wire.ipv4_checksum(_IPV4.pack(*ip))
        parts.append(_IPV4.pack(*ip))
    if pkt.udp is not None:
        parts.append(_UDP.pack(*pkt.udp))
    if pkt.netagg is not None:
        parts.append(wire.HEADER_STRUCT.pack(*pkt.netagg))
    if pkt.values is not None:
        parts.append(pkt.values.astype(_VALUES_DTYPE).tobytes())
    parts.append(pkt.payload)
    return b"".join(parts)


# Field positions in ParsedPacket.netagg (wire.HEADER_FIELDS order).
_N = {f.name: i for i, f in enumerate(wire.HEADER_FIELDS)}
_WIDE = wire.WIDTH_CODES[wire.WIDE_K]
#: (IPv4 total length, UDP length) of each width code: any other pair is MALFORMED.
_LENGTHS = {code: (wire.ipv4_total_length(k), wire.udp_length(k)) for code, k in wire.WIDTHS.items()}
_VERSION, _FLAGS, _JOB, _SLOT, _POOL, _RANK, _EXP, _WIDTH, _ROUND, _MEMBERS, _EXCHANGE = (
    _N["version"], _N["flags"], _N["job_id"], _N["slot"], _N["pool"], _N["rank"], _N["exponent"], _N["width"],
    _N["round"], _N["members"], _N["exchange"],
)


def _register_sizes(p4info: p4info_pb2.P4Info) -> dict[str, int]:
    return {r.preamble.name: r.size for r in p4info.registers}


@dataclass(slots=True)
class _Meta:
    """metadata_t: the fields the ingress decisions need."""

    drop_reason: int = DropReason.NONE
    num_workers: int = 0
    slot_base: int = 0
    slot_count: int = 0
    mgid: int = 0
    generation: int = 0
    width: int = 0  # the job's width code
    down: bool = False  # a parent's result for the local job down_job (DownLink)
    down_job: int = 0
    rank: int = 0
    worker_mask: int = 0
    slot_index: int = 0
    pool_index: int = 0
    to_group: bool = False


class NetaggPipeline:
    """The netagg program on one software switch: ``process(frame, port) -> [(port, frame)]``."""

    def __init__(self, state: ForwardingState, p4info: p4info_pb2.P4Info) -> None:
        self.state = state
        sizes = _register_sizes(p4info)
        # Registers (SlotOwner, BitmapCheck, WorkerCount, ExponentMax, ValueSum).
        self.registers = SlotRegisters(sizes[dp.REGISTER_SLOT_OWNER])
        if sizes["NetaggIngress.worker_count.worker_count"] != self.registers.num_slots * wire.NUM_POOLS:
            raise ValueError("the P4Info's per-pool registers are not NUM_POOLS x the slot registers")
        self._jobs = state.table(dp.TABLE_JOBS)
        self._workers = state.table(dp.TABLE_WORKERS)
        self._routes = state.table(dp.TABLE_ROUTES)
        self._replicas = state.table(dp.TABLE_REPLICAS)
        self._sources = state.table(dp.TABLE_SOURCES)
        self._up_links = state.table(dp.TABLE_UP_LINKS)
        self._down_links = state.table(dp.TABLE_DOWN_LINKS)

    # -- top level ---------------------------------------------------------
    def process(self, frame: bytes, ingress_port: int) -> list[tuple[int, bytes]]:
        """Run one packet through the whole pipeline; returns the packets it emits."""
        with self.state.lock:
            if not self.state.configured:  # like BMv2 --no-p4 before a pipeline is pushed
                return []
            pkt = parse(frame)
            meta = _Meta()
            egress_spec = self._ingress(pkt, meta, ingress_port, len(frame))
            if egress_spec is None:
                return []
            if meta.to_group:
                return self._replicate(pkt, meta)
            if egress_spec == dp.DROP_PORT:
                return []
            return [(egress_spec, deparse(pkt))]

    def reset_registers(self) -> None:
        """Power-on state (registers are not writable over P4Runtime)."""
        self.registers.reset()

    # -- ingress -----------------------------------------------------------
    def _ingress(self, pkt: ParsedPacket, meta: _Meta, ingress_port: int, length: int) -> int | None:
        """NetaggIngress.apply; returns egress_spec, or None when the packet is dropped."""
        egress_spec = 0
        if pkt.parser_error:
            meta.drop_reason = DropReason.MALFORMED
        elif pkt.ipv4 is None:
            meta.drop_reason = DropReason.NOT_IPV4
        else:
            if pkt.netagg is not None and pkt.netagg[_FLAGS] & wire.FLAG_RESULT:
                self._down_link(pkt, meta, ingress_port)
            if not meta.down:
                self._source_guard(pkt, meta, ingress_port)
        if meta.drop_reason != DropReason.NONE:
            pass  # counted below
        elif pkt.netagg is None:
            egress_spec = self._ipv4_forward(pkt, meta)
        elif pkt.netagg[_VERSION] != wire.VERSION:
            meta.drop_reason = DropReason.BAD_VERSION
        elif (
            _LENGTHS.get(pkt.netagg[_WIDTH]) != (pkt.ipv4[2], pkt.udp[2])
            or pkt.ipv4[4] & (_MF_BIT | _FRAG_OFFSET_MASK)
        ):
            meta.drop_reason = DropReason.MALFORMED
        elif pkt.netagg[_FLAGS] & wire.FLAG_RESULT and not meta.down:
            meta.drop_reason = DropReason.RESULT_FROM_HOST
        else:
            return self._aggregate(pkt, meta, ingress_port, length)
        if meta.drop_reason != DropReason.NONE:
            self.state.count(dp.COUNTER_DROP_REASONS, meta.drop_reason, length)
            return None
        return egress_spec

    def _source_guard(self, pkt: ParsedPacket, meta: _Meta, ingress_port: int) -> None:
        """SourceGuard: no host sends from the netagg port, the aggregator address or another host's address."""
        if pkt.udp is not None and pkt.udp[0] == wire.NETAGG_UDP_PORT:
            meta.drop_reason = DropReason.SPOOFED_SOURCE
            return
        action, params = self._sources.lookup((int.from_bytes(pkt.ipv4[8], "big"),))
        if action == dp.ACTION_SWITCH_ONLY or (action == dp.ACTION_BIND_TO_PORT and params[0] != ingress_port):
            meta.drop_reason = DropReason.SPOOFED_SOURCE

    def _down_link(self, pkt: ParsedPacket, meta: _Meta, ingress_port: int) -> None:
        """DownLink: a RESULT from the parent's address on the up port is the parent's result for a local job."""
        action, params = self._down_links.lookup((ingress_port, int.from_bytes(pkt.ipv4[8], "big"),
                                                  pkt.netagg[_JOB]))
        if action == dp.ACTION_SET_DOWN_LINK:
            meta.down, meta.down_job = True, params[0]

    def _ipv4_forward(self, pkt: ParsedPacket, meta: _Meta) -> int:
        """Ipv4Forward: LPM on the destination, TTL decrement without options."""
        ip = pkt.ipv4
        if ip[5] <= 1:
            meta.drop_reason = DropReason.TTL_EXPIRED
            return 0
        action, params = self._routes.lookup((int.from_bytes(ip[9], "big"),))
        if action != dp.ACTION_FORWARD:
            meta.drop_reason = DropReason.NO_ROUTE
            return 0
        port, dst_mac = params
        pkt.eth[1] = pkt.eth[0]
        pkt.eth[0] = dst_mac.to_bytes(6, "big")
        if ip[0] & 0x0F == 5:
            ip[5] -= 1
        return port

    def _worker_lookup(self, pkt: ParsedPacket, meta: _Meta, ingress_port: int) -> None:
        """WorkerLookup: jobs, workers (keyed by the ingress port too), then the slot/pool/rank/member checks."""
        hdr = pkt.netagg
        action, params = self._jobs.lookup((hdr[_JOB],))
        if action != dp.ACTION_SET_JOB:
            meta.drop_reason = DropReason.UNKNOWN_JOB
            return
        meta.num_workers, meta.slot_base, meta.slot_count, meta.mgid, meta.generation, meta.width = params
        if not meta.down:  # a parent's result has no sender to look up or check
            src_addr = int.from_bytes(pkt.ipv4[8], "big")
            action, params = self._workers.lookup((hdr[_JOB], src_addr, pkt.udp[0], ingress_port))
            if action != dp.ACTION_SET_WORKER:
                meta.drop_reason = DropReason.UNKNOWN_WORKER
                return
            meta.rank, meta.worker_mask = params
        if hdr[_WIDTH] != meta.width:
            meta.drop_reason = DropReason.WRONG_WIDTH
        elif hdr[_SLOT] >= meta.slot_count:
            meta.drop_reason = DropReason.SLOT_OUT_OF_RANGE
        elif hdr[_POOL] >= wire.NUM_POOLS:
            meta.drop_reason = DropReason.BAD_POOL
        elif not meta.down and hdr[_RANK] != meta.rank:
            meta.drop_reason = DropReason.RANK_MISMATCH
        elif not meta.down and hdr[_MEMBERS] and not hdr[_MEMBERS] & meta.worker_mask:
            meta.drop_reason = DropReason.NOT_A_MEMBER
        else:
            meta.slot_index = (meta.slot_base + (hdr[_SLOT] << (2 * meta.width))) & 0xFFFFFFFF
            meta.pool_index = ((meta.slot_index << 1) + hdr[_POOL]) & 0xFFFFFFFF

    def _aggregate(self, pkt: ParsedPacket, meta: _Meta, ingress_port: int, length: int) -> int | None:
        """WorkerLookup, then the slot registers (SlotOwner .. ValueSum, LevelState), the job counters and the
        delivery: to the group or the sender (ResultDelivery), or up to the parent switch (UpDelivery)."""
        hdr = pkt.netagg
        if meta.down:
            hdr[_JOB] = meta.down_job  # from here on a packet of the local job
        job = hdr[_JOB]
        self._worker_lookup(pkt, meta, ingress_port)
        if meta.drop_reason == DropReason.NONE:
            regs = self.registers
            if meta.slot_index + pkt.values.size // wire.K > regs.num_slots:
                # The controller never installs such a range; BMv2 leaves it undefined.
                return None
            ce = pkt.ipv4[1] & wire.ECN_MASK == wire.ECN_CE  # RoundFlags keeps it as ROUND_CE
            if meta.down:
                verdict = regs.accept_down(meta.slot_index, hdr[_POOL], hdr[_ROUND], meta.generation, hdr[_EXP],
                                           pkt.values, hdr[_FLAGS], ce=ce)
                up = None
            else:
                action, up = self._up_links.lookup((job,))
                up = up if action == dp.ACTION_SET_UP_LINK else None
                verdict = regs.aggregate(meta.slot_index, hdr[_POOL], hdr[_ROUND], meta.worker_mask,
                                         meta.num_workers, meta.generation, hdr[_MEMBERS], hdr[_EXP], pkt.values,
                                         has_up=up is not None, flags=hdr[_FLAGS], exchange=hdr[_EXCHANGE], ce=ce)
            meta.drop_reason = verdict.drop
        if meta.drop_reason != DropReason.NONE:
            if meta.drop_reason != DropReason.UNKNOWN_JOB:
                self.state.count(dp.COUNTER_JOB_REJECTS, job, length)
            self.state.count(dp.COUNTER_DROP_REASONS, meta.drop_reason, length)
            return None
        if verdict.exchange_mismatch:  # not added, but it still counts towards completion (RoundFlags)
            self.state.count(dp.COUNTER_JOB_REJECTS, job, length)
            self.state.count(dp.COUNTER_DROP_REASONS, DropReason.EXCHANGE_MISMATCH, length)
        if verdict.late_for_close:  # its values are not added; it gets the closed round's result
            self.state.count(dp.COUNTER_DROP_REASONS, DropReason.LATE_FOR_CLOSED_ROUND, length)
        for name in verdict.counts:
            self.state.count(dp.JOB_COUNTERS[name], job, length)
        hdr[_EXP], pkt.values = verdict.exponent, verdict.values
        if verdict.delivery == Delivery.NONE:
            return None
        if verdict.round_flags & wire.ROUND_CE:  # some contribution to the round arrived CE-marked
            pkt.ipv4[1] |= wire.ECN_CE
        if verdict.delivery == Delivery.UP:
            return self._up_delivery(pkt, up, verdict.resend, verdict.round_flags)
        hdr[_FLAGS] = (hdr[_FLAGS] & ~wire.STORED_FLAGS) | (verdict.round_flags & wire.STORED_FLAGS)
        if verdict.members is not None:  # a closed round: who is in its sum
            hdr[_MEMBERS] = verdict.members
        meta.to_group = verdict.delivery == Delivery.GROUP
        return self._result_delivery(pkt, meta, ingress_port)

    @staticmethod
    def _up_delivery(pkt: ParsedPacket, up: tuple[int, ...], resend: bool, round_flags: int) -> int:
        """UpDelivery: the partial as a contribution to the parent switch, out of the up port."""
        port, parent_job, parent_rank, parent_mac, parent_addr = up
        eth, ip, udp, hdr = pkt.eth, pkt.ipv4, pkt.udp, pkt.netagg
        eth[1] = eth[0]
        eth[0] = parent_mac.to_bytes(6, "big")
        ip[8] = ip[9]
        ip[9] = parent_addr.to_bytes(4, "big")
        ip[5] = 64
        udp[0] = wire.NETAGG_TREE_UDP_PORT
        udp[1] = wire.NETAGG_UDP_PORT
        udp[3] = 0
        hdr[_JOB], hdr[_RANK], hdr[_MEMBERS] = parent_job, parent_rank, 0
        hdr[_FLAGS] = (wire.FLAG_RETRANSMIT if resend else 0) | (round_flags & wire.ROUND_FLAGS)
        return port

    def _result_delivery(self, pkt: ParsedPacket, meta: _Meta, ingress_port: int) -> int:
        """ResultDelivery: a RESULT from the aggregator address, to the group or the sender."""
        eth, ip, udp, hdr = pkt.eth, pkt.ipv4, pkt.udp, pkt.netagg
        sender_mac, sender_addr, sender_port = eth[1], ip[8], udp[0]
        eth[1] = eth[0]
        ip[8] = ip[9]
        udp[0] = wire.NETAGG_UDP_PORT
        ip[5] = 64
        udp[3] = 0
        hdr[_FLAGS] |= wire.FLAG_RESULT
        if meta.to_group:
            return 0
        eth[0] = sender_mac
        ip[9] = sender_addr
        udp[1] = sender_port
        return ingress_port

    # -- replication and egress ---------------------------------------------
    def _replicate(self, pkt: ParsedPacket, meta: _Meta) -> list[tuple[int, bytes]]:
        """The PRE copies the packet per replica; NetaggEgress rewrites each copy."""
        replicas = self.state.multicast.get(meta.mgid)
        if not replicas:
            return []
        out = []
        for port, rid in replicas:
            action, params = self._replicas.lookup((meta.mgid, rid))
            if action != dp.ACTION_SET_DESTINATION:
                self.state.count(dp.COUNTER_EGRESS_DROP_REASONS, DropReason.NO_REPLICA, 0)
                continue
            dst_mac, dst_addr, dst_port = params
            pkt.eth[0] = dst_mac.to_bytes(6, "big")
            pkt.ipv4[9] = dst_addr.to_bytes(4, "big")
            pkt.udp[1] = dst_port
            out.append((port, deparse(pkt)))
        return out
