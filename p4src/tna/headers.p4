/* netagg: the TNA program's own headers and metadata. The wire headers are shared
 * (shared/headers.p4); these two never leave the switch. */
#ifndef _NETAGG_TNA_HEADERS_P4_
#define _NETAGG_TNA_HEADERS_P4_

#include "shared/headers.p4"
#include "tna/defines.p4"

/* Ingress -> egress, in front of every packet: is this a copy for a job's group?
 * (Fields are container-sized so that each is written from one source.) */
header bridge_h {
    bit<16> to_group;
    bit<16> mgid;
}

/* Pass 1 -> pass 2 of a result, in front of the Ethernet header on the recirculation
 * port: where the result goes once the high halves are read. */
header recirc_h {
    bit<16> to_group;
    bit<16> mgid;
    bit<16> port;         /* the sender's port (a resent result goes back there) */
    bit<16> slot_index;   /* absolute slot */
    bit<16> pool;
}

/* One container per field of the two internal headers: each is written from one source. */
@pa_container_size("ingress", "hdr.recirc.to_group", 16)
@pa_container_size("ingress", "hdr.recirc.mgid", 16)
@pa_container_size("ingress", "hdr.recirc.port", 16)
@pa_container_size("ingress", "hdr.recirc.slot_index", 16)
@pa_container_size("ingress", "hdr.recirc.pool", 16)
@pa_container_size("ingress", "hdr.bridge.to_group", 16)
@pa_container_size("ingress", "hdr.bridge.mgid", 16)
struct tna_headers_t {
    bridge_h bridge;
    recirc_h recirc;
    ethernet_h ethernet;
    ipv4_h ipv4;
    udp_h udp;
    netagg_h netagg;
    values_h values;
}

struct ingress_metadata_t {
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
    bit<16> slot_room;         /* slot_count - slot: positive iff the slot is in range (slot < NUM_SLOTS) */
    bit<16> slot_index;            /* absolute slot: slot_base + slot */
    pool_reg_index_t pool_index;   /* pool * NUM_SLOTS + absolute slot (TNA layout) */
    bit<1> stale;
    bit<16> round_ahead;       /* round - round_current (serial arithmetic) */
    bit<16> round_behind;      /* round - 1: the other pool's round when a slot is taken over */
    bit<2> round_state;
    worker_mask_t sender_seen;     /* bitmap_before & worker_mask */
    bit<1> first;
    bit<1> fresh;
    bit<8> count_before;
    bit<1> complete;
    bit<1> late;
    bit<1> bad_shape;          /* lengths or fragment bits wrong for a netagg packet */
    bit<8> value_op;
    bit<8> exponent_key;       /* exponent ^ 0x80: signed order as unsigned order */
    bit<1> to_group;
    bit<1> recirculate;        /* the result needs pass 2 (the high halves) */
    bit<1> update_checksum;
}

struct egress_metadata_t {
    bit<8> drop_reason;
}

#endif
