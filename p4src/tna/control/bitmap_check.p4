/* netagg (TNA): has this worker already contributed to this round of the slot's pool, and does
 * the packet carry the members its round started with? See v1model/control/bitmap_check.p4 and
 * v1model/control/member_check.p4. The v1model program keeps a round's members in a register of
 * their own; here they are the high word of the bitmap's entry (a register pair: bitmap,
 * members), so that the check costs no stateful ALU and no stage: the bitmap is the first
 * register a packet of the current round changes, and the same access decides whether it may.
 *
 * start_round (a NEW round): the bitmap becomes the sender's bit, the members the packet's.
 * add_worker (the SAME round): if the packet's members are the stored ones, the sender's bit is
 * added and the bitmap as it was before is returned; if not, nothing changes and 0 is returned.
 * A round's bitmap holds at least the bit of the worker that started it, so 0 from add_worker
 * means other members (MEMBERS_MISMATCH). A pair's ALU returns one word, and Tofino 1's
 * comparisons take no mask, so the sender's old bit (before & worker_mask) is taken in the
 * next stage, and WorkerCount decides inside its own ALU whether to count down. */
#ifndef _NETAGG_TNA_BITMAP_CHECK_P4_
#define _NETAGG_TNA_BITMAP_CHECK_P4_

struct bitmap_members_t {
    worker_mask_t bits;
    worker_mask_t members;
}

control BitmapCheck(in tna_headers_t hdr, inout ingress_metadata_t meta) {
    Register<bitmap_members_t, pool_reg_index_t>(NUM_POOL_SLOTS, {0, 0}) bitmap;

    RegisterAction<bitmap_members_t, pool_reg_index_t, worker_mask_t>(bitmap) start_round = {
        void apply(inout bitmap_members_t entry) {
            entry.bits = meta.worker_mask;
            entry.members = hdr.netagg.members;
        }
    };
    RegisterAction<bitmap_members_t, pool_reg_index_t, worker_mask_t>(bitmap) add_worker = {
        void apply(inout bitmap_members_t entry, out worker_mask_t before) {
            if (entry.members == hdr.netagg.members) {
                before = entry.bits;
                entry.bits = entry.bits | meta.worker_mask;
            } else {
                before = 0;
            }
        }
    };

    apply {
        if (meta.stale == 1 || (meta.round_ahead != 0 && meta.round_ahead[15:15] == 0)) {
            start_round.execute(meta.pool_index);
            meta.first = 1;
        } else {
            meta.bitmap_before = add_worker.execute(meta.pool_index);
            meta.first = 0;
        }
    }
}

#endif
