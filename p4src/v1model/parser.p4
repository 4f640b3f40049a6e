/* netagg: parser and deparser. A packet is netagg iff it is IPv4 without
 * options, UDP, to NETAGG_UDP_PORT (or NETAGG_TREE_UDP_PORT: a parent switch's results, tree_links.p4).
 * A wide packet (width NETAGG_WIDTH_WIDE) carries three more value chunks after the first
 * (values1..3). A truncated one ends with a parser error, which ingress drops and counts as
 * malformed; so does a wide header on a narrow packet's 64 values. */
#ifndef _NETAGG_PARSER_P4_
#define _NETAGG_PARSER_P4_

#include "v1model/metadata.p4"

parser NetaggParser(packet_in packet,
                    out headers_t hdr,
                    inout metadata_t meta,
                    inout standard_metadata_t standard_metadata) {
    state start {
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
        packet.extract(hdr.values);
        transition select(hdr.netagg.width) {
            NETAGG_WIDTH_WIDE: parse_wide;
            default: accept;
        }
    }

    state parse_wide {
        packet.extract(hdr.values1);
        packet.extract(hdr.values2);
        packet.extract(hdr.values3);
        transition accept;
    }
}

control NetaggDeparser(packet_out packet, in headers_t hdr) {
    apply {
        packet.emit(hdr.ethernet);
        packet.emit(hdr.ipv4);
        packet.emit(hdr.udp);
        packet.emit(hdr.netagg);
        packet.emit(hdr.values);
        packet.emit(hdr.values1);
        packet.emit(hdr.values2);
        packet.emit(hdr.values3);
    }
}

#endif
