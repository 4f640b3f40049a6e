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

/* Between passes, in front of the Ethernet header on the recirculation port: what the value
 * pairs do in the next pass, and where the packet goes after it. */
header recirc_h {
    bit<16> value_op;     /* OP_WRITE / OP_MERGE / OP_READ (pass 2), OP_READ_HI (pass 3) */
    bit<16> deliver;      /* DELIVER_*: absorbed, to the job's group, back to the sender, or up */
    bit<16> mgid;
    bit<16> port;         /* the sender's port, or (DELIVER_UP*) the up port */
    bit<16> reg_index;    /* the value pairs' index: pool * NUM_SLOTS + cell (pass 1: the slot's cell) */
    bit<16> stride;       /* the job's slot count: a wide slot's chunk c is at cell + c * stride */
    bit<8> step;          /* 0: narrow; a wide packet's pass (WIDE_STEP_*, tna/defines.p4) */
}

/* The register indexes, from pass 1's WorkerLookup on (a header field: no copy in later passes). */
#define POOL_INDEX hdr.recirc.reg_index[12:0]
#define SLOT_INDEX hdr.recirc.reg_index[11:0]

/* One cell's values (shared/headers.p4's values_h) as the value pairs' two halves: the pairs' low
 * words v00 .. v31, then their high words v32 .. v63 (FOR_EACH_PAIR), the same 256 bytes in the
 * same order. Two headers so that a wide result's read passes can put one half in front of the
 * halves read before (docs/tofino.md, "Wide packets"). */
#define LOW_VALUE_FIELD(i, j) bit<32> v##i;
#define HIGH_VALUE_FIELD(i, j) bit<32> v##j;
header values_lo_h {
    FOR_EACH_PAIR(LOW_VALUE_FIELD)
}
header values_hi_h {
    FOR_EACH_PAIR(HIGH_VALUE_FIELD)
}

/* A wide packet's last value, read where the parser checks that the packet is whole. */
header wide_last_h {
    bit<32> value;
}

/* One container per field of the two internal headers: each is written from one source. */
@pa_container_size("ingress", "hdr.recirc.value_op", 16)
@pa_container_size("ingress", "hdr.recirc.deliver", 16)
@pa_container_size("ingress", "hdr.recirc.mgid", 16)
@pa_container_size("ingress", "hdr.recirc.port", 16)
@pa_container_size("ingress", "hdr.recirc.reg_index", 16)
@pa_container_size("ingress", "hdr.recirc.stride", 16)
@pa_container_size("ingress", "hdr.bridge.to_group", 16)
@pa_container_size("ingress", "hdr.bridge.mgid", 16)
struct tna_headers_t {
    bridge_h bridge;
    recirc_h recirc;
    ethernet_h ethernet;
    ipv4_h ipv4;
    udp_h udp;
    netagg_h netagg;
    values_lo_h values_lo;
    values_hi_h values_hi;
    wide_last_h wide_last;
}

struct ingress_metadata_t {
    bit<8> drop_reason;
    /* From the sources table (SourceGuard). */
    bit<1> source_bound;
    port_t bound_port;
    bit<1> spoof_address;      /* the aggregator's own address as a source */
    bit<1> spoof_port;         /* a bound address from another port */
    /* From the job table. */
    bit<1> job_hit;
    bit<8> num_workers;
    bit<32> generation;
    bit<8> job_width;          /* the job's width code */
    /* From the worker table. */
    bit<1> worker_hit;
    bit<8> rank;
    worker_mask_t worker_mask;
    /* Derived per packet. */
    bit<16> slot_room;         /* slot_count - slot: positive iff the slot is in range (slot < NUM_SLOTS) */
    bit<1> slot_out_of_range;
    bit<1> wrong_width;        /* a width other than the job's, or wide (not aggregated here) */
    bit<1> rank_mismatch;
    bit<1> not_member;         /* a subset round's packet from a worker outside its members */
    bit<1> stale;
    bit<16> round_ahead;       /* round - round_current (serial arithmetic) */
    worker_mask_t bitmap_before;   /* the round's bitmap before this packet; 0: other members */
    worker_mask_t sender_seen;     /* bitmap_before & worker_mask (until then, WorkerLookup's members & worker_mask) */
    bit<1> first;
    bit<1> fresh;
    bit<8> count_before;
    bit<1> complete;
    bit<1> late;
    bit<1> bad_shape;          /* an undefined width code, lengths other than the width's, or a fragment */
    bit<8> exponent_key;       /* exponent ^ 0x80: signed order as unsigned order */
    bit<1> update_checksum;
    bit<1> reject;             /* counted in job_rejects */
    /* MemberCount: set bits of each byte of members (0 and 2 end up holding sums). */
    bit<8> member_byte_0;
    bit<8> member_byte_1;
    bit<8> member_byte_2;
    bit<8> member_byte_3;
    bit<8> expected;          /* contributions the round expects: num_workers, or the members' number */
    /* The round flags (ExchangeCheck, RoundFlags). */
    bit<1> exchange_mismatch;  /* the packet names another collective than its round */
    bit<8> flags_keep;         /* flags & ~ROUND_FLAGS, copied by slices in stage 0 */
    bit<8> flags_round;        /* flags & ROUND_FLAGS, copied by slice, | ROUND_CE when CE-marked (stage 0) */
    bit<8> flags_in;           /* what the packet ORs into round_flags */
    bit<8> flags_out;          /* what round_flags' old value is ORed with to make the packet's flags */
    /* A tree of switches (tree_links.p4). */
    bit<1> down;               /* a parent's result (its job id rewritten to the local job's) */
    bit<1> has_up;             /* the job's up link, from up_links */
    bit<16> up_port;           /* port_t, zero-extended: a whole-container copy into the recirc header */
    bit<16> up_job;
    bit<8> up_rank;
    mac_addr_t up_mac;
    ipv4_addr_t up_addr;
    bit<8> level;              /* LEVEL_* the packet found, where LevelState returns it (see there) */
    bit<1> wide_whole;         /* a wide packet's first arrival, whole: resubmitted (the parser's probe_wide) */
}

struct egress_metadata_t {
    bit<8> drop_reason;
}

#endif
