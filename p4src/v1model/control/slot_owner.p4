/* netagg: which job generation last used this slot? A slot handed to a new job
 * still holds the old job's round numbers, bitmaps and counts; P4Runtime cannot clear
 * registers on BMv2 (p4lang/PI#376), so the data plane treats a slot whose owner tag
 * differs from the job's generation as taken over (meta.stale): RoundCheck then starts
 * a new round, which rewrites the bitmap, count, exponent and sums. A parent's result coming
 * down (meta.down) never takes a slot over: for a slot of another generation it is stale. */
#ifndef _NETAGG_SLOT_OWNER_P4_
#define _NETAGG_SLOT_OWNER_P4_

control SlotOwner(inout metadata_t meta) {
    @id(0x16000001)
    register<bit<32>>(NUM_SLOTS) slot_owner;

    apply {
        bit<32> owner;
        slot_owner.read(owner, meta.slot_index);
        if (owner != meta.generation) {
            meta.stale = 1;
            if (meta.down == 0) {
                slot_owner.write(meta.slot_index, meta.generation);
            }
        } else {
            meta.stale = 0;
        }
    }
}

#endif
