/* netagg: packet headers and metadata. netagg_h mirrors netagg/wire.py HEADER_FIELDS. */
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

/* 16 bytes, see docs/protocol.md. */
header netagg_h {
    bit<8> version;
    bit<8> flags;
    bit<16> job_id;
    bit<16> slot;
    bit<8> pool;
    bit<8> rank;
    int<8> exponent;
    bit<8> reserved0;
    bit<16> round;
    bit<32> seq;
}

#define VALUE_FIELD(i) bit<32> v##i;
/* NETAGG_K signed 32-bit values (two's complement; addition is modular). */
header values_h {
    FOR_EACH_VALUE(VALUE_FIELD)
}

struct headers_t {
    ethernet_h ethernet;
    ipv4_h ipv4;
    udp_h udp;
    netagg_h netagg;
    values_h values;
}

struct metadata_t {
    bit<8> drop_reason;
    /* From the sources table (SourceGuard). */
    bit<1> source_bound;
    port_t bound_port;
    /* From the job table. */
    bit<8> num_workers;
    slot_index_t slot_base;
    bit<16> slot_count;
    bit<16> mgid;
    bit<32> generation;
    /* From the worker table. */
    bit<8> rank;
    worker_mask_t worker_mask;
    /* Derived per packet. */
    slot_index_t slot_index;   /* absolute slot */
    slot_index_t pool_index;   /* absolute slot * NUM_POOLS + pool */
    bit<1> stale;              /* slot last used by another job */
    bit<2> round_state;        /* ROUND_NEW / ROUND_SAME / ROUND_OLD */
    worker_mask_t bitmap_before;
    bit<1> first;              /* first contribution of the round */
    bit<1> fresh;              /* this worker's first packet of the round */
    bit<8> count_before;       /* contributions still missing before this one */
    bit<1> complete;           /* the round is (now) complete */
    bit<1> late;               /* contribution to a round that already completed */
    bit<8> value_op;
    bit<1> to_group;           /* deliver the result to the job's multicast group */
}

#endif
