/* netagg (TNA): which job generation last used this slot? See v1model/control/slot_owner.p4.
 * claim: compare with the job's generation, take the slot over if it differs. A parent's result
 * coming down (meta.down, tree_links.p4) never takes a slot over: check compares and writes
 * nothing (a slot of another generation is stale to it, and it is dropped as a duplicate). */
#ifndef _NETAGG_TNA_SLOT_OWNER_P4_
#define _NETAGG_TNA_SLOT_OWNER_P4_

control SlotOwner(in tna_headers_t hdr, inout ingress_metadata_t meta) {
    Register<bit<32>, slot_reg_index_t>(NUM_SLOTS, 0) slot_owner;

    RegisterAction<bit<32>, slot_reg_index_t, bit<1>>(slot_owner) claim = {
        void apply(inout bit<32> owner, out bit<1> stale) {
            if (owner != meta.generation) {
                owner = meta.generation;
                stale = 1;
            } else {
                stale = 0;
            }
        }
    };

    RegisterAction<bit<32>, slot_reg_index_t, bit<1>>(slot_owner) check = {
        void apply(inout bit<32> owner, out bit<1> stale) {
            if (owner != meta.generation) {
                stale = 1;
            } else {
                stale = 0;
            }
        }
    };

    action do_claim() { meta.stale = claim.execute(SLOT_INDEX); }
    action do_check() { meta.stale = check.execute(SLOT_INDEX); }

    /* One table picks the access (each `if` around an execute would be a logical table of its own). */
    table owner_access {
        key = { meta.down: exact; }
        actions = { do_claim; do_check; NoAction; }
        const entries = {
            0: do_claim();
            1: do_check();
        }
        /* (An action with a computed register index cannot be a default action.) */
        const default_action = NoAction();
        size = 2;
    }

    apply {
        owner_access.apply();
    }
}

#endif
