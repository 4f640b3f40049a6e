/* netagg (TNA): has this worker already contributed to this round of the slot's pool?
 * See v1model/control/bitmap_check.p4. Two RegisterActions: start a round, or add a bit and return
 * whether it was set (a gateway cannot AND two fields). */
#ifndef _NETAGG_TNA_BITMAP_CHECK_P4_
#define _NETAGG_TNA_BITMAP_CHECK_P4_

control BitmapCheck(inout ingress_metadata_t meta) {
    Register<worker_mask_t, pool_reg_index_t>(NUM_POOL_SLOTS, 0) bitmap;

    RegisterAction<worker_mask_t, pool_reg_index_t, worker_mask_t>(bitmap) start_round = {
        void apply(inout worker_mask_t bits, out worker_mask_t seen) {
            bits = meta.worker_mask;
            seen = 0;
        }
    };
    /* Returns the sender's bit as it was before (the ALU's second half computes it). */
    RegisterAction<worker_mask_t, pool_reg_index_t, worker_mask_t>(bitmap) add_worker = {
        void apply(inout worker_mask_t bits, out worker_mask_t seen) {
            seen = bits & meta.worker_mask;
            bits = bits | meta.worker_mask;
        }
    };

    apply {
        if (meta.stale == 1 || (meta.round_ahead != 0 && meta.round_ahead[15:15] == 0)) {
            meta.sender_seen = start_round.execute(meta.pool_index);
            meta.first = 1;
        } else {
            meta.sender_seen = add_worker.execute(meta.pool_index);
            meta.first = 0;
        }
        if (meta.sender_seen == 0) {
            meta.fresh = 1;
        } else {
            meta.fresh = 0;
        }
    }
}

#endif
