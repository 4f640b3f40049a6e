/* netagg: numbers only the TNA program needs (the shared ones are in shared/defines.p4). */
#ifndef _NETAGG_TNA_DEFINES_P4_
#define _NETAGG_TNA_DEFINES_P4_

/* Value-pair operation of a result's third pass: read the high words. */
#define OP_READ_HI 4

/* Where a recirculated packet goes after its pass (recirc_h.deliver). */
#define DELIVER_NONE 0
#define DELIVER_GROUP 1
#define DELIVER_SENDER 2
/* A tree of switches: the partial to the parent, fresh or (RETRANSMIT) a resend's (ResultDelivery's up actions). */
#define DELIVER_UP 3
#define DELIVER_UP_RESEND 4

/* A wide packet's passes after the first (recirc_h.step; 0: a narrow packet). Steps 1 .. 4 take
 * its chunks 0 .. 3 in turn: the parser extracts the first chunk left, the value pairs write, add
 * or read it at its cell, and the deparser leaves it out. An absorbed contribution ends there;
 * a packet that leaves with the sums goes on with steps 8 .. 15, which parse no values and put
 * one half of a chunk in front of those read before: the high words of chunk 3, its low words,
 * the high words of chunk 2, ... the low words of chunk 0 (step 15, the last pass). Bit 3 marks
 * the read steps (the parser tests it), bit 0 a read step's half (0: high words, 1: low). */
#define WIDE_STEP_CHUNK_0 1
#define WIDE_STEP_CHUNK_3 4
#define WIDE_STEP_READ_FIRST 8
#define WIDE_STEP_LAST 15

/* A wide packet's first pass only checks that it is whole (the parser reaches its last value) and
 * resubmits it: resubmit type, and the bits between the netagg header and the last value. */
#define RESUBMIT_WIDE 1
#define WIDE_PROBE_SKIP_BITS ((NETAGG_WIDE_K - 1) * 32)

/* The recirculation port in each pipe is (pipe << 7) | RECIRC_PORT_LOCAL (Tofino 1: 68). */
#define RECIRC_PORT_LOCAL 68
/* The recirculation port of the pipe that port p belongs to. */
#define RECIRC_PORT_OF(p) ((p)[8:7] ++ (bit<7>)RECIRC_PORT_LOCAL)

/* Register index widths: log2(NUM_SLOTS) and log2(NUM_POOL_SLOTS). */
typedef bit<12> slot_reg_index_t;
typedef bit<13> pool_reg_index_t;

/* Value pairs: pair i holds v(i) in its low and v(i+32) in its high word. One stateful ALU
 * updates both words of a pair, but Tofino 1's ALU outputs one 32-bit word per pass. */
#define FOR_EACH_PAIR(M) \
    M(00, 32) M(01, 33) M(02, 34) M(03, 35) M(04, 36) M(05, 37) M(06, 38) M(07, 39) \
    M(08, 40) M(09, 41) M(10, 42) M(11, 43) M(12, 44) M(13, 45) M(14, 46) M(15, 47) \
    M(16, 48) M(17, 49) M(18, 50) M(19, 51) M(20, 52) M(21, 53) M(22, 54) M(23, 55) \
    M(24, 56) M(25, 57) M(26, 58) M(27, 59) M(28, 60) M(29, 61) M(30, 62) M(31, 63)

#endif
