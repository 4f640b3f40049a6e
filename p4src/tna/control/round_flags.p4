/* netagg (TNA): the round flags of a slot's round (ROUND_FLAGS), the OR over its contributions;
 * see v1model/control/round_flags.p4. One 8-bit register per (slot, pool), two RegisterActions,
 * two PHV inputs that the ingress's decision sets with the value operation:
 *   meta.flags_in:  what the packet ORs into the round: its flags & ROUND_FLAGS (a contribution
 *                   that is added), FLAG_OUT_OF_STEP (a fresh contribution of another collective),
 *                   0 (a resend, a duplicate, a late copy: the register only reads);
 *   meta.flags_out: the packet's other flags: all of them (an added contribution: its own round
 *                   flags are in the register's new value anyway), flags & ~ROUND_FLAGS
 *                   (meta.flags_keep, taken in stage 0; a resend), or that | FLAG_OUT_OF_STEP.
 * write_flags (the round's first contribution) stores flags_in; the packet's flags stay as they
 * are, which is what the round holds. merge_flags ORs flags_in in and returns the register's old
 * value | flags_out, which is (flags & ~ROUND_FLAGS) | the new value: the packet's flags, written
 * straight from the ALU's idle half (as RoundCheck's advance returns round - current), so that
 * no stage is spent on combining them afterwards. */
#ifndef _NETAGG_TNA_ROUND_FLAGS_P4_
#define _NETAGG_TNA_ROUND_FLAGS_P4_

control RoundFlags(inout tna_headers_t hdr, in ingress_metadata_t meta) {
    Register<bit<8>, pool_reg_index_t>(NUM_POOL_SLOTS, 0) round_flags;

    RegisterAction<bit<8>, pool_reg_index_t, bit<8>>(round_flags) write_flags = {
        void apply(inout bit<8> stored) {
            stored = meta.flags_in;
        }
    };
    RegisterAction<bit<8>, pool_reg_index_t, bit<8>>(round_flags) merge_flags = {
        void apply(inout bit<8> stored, out bit<8> flags) {
            flags = stored | meta.flags_out;
            stored = stored | meta.flags_in;
        }
    };

    action do_write_flags() { write_flags.execute(POOL_INDEX); }
    action do_merge_flags() { hdr.netagg.flags = merge_flags.execute(POOL_INDEX); }

    table flags_access {
        key = { hdr.recirc.value_op: ternary @name("value_op"); }
        actions = { do_write_flags; do_merge_flags; NoAction; }
        const entries = {
            OP_WRITE: do_write_flags();
            _: do_merge_flags();
        }
        const default_action = NoAction();
        size = 2;
    }

    apply {
        flags_access.apply();
    }
}

#endif
