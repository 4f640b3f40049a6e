/* netagg: per-packet metadata of the v1model program. */
#ifndef _NETAGG_METADATA_P4_
#define _NETAGG_METADATA_P4_

#include "shared/headers.p4"

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
    bit<8> width;              /* the job's width code: NETAGG_WIDTH or NETAGG_WIDTH_WIDE */
    /* From the worker table. */
    bit<8> rank;
    worker_mask_t worker_mask;
    /* Derived per packet. */
    slot_index_t slot_index;   /* the slot's first cell: slot_base + slot * cells of the job's width */
    slot_index_t pool_index;   /* slot_index * NUM_POOLS + pool; value chunk c at pool_index + NUM_POOLS * c */
    bit<1> stale;              /* slot last used by another job */
    bit<2> round_state;        /* ROUND_NEW / ROUND_SAME / ROUND_OLD */
    worker_mask_t bitmap_before;
    bit<1> first;              /* first contribution of the round */
    bit<1> fresh;              /* this worker's first packet of the round */
    bit<8> count_before;       /* contributions still missing before this one */
    bit<1> complete;           /* the round is (now) complete */
    bit<1> late;               /* contribution to a round that already completed */
    bit<1> exchange_mismatch;  /* the packet names another collective than its round (ExchangeCheck) */
    bit<8> stored_flags;       /* the round's stored flags as the packet found them (CloseCheck) */
    bit<1> closed;             /* the round was closed at a deadline before this packet (CloseCheck) */
    bit<1> closes;             /* this packet's close request completes the round (WorkerCount) */
    /* 1 while CloseCheck runs: RoundFlags and BitmapCheck only read. A field, not a constant argument
     * of the two controls: p4c-bm2-ss copies meta (and hdr) around a control applied twice with
     * constant in-arguments, into header instances whose fields BMv2 cannot resolve. */
    bit<1> close_check;
    bit<8> value_op;
    bit<1> to_group;           /* deliver the result to the job's multicast group */
    /* A tree of switches (tree_links.p4). */
    bit<1> down;               /* a parent's result, for the local job down_job */
    bit<16> down_job;
    bit<1> has_up;             /* the job's up link, from up_links */
    port_t up_port;
    bit<16> up_job;
    bit<8> up_rank;
    mac_addr_t up_mac;
    ipv4_addr_t up_addr;
    bit<8> level;              /* LEVEL_* of the round, as the packet found it */
    bit<1> down_accepted;      /* the parent's result was stored (the round was UP) */
    bit<1> to_up;              /* send the partial to the parent */
}

#endif
