/* netagg: TNA parsers and deparsers. The ingress parser reads the same headers as the
 * v1model parser (netagg iff IPv4 without options, UDP, to NETAGG_UDP_PORT or
 * NETAGG_TREE_UDP_PORT: a parent switch's results, tree_links.p4), plus the recirc header of
 * a recirculated pass, which only the recirculation port carries. Only the first 64 values are
 * extracted: a wide packet keeps its other 192 as payload, and its later passes extract one chunk
 * each (or, a wide result's read passes, none; docs/tofino.md "Wide packets").
 * The egress parser reads the bridge header and, for a group copy, the headers the
 * egress rewrites; the rest of the packet passes through as payload. */
#ifndef _NETAGG_TNA_PARSER_P4_
#define _NETAGG_TNA_PARSER_P4_

#include "tna/headers.p4"

parser NetaggIngressParser(packet_in packet,
                           out tna_headers_t hdr,
                           out ingress_metadata_t meta,
                           out ingress_intrinsic_metadata_t ig_intr_md) {
    state start {
        /* Every metadata field starts at zero (TNA leaves them undefined otherwise). */
        meta.drop_reason = 0;
        meta.source_bound = 0;
        meta.bound_port = 0;
        meta.spoof_address = 0;
        meta.spoof_port = 0;
        meta.job_hit = 0;
        meta.num_workers = 0;
        meta.generation = 0;
        meta.job_width = 0;
        meta.worker_hit = 0;
        meta.rank = 0;
        meta.worker_mask = 0;
        meta.slot_room = 0;
        meta.slot_out_of_range = 0;
        meta.wrong_width = 0;
        meta.rank_mismatch = 0;
        meta.not_member = 0;
        meta.stale = 0;
        meta.round_ahead = 0;
        meta.bitmap_before = 0;
        meta.sender_seen = 0;
        meta.first = 0;
        meta.fresh = 0;
        meta.count_before = 0;
        meta.complete = 0;
        meta.late = 0;
        meta.bad_shape = 0;
        meta.exponent_key = 0;
        meta.update_checksum = 0;
        meta.reject = 0;
        meta.member_byte_0 = 0;
        meta.member_byte_1 = 0;
        meta.member_byte_2 = 0;
        meta.member_byte_3 = 0;
        meta.expected = 0;
        meta.exchange_mismatch = 0;
        meta.flags_keep = 0;
        meta.flags_round = 0;
        meta.flags_in = 0;
        meta.flags_out = 0;
        meta.down = 0;
        meta.has_up = 0;
        meta.up_port = 0;
        meta.up_job = 0;
        meta.up_rank = 0;
        meta.up_mac = 0;
        meta.up_addr = 0;
        meta.level = 0;
        meta.wide_whole = 0;
        packet.extract(ig_intr_md);
        /* A resubmitted packet's resubmit data (none here) takes the port metadata's 64 bits. */
        packet.advance(PORT_METADATA_SIZE);
        transition select(ig_intr_md.resubmit_flag, ig_intr_md.ingress_port[6:0]) {
            (0, RECIRC_PORT_LOCAL): parse_recirc;
            default: parse_ethernet;
        }
    }

    /* A pass after the first: pass 1 rewrote the UDP ports, so nothing is selected on them. */
    state parse_recirc {
        packet.extract(hdr.recirc);
        transition select(hdr.recirc.step) {
            WIDE_STEP_READ_FIRST &&& WIDE_STEP_READ_FIRST: parse_recirc_read;
            default: parse_recirc_values;
        }
    }

    /* A narrow packet, or a wide one's next chunk (the chunks before it were left out). */
    state parse_recirc_values {
        packet.extract(hdr.ethernet);
        packet.extract(hdr.ipv4);
        packet.extract(hdr.udp);
        packet.extract(hdr.netagg);
        transition parse_values;
    }

    /* A wide result's read pass: the halves read so far stay payload, behind the one this pass reads. */
    state parse_recirc_read {
        packet.extract(hdr.ethernet);
        packet.extract(hdr.ipv4);
        packet.extract(hdr.udp);
        packet.extract(hdr.netagg);
        transition accept;
    }

    state parse_ethernet {
        packet.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }

    state parse_ipv4 {
        packet.extract(hdr.ipv4);
        transition select(hdr.ipv4.ihl, hdr.ipv4.protocol) {
            (5, IPPROTO_UDP): parse_udp;
            default: accept;
        }
    }

    state parse_udp {
        packet.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            NETAGG_UDP_PORT: parse_netagg;
            NETAGG_TREE_UDP_PORT: parse_netagg;
            default: accept;
        }
    }

    state parse_netagg {
        packet.extract(hdr.netagg);
        transition select(ig_intr_md.resubmit_flag, hdr.netagg.width) {
            (0, NETAGG_WIDTH_WIDE): probe_wide;
            default: parse_values;
        }
    }

    /* A wide packet as it arrives: pass 1 extracts 64 of its 256 values, so whether the rest is there
     * would show only in a later pass, after its slot counted it. Here the parser reads its last value
     * (a shorter packet is a parser error: MALFORMED in the checks, before anything changes) and the
     * ingress resubmits it; the original packet comes back as it arrived, with resubmit_flag set, and
     * that pass is its pass 1 (docs/tofino.md, "Wide packets"). */
    state probe_wide {
        packet.advance(WIDE_PROBE_SKIP_BITS);
        packet.extract(hdr.wide_last);
        meta.wide_whole = 1;
        transition accept;
    }

    /* One cell's values, as the value pairs' low and high words (tna/headers.p4). */
    state parse_values {
        packet.extract(hdr.values_lo);
        packet.extract(hdr.values_hi);
        transition accept;
    }
}

control NetaggIngressDeparser(packet_out packet,
                              inout tna_headers_t hdr,
                              in ingress_metadata_t meta,
                              in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    Checksum() ipv4_checksum;
    Resubmit((ResubmitType_t)RESUBMIT_WIDE) resubmit;

    apply {
        if (ig_dprsr_md.resubmit_type == RESUBMIT_WIDE) {
            resubmit.emit();
        }
        if (meta.update_checksum == 1) {
            hdr.ipv4.hdr_checksum = ipv4_checksum.update({
                hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
                hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset,
                hdr.ipv4.ttl, hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr});
        }
        packet.emit(hdr);
    }
}

parser NetaggEgressParser(packet_in packet,
                          out tna_headers_t hdr,
                          out egress_metadata_t meta,
                          out egress_intrinsic_metadata_t eg_intr_md) {
    state start {
        meta.drop_reason = 0;
        packet.extract(eg_intr_md);
        packet.extract(hdr.bridge);
        transition select(hdr.bridge.to_group) {
            0: accept;
            default: parse_ethernet;
        }
    }

    state parse_ethernet {
        packet.extract(hdr.ethernet);
        packet.extract(hdr.ipv4);
        packet.extract(hdr.udp);
        transition accept;
    }
}

control NetaggEgressDeparser(packet_out packet,
                             inout tna_headers_t hdr,
                             in egress_metadata_t meta,
                             in egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
    Checksum() ipv4_checksum;

    apply {
        if (hdr.ipv4.isValid()) {
            hdr.ipv4.hdr_checksum = ipv4_checksum.update({
                hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
                hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset,
                hdr.ipv4.ttl, hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr});
        }
        packet.emit(hdr.ethernet);
        packet.emit(hdr.ipv4);
        packet.emit(hdr.udp);
    }
}

#endif
