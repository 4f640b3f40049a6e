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
            current = hdr.netagg.round - 2;                                                  \
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

    action peek0() { meta.round_ahead = peek_pool0.execute(SLOT_INDEX); }
    action start0() {
        start_pool0.execute(SLOT_INDEX);
        meta.round_ahead = 0;
    }
    action advance0() { meta.round_ahead = advance_pool0.execute(SLOT_INDEX); }
    action trail0() { trail_pool0.execute(SLOT_INDEX); }
    action peek1() { meta.round_ahead = peek_pool1.execute(SLOT_INDEX); }
    action start1() {
        start_pool1.execute(SLOT_INDEX);
        meta.round_ahead = 0;
    }
    action advance1() { meta.round_ahead = advance_pool1.execute(SLOT_INDEX); }
    action trail1() { trail_pool1.execute(SLOT_INDEX); }
    /* Every path writes round_ahead (a slot taken over: 0), so that its live range starts here and
     * its PHV can be shared with fields dead by then; the entries cover every packet. */
    action no_access() { meta.round_ahead = 0; }

    /* The packet's pool: a parent's result (down) only peeks; a slot taken over (stale) starts the
     * round; otherwise the round advances. One table per pool (a table's actions must all address
     * the same registers), chosen by the pool; a slot taken over also trails the other pool. */
#define POOL_ACCESS(p)                                                                      \
    table pool##p##_access {                                                                \
        key = {                                                                             \
            meta.down: ternary;                                                             \
            meta.stale: ternary;                                                            \
        }                                                                                   \
        actions = { peek##p; start##p; advance##p; no_access; }                             \
        const entries = {                                                                   \
            (1, _): peek##p();                                                              \
            (0, 1): start##p();                                                             \
            (0, 0): advance##p();                                                           \
        }                                                                                   \
        const default_action = no_access();                                                 \
        size = 3;                                                                           \
    }
    POOL_ACCESS(0)
    POOL_ACCESS(1)

    apply {
        /* (Pools other than 0 and 1 were refused as BAD_POOL before.) */
        if (hdr.netagg.pool[0:0] == 0) {
            pool0_access.apply();
            if (meta.down == 0 && meta.stale == 1) {
                trail1();
            }
        } else {
            pool1_access.apply();
            if (meta.down == 0 && meta.stale == 1) {
                trail0();
            }
        }
    }
}

#endif
