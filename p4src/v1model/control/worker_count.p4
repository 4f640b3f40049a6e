/* netagg: how many contributions does this slot's round still miss?
 * The round's first contribution sets the count to num_workers - 1 (so nothing
 * ever needs zeroing), each further new contribution decrements it, and 0 means
 * complete. A new contribution that finds the count already 0 belongs to a round
 * that has completed (a late copy) and is marked late. Duplicates only read. */
#ifndef _NETAGG_WORKER_COUNT_P4_
#define _NETAGG_WORKER_COUNT_P4_

control WorkerCount(inout metadata_t meta) {
    @id(0x16000004)
    register<bit<8>>(NUM_POOL_SLOTS) worker_count;

    apply {
        bit<8> count;
        worker_count.read(count, meta.pool_index);
        meta.count_before = count;
        meta.late = 0;
        if (meta.fresh == 1) {
            if (meta.first == 1) {
                count = meta.num_workers - 1;
                worker_count.write(meta.pool_index, count);
            } else if (count == 0) {
                meta.late = 1;
            } else {
                count = count - 1;
                worker_count.write(meta.pool_index, count);
            }
        }
        if (count == 0 && meta.late == 0) {
            meta.complete = 1;
        } else {
            meta.complete = 0;
        }
    }
}

#endif
