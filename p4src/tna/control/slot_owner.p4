/* netagg (TNA): which job generation last used this slot? See v1model/control/slot_owner.p4.
 * claim: compare with the job's generation, take the slot over if it differs. A parent's result
 * coming down (meta.down, tree_links.p4) never takes a slot over: check compares and writes
 * nothing (a slot of another generation is stale to it, and it is dropped as a duplicate). */
#ifndef _NETAGG_TNA_SLOT_OWNER_P4_
#define _NETAGG_TNA_SLOT_OWNER_P4_

control SlotOwner(inout ingress_metadata_t meta) {
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

    apply {
        if (meta.down == 1) {
            meta.stale = check.execute(meta.pool_index[11:0]);
        } else {
            meta.stale = claim.execute(meta.pool_index[11:0]);
        }
    }
}

#endif
