/* netagg: every number the program depends on, in one place.
 * Mirrors netagg/wire.py; tests/test_wire_p4_agreement.py checks both agree. */
#ifndef _NETAGG_DEFINES_P4_
#define _NETAGG_DEFINES_P4_

#define NETAGG_VERSION 4
#define NETAGG_UDP_PORT 28900
/* A tree of switches: up packets leave from it, the parent's results come back to it (docs/hierarchy.md). */
#define NETAGG_TREE_UDP_PORT 28901
/* Values per narrow packet and per cell (the unit of value registers). FOR_EACH_VALUE below must
 * list exactly NETAGG_K indices. A wide packet carries NETAGG_WIDE_K values: NETAGG_WIDE_CELLS cells,
 * consecutive in the job's range (docs/protocol.md, "Wide packets"). */
#define NETAGG_K 64
#define NETAGG_WIDE_K 256
#define NETAGG_WIDE_CELLS 4
#define MAX_WORKERS 32
/* Aggregation slots per pool; every slot has NUM_POOLS shadow copies. */
#define NUM_SLOTS 4096
#define NUM_POOLS 2
#define NUM_POOL_SLOTS 8192
/* Job ids index the per-job counters: 1 .. MAX_JOBS-1 (0 is never a job). */
#define MAX_JOBS 1024

#define JOB_TABLE_SIZE 1024
#define WORKER_TABLE_SIZE 8192
#define REPLICA_TABLE_SIZE 8192
#define IPV4_TABLE_SIZE 1024
#define SOURCE_TABLE_SIZE 1024
#define TREE_LINK_TABLE_SIZE 1024
#define DROP_REASONS 32

/* Expected lengths of a netagg packet (no IPv4 options): UDP 8 + netagg 24 + k * 4. */
#define NETAGG_UDP_LENGTH 288
#define NETAGG_IPV4_TOTAL_LENGTH 308
#define NETAGG_WIDE_UDP_LENGTH 1056
#define NETAGG_WIDE_IPV4_TOTAL_LENGTH 1076
/* netagg_h.width codes (wire.WIDTHS): NETAGG_K and NETAGG_WIDE_K values; any other is MALFORMED. */
#define NETAGG_WIDTH 0
#define NETAGG_WIDTH_WIDE 1

#define ETHERTYPE_IPV4 0x0800
#define IPPROTO_UDP 17
#define RESULT_TTL 64

/* Flag bits of netagg_h.flags. */
#define FLAG_RESULT 0x01
#define FLAG_RETRANSMIT 0x02
/* The round flags (docs/protocol.md, "Round flags"): a host sets the non-finite ones its block
 * held (and OUT_OF_STEP on an abort contribution); the switch ORs them over a round's
 * contributions (register round_flags), adds OUT_OF_STEP for a contribution of another
 * collective (exchange), and returns them with the round's state. */
#define FLAG_NAN 0x08
#define FLAG_POS_INF 0x10
#define FLAG_NEG_INF 0x20
#define FLAG_OUT_OF_STEP 0x40
#define ROUND_FLAGS 0x78
/* Deadline rounds (docs/protocol.md, "Closing a round at a deadline"): on a contribution, close the
 * round with the contributions that have arrived; on a result, the round was closed early and
 * members holds the bitmap of the contributions in its sum. The round_flags register keeps it
 * beside the round flags (STORED_FLAGS), and every packet that leaves with the round's state
 * carries them. */
#define FLAG_CLOSE 0x80
#define STORED_FLAGS 0xf8
/* Congestion marks (docs/protocol.md, "Congestion marks"): ECN in ipv4.diffserv[1:0]. The
 * round_flags register also keeps ROUND_CE (FLAG_RESULT's position, never stored as a flag): some
 * contribution to the round arrived CE-marked; every packet that leaves with the round's state then
 * carries CE. Egress marks an ECN-capable packet CE when it found its queue ECN_MARK_QDEPTH deep. */
