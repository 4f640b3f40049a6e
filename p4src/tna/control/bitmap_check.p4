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

    action do_start_round() {
        start_round.execute(POOL_INDEX);
        meta.bitmap_before = 0;
        meta.first = 1;
    }
    action do_add_worker() {
        meta.bitmap_before = add_worker.execute(POOL_INDEX);
        meta.first = 0;
    }

    /* Every path writes bitmap_before (a new round's: 0, no bit seen), so that its live range starts
     * here; the entries cover every packet. */
    action no_access() { meta.bitmap_before = 0; }

    /* A new round (a slot taken over, or round_ahead > 0 as 16-bit serial arithmetic) or the same
     * one (round_ahead 0; a superseded round's packet, round_ahead < 0, never gets here). */
    table bitmap_access {
        key = {
            meta.stale: ternary;
            meta.round_ahead: ternary;
        }
        actions = { do_start_round; do_add_worker; no_access; }
        const entries = {
            (1, _): do_start_round();
            (0, 0): do_add_worker();
            (0, 0x8000 &&& 0x8000): do_add_worker();
            (0, _): do_start_round();
        }
        const default_action = no_access();
        size = 4;
    }

    apply {
        bitmap_access.apply();
    }
}

#endif
