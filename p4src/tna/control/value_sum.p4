/* netagg (TNA): the K running sums of a slot's round, as 32 register pairs (SwitchML's
 * layout): pair i holds v(i) in its low and v(i+32) in its high word, so one stateful ALU
 * writes or adds two values; 32 pairs and the slot state's 6 ALUs fit Tofino 1's 48 ingress
 * ALUs, 64 single registers would not. The pairs run in a packet's second pass (pair_op comes
 * from the recirc header), after the first pass decided the operation. Tofino 1's ALU returns
 * one 32-bit word per access, so a packet that leaves with the sums (the completing
 * contribution, or a resend that reads a completed round) gets the low words in pass 2 and
 * the high words in pass 3 (OP_READ_HI). Four RegisterActions per pair, the most one ALU
 * holds; one small table per pair picks the action by pair_op. See
 * v1model/control/value_sum.p4 for the semantics of write, merge and read. */
#ifndef _NETAGG_TNA_VALUE_SUM_P4_
#define _NETAGG_TNA_VALUE_SUM_P4_

struct value_pair_t {
    bit<32> lo;
    bit<32> hi;
}

#define VALUE_PAIR(i, j)                                                                   \
    Register<value_pair_t, pool_reg_index_t>(NUM_POOL_SLOTS, {0, 0}) value_##i;            \
    RegisterAction<value_pair_t, pool_reg_index_t, bit<32>>(value_##i) write_##i = {       \
        void apply(inout value_pair_t sums) {                                             \
            sums.lo = hdr.values_lo.v##i;                                                    \
            sums.hi = hdr.values_hi.v##j;                                                    \
        }                                                                                 \
    };                                                                                    \
    RegisterAction<value_pair_t, pool_reg_index_t, bit<32>>(value_##i) merge_##i = {       \
        void apply(inout value_pair_t sums, out bit<32> lo) {                             \
            sums.lo = sums.lo + hdr.values_lo.v##i;                                          \
            sums.hi = sums.hi + hdr.values_hi.v##j;                                          \
            lo = sums.lo;                                                                 \
        }                                                                                 \
    };                                                                                    \
    RegisterAction<value_pair_t, pool_reg_index_t, bit<32>>(value_##i) read_lo_##i = {     \
        void apply(inout value_pair_t sums, out bit<32> lo) {                             \
            lo = sums.lo;                                                                 \
        }                                                                                 \
    };                                                                                    \
    RegisterAction<value_pair_t, pool_reg_index_t, bit<32>>(value_##i) read_hi_##i = {     \
        void apply(inout value_pair_t sums, out bit<32> hi) {                             \
            hi = sums.hi;                                                                 \
        }                                                                                 \
    };                                                                                    \
    action do_write_##i() { write_##i.execute(POOL_INDEX); }                                   \
    action do_merge_##i() { hdr.values_lo.v##i = merge_##i.execute(POOL_INDEX); }                 \
    action do_read_lo_##i() { hdr.values_lo.v##i = read_lo_##i.execute(POOL_INDEX); }             \
    action do_read_hi_##i() { hdr.values_hi.v##j = read_hi_##i.execute(POOL_INDEX); }             \
    table values_##i {                                                                                         \
        key = { hdr.recirc.value_op: exact @name("value_op"); }                                                 \
        actions = { do_write_##i; do_merge_##i; do_read_lo_##i; do_read_hi_##i; NoAction; } \
        const entries = {                                                                 \
            OP_WRITE: do_write_##i();                                                     \
            OP_MERGE: do_merge_##i();                                                     \
            OP_READ: do_read_lo_##i();                                                    \
            OP_READ_HI: do_read_hi_##i();                                                 \
        }                                                                                 \
        const default_action = NoAction;                                                  \
        size = 4;                                                                         \
    }

#define APPLY_VALUE_PAIR(i, j) values_##i.apply();

control ValueSum(inout tna_headers_t hdr, in ingress_metadata_t meta) {
    FOR_EACH_PAIR(VALUE_PAIR)

    apply {
        FOR_EACH_PAIR(APPLY_VALUE_PAIR)
    }
}

#endif
