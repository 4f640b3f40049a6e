/* netagg: has this worker already contributed to this slot's round?
 * One bitmap per pool; a packet for pool p sets the sender's bit in p and clears
 * it in the other pool (SwitchML's shadow-copy scheme), so a worker's bit in a
 * pool is clear exactly when its next packet for that pool is a new contribution. */
#ifndef _NETAGG_BITMAP_CHECK_P4_
#define _NETAGG_BITMAP_CHECK_P4_

control BitmapCheck(in headers_t hdr, inout metadata_t meta) {
    @id(0x16000002)
    register<worker_mask_t>(NUM_SLOTS) bitmap_pool0;
    @id(0x16000003)
    register<worker_mask_t>(NUM_SLOTS) bitmap_pool1;

    apply {
        worker_mask_t pool0;
        worker_mask_t pool1;
        bitmap_pool0.read(pool0, meta.slot_index);
        bitmap_pool1.read(pool1, meta.slot_index);
        if (meta.stale == 1) {
            pool0 = 0;
            pool1 = 0;
        }
        if (hdr.netagg.pool == 0) {
            meta.bitmap_before = pool0;
            bitmap_pool0.write(meta.slot_index, pool0 | meta.worker_mask);
            bitmap_pool1.write(meta.slot_index, pool1 & ~meta.worker_mask);
        } else {
            meta.bitmap_before = pool1;
            bitmap_pool1.write(meta.slot_index, pool1 | meta.worker_mask);
            bitmap_pool0.write(meta.slot_index, pool0 & ~meta.worker_mask);
        }
        if (meta.bitmap_before == 0) {
            meta.first = 1;
        } else {
            meta.first = 0;
        }
        if ((meta.bitmap_before & meta.worker_mask) == 0) {
            meta.fresh = 1;
        } else {
            meta.fresh = 0;
        }
    }
}

#endif
