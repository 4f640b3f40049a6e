/* netagg (TNA): do a round's contributions belong to the same collective? See
 * v1model/control/exchange_check.p4. One 32-bit register per (slot, pool), two RegisterActions:
 * start_exchange (a NEW round, or a slot taken over: store the packet's exchange) and
 * check_exchange (the SAME round: return 1 if the stored exchange differs from the packet's;
 * nothing is written). The ALU's comparison does the test, as SlotOwner's claim does, so the
 * mismatch bit comes out of the access itself. It is chosen by the same condition as the bitmap's
 * start_round, not by meta.first, so that it does not wait for the bitmap and can share its stage;
 * its bit is needed only by the ingress's decision (the value operation), stages later. A packet
 * refused for other members (MEMBERS_MISMATCH) only read it: no register changed. */
#ifndef _NETAGG_TNA_EXCHANGE_CHECK_P4_
#define _NETAGG_TNA_EXCHANGE_CHECK_P4_

control ExchangeCheck(in tna_headers_t hdr, inout ingress_metadata_t meta) {
    Register<bit<32>, pool_reg_index_t>(NUM_POOL_SLOTS, 0) round_exchange;

    RegisterAction<bit<32>, pool_reg_index_t, bit<1>>(round_exchange) start_exchange = {
        void apply(inout bit<32> stored) {
            stored = hdr.netagg.exchange;
        }
    };
    RegisterAction<bit<32>, pool_reg_index_t, bit<1>>(round_exchange) check_exchange = {
        void apply(inout bit<32> stored, out bit<1> mismatch) {
            if (stored != hdr.netagg.exchange) {
                mismatch = 1;
            } else {
                mismatch = 0;
            }
        }
    };

    action do_start_exchange() {
        start_exchange.execute(POOL_INDEX);
        meta.exchange_mismatch = 0;
    }
    action do_check_exchange() {
        meta.exchange_mismatch = check_exchange.execute(POOL_INDEX);
    }

    /* The bitmap's condition (BitmapCheck's bitmap_access): a new round, or the same one. */
    table exchange_access {
        key = {
            meta.stale: ternary;
            meta.round_ahead: ternary;
        }
        actions = { do_start_exchange; do_check_exchange; NoAction; }
        const entries = {
            (1, _): do_start_exchange();
            (0, 0): do_check_exchange();
            (0, 0x8000 &&& 0x8000): do_check_exchange();
            (0, _): do_start_exchange();
        }
        const default_action = NoAction();
        size = 4;
    }

    apply {
        exchange_access.apply();
    }
}

#endif
