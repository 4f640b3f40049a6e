/* netagg: has this worker already contributed to this round of the slot's pool?
 * One bitmap per (slot, pool). A NEW round starts the bitmap with the sender's bit; in
 * the SAME round the sender's bit is added, and a bit that was already set marks a
 * duplicate or a resend. OLD copies never get here. With meta.close_check = 1 (a round closed at a
 * deadline) the bitmap is only read: the sum's contributors, and whether the sender is one. */
#ifndef _NETAGG_BITMAP_CHECK_P4_
#define _NETAGG_BITMAP_CHECK_P4_

control BitmapCheck(in headers_t hdr, inout metadata_t meta) {
    @id(0x16000002)
    register<worker_mask_t>(NUM_POOL_SLOTS) bitmap;

    apply {
        worker_mask_t before = 0;
        if (meta.close_check == 1) {
            bitmap.read(before, meta.pool_index);
        } else if (meta.round_state == ROUND_NEW) {
            bitmap.write(meta.pool_index, meta.worker_mask);
        } else {
            bitmap.read(before, meta.pool_index);
            bitmap.write(meta.pool_index, before | meta.worker_mask);
        }
        meta.bitmap_before = before;
        if (meta.round_state == ROUND_NEW) {
            meta.first = 1;
        } else {
            meta.first = 0;
        }
        if ((before & meta.worker_mask) == 0) {
            meta.fresh = 1;
        } else {
            meta.fresh = 0;
        }
    }
}

#endif
