/* netagg: the wire headers, shared by the v1model and TNA programs. netagg_h mirrors
 * netagg/wire.py HEADER_FIELDS. */
#ifndef _NETAGG_HEADERS_P4_
#define _NETAGG_HEADERS_P4_

#include "defines.p4"

header ethernet_h {
    mac_addr_t dst_addr;
    mac_addr_t src_addr;
    bit<16> ether_type;
}

header ipv4_h {
    bit<4> version;
    bit<4> ihl;
    bit<8> diffserv;
    bit<16> total_len;
    bit<16> identification;
    bit<3> flags;
    bit<13> frag_offset;
    bit<8> ttl;
    bit<8> protocol;
    bit<16> hdr_checksum;
    ipv4_addr_t src_addr;
    ipv4_addr_t dst_addr;
}

header udp_h {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> length;
    bit<16> checksum;
}

/* 24 bytes, see docs/protocol.md. */
header netagg_h {
    bit<8> version;
    bit<8> flags;
    bit<16> job_id;
    bit<16> slot;
    bit<8> pool;
    bit<8> rank;
    int<8> exponent;
    bit<8> width;      /* values per packet: NETAGG_WIDTH (64) or NETAGG_WIDTH_WIDE (256); any other code is MALFORMED */
    bit<16> round;
    bit<32> seq;
    bit<32> members;   /* a subset round's expected contributors; 0 = the whole job */
    bit<32> exchange;  /* the collective the packet belongs to; the round's first packet fixes it */
}

#define VALUE_FIELD(i) bit<32> v##i;
/* NETAGG_K signed 32-bit values (two's complement; addition is modular): one cell's worth. */
header values_h {
    FOR_EACH_VALUE(VALUE_FIELD)
}

/* A narrow packet carries values (chunk 0); a wide one (width NETAGG_WIDTH_WIDE) carries
 * NETAGG_WIDE_CELLS chunks: values, values1, values2, values3 (values 64c .. 64c + 63 in chunk c). */
struct headers_t {
    ethernet_h ethernet;
    ipv4_h ipv4;
    udp_h udp;
    netagg_h netagg;
    values_h values;
    values_h values1;
    values_h values2;
    values_h values3;
}

#endif