#define ECN_NOT_ECT 0
#define ECN_CE 3
#define ROUND_CE 0x01
#define ECN_MARK_QDEPTH 20

/* Indices of the drop_reasons counter (see docs/protocol.md). */
#define DROP_NONE 0
#define DROP_NOT_IPV4 1
#define DROP_NO_ROUTE 2
#define DROP_TTL_EXPIRED 3
#define DROP_MALFORMED 4
#define DROP_BAD_VERSION 5
#define DROP_RESULT_FROM_HOST 6
#define DROP_UNKNOWN_JOB 7
#define DROP_UNKNOWN_WORKER 8
#define DROP_SLOT_OUT_OF_RANGE 9
#define DROP_BAD_POOL 10
#define DROP_RANK_MISMATCH 11
#define DROP_NO_REPLICA 12
/* A host's packet posing as the switch (netagg source port, aggregator or bound address). */
#define DROP_SPOOFED_SOURCE 13
/* Subset rounds: the sender is not in the packet's members; the members differ from those the
 * round started with. */
#define DROP_NOT_A_MEMBER 14
#define DROP_MEMBERS_MISMATCH 15
/* A new contribution whose exchange differs from its round's: not added, the round marked
 * OUT_OF_STEP; counted here although the packet still counts towards completion (and, if it
 * completes the round, leaves as its result). */
#define DROP_EXCHANGE_MISMATCH 16
/* A packet whose width code is not its job's (jobs table): refused, a job reject. */
#define DROP_WRONG_WIDTH 17
/* A close request for a job with an up link on this switch, or a parent's result of a closed
 * round: deadline rounds are one switch's. Refused before any register changes. */
#define DROP_CLOSE_REFUSED 18
/* A new contribution to a round closed without it: not added; the sender gets the stored
 * result (FLAG_CLOSE, the contributors in members), counted in job_retransmit_results too. */
#define DROP_LATE_FOR_CLOSED_ROUND 19

/* How a packet's round number compares with its (slot, pool)'s current round. */
#define ROUND_SAME 0
#define ROUND_NEW 1
#define ROUND_OLD 2

/* Where a (slot, pool)'s round stands in a tree of switches (docs/hierarchy.md). */
#define LEVEL_OPEN 0
#define LEVEL_UP 1
#define LEVEL_FINAL 2

/* What the value and exponent registers do with a packet. */
#define OP_NONE 0
#define OP_WRITE 1
#define OP_MERGE 2
#define OP_READ 3

/* Apply M to every value index; the indices are two decimal digits so that
 * they can be pasted into names (v07, value_07) and @id literals. */
#define FOR_EACH_VALUE(M) \
    M(00) M(01) M(02) M(03) M(04) M(05) M(06) M(07) \
    M(08) M(09) M(10) M(11) M(12) M(13) M(14) M(15) \
    M(16) M(17) M(18) M(19) M(20) M(21) M(22) M(23) \
    M(24) M(25) M(26) M(27) M(28) M(29) M(30) M(31) \
    M(32) M(33) M(34) M(35) M(36) M(37) M(38) M(39) \
    M(40) M(41) M(42) M(43) M(44) M(45) M(46) M(47) \
    M(48) M(49) M(50) M(51) M(52) M(53) M(54) M(55) \
    M(56) M(57) M(58) M(59) M(60) M(61) M(62) M(63)

/* Apply M to every bit index of a 32-bit worker mask. */
#define FOR_EACH_MEMBER_BIT(M) \
    M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15) \
    M(16) M(17) M(18) M(19) M(20) M(21) M(22) M(23) M(24) M(25) M(26) M(27) M(28) M(29) M(30) M(31)

typedef bit<9> port_t;
typedef bit<48> mac_addr_t;
typedef bit<32> ipv4_addr_t;
typedef bit<32> slot_index_t;
typedef bit<32> worker_mask_t;

#endif
