/* netagg (TNA): is this packet for its (slot, pool)'s current round, a newer one, or an older
 * one? See v1model/control/round_check.p4, which keeps both pools' rounds in one 32-bit entry.
 * Here each pool has its own 16-bit register, so that the stateful ALU's idle second half can
 * return round - current (serial arithmetic) from the advancing action; the state follows from
 * its sign (tested where it is used: NEW = stale, or ahead and positive; OLD = not stale and
 * negative; SAME = not stale and zero). A slot taken over writes both registers, one access each: this pool starts at the
 * packet's round, the other two rounds behind it (meta.round_behind; see the v1model twin for why two).
 * A parent's result coming down (meta.down, tree_links.p4) changes nothing: peek returns
 * round - current and writes nothing; the ingress takes it only if the slot is not stale and
 * that is 0 (the slot's current round), else it is a duplicate, as in the v1model program. */
#ifndef _NETAGG_TNA_ROUND_CHECK_P4_
#define _NETAGG_TNA_ROUND_CHECK_P4_

#define POOL_ROUND_REGISTER(p)                                                              \
    Register<bit<16>, slot_reg_index_t>(NUM_SLOTS, 0) round_pool##p;                        \
    RegisterAction<bit<16>, slot_reg_index_t, bit<16>>(round_pool##p) start_pool##p = {     \
        void apply(inout bit<16> current) {                                                 \
            current = hdr.netagg.round;                                                     \
        }                                                                                   \
    };                                                                                      \
    RegisterAction<bit<16>, slot_reg_index_t, bit<16>>(round_pool##p) trail_pool##p = {     \
        void apply(inout bit<16> current) {                                                 \
            current = meta.round_behind;                                                    \
        }                                                                                   \
    };                                                                                      \
    RegisterAction<bit<16>, slot_reg_index_t, bit<16>>(round_pool##p) advance_pool##p = {   \
        void apply(inout bit<16> current, out bit<16> ahead) {                              \
            ahead = hdr.netagg.round - current;                                             \
            if ((int<16>)(hdr.netagg.round - current) > 0) {                                \
                current = hdr.netagg.round;                                                 \
            }                                                                               \
        }                                                                                   \
    };                                                                                      \
    RegisterAction<bit<16>, slot_reg_index_t, bit<16>>(round_pool##p) peek_pool##p = {      \
        void apply(inout bit<16> current, out bit<16> ahead) {                              \
            ahead = hdr.netagg.round - current;                                             \
        }                                                                                   \
    };

control RoundCheck(in tna_headers_t hdr, inout ingress_metadata_t meta) {
    POOL_ROUND_REGISTER(0)
    POOL_ROUND_REGISTER(1)

    apply {
        if (meta.down == 1) {
            if (hdr.netagg.pool == 0) {
                meta.round_ahead = peek_pool0.execute(meta.pool_index[11:0]);
            } else {
                meta.round_ahead = peek_pool1.execute(meta.pool_index[11:0]);
            }
        } else if (meta.stale == 1) {
            if (hdr.netagg.pool == 0) {
                start_pool0.execute(meta.pool_index[11:0]);
                trail_pool1.execute(meta.pool_index[11:0]);
            } else {
                trail_pool0.execute(meta.pool_index[11:0]);
                start_pool1.execute(meta.pool_index[11:0]);
            }
        } else {
            if (hdr.netagg.pool == 0) {
                meta.round_ahead = advance_pool0.execute(meta.pool_index[11:0]);
            } else {
                meta.round_ahead = advance_pool1.execute(meta.pool_index[11:0]);
            }
        }
    }
}

#endif
