/* netagg (TNA): how many contributions does this slot's round still miss?
 * See v1model/control/worker_count.p4. Three RegisterActions, each returning the count
 * before the packet; completion and lateness follow from it in the next stage. */
#ifndef _NETAGG_TNA_WORKER_COUNT_P4_
#define _NETAGG_TNA_WORKER_COUNT_P4_

control WorkerCount(inout ingress_metadata_t meta) {
    Register<bit<8>, pool_reg_index_t>(NUM_POOL_SLOTS, 0) worker_count;

    RegisterAction<bit<8>, pool_reg_index_t, bit<8>>(worker_count) start_count = {
        void apply(inout bit<8> count) {
            count = meta.num_workers - 1;
        }
    };
    RegisterAction<bit<8>, pool_reg_index_t, bit<8>>(worker_count) count_down = {
        void apply(inout bit<8> count, out bit<8> before) {
            before = count;
            if (count != 0) {
                count = count - 1;
            }
        }
    };
    RegisterAction<bit<8>, pool_reg_index_t, bit<8>>(worker_count) read_count = {
        void apply(inout bit<8> count, out bit<8> before) {
            before = count;
        }
    };

    apply {
        meta.late = 0;
        meta.complete = 0;
        if (meta.fresh == 1 && meta.first == 1) {
            start_count.execute(meta.pool_index);
            if (meta.num_workers == 1) {
                meta.complete = 1;
            }
        } else if (meta.fresh == 1) {
            meta.count_before = count_down.execute(meta.pool_index);
            if (meta.count_before == 0) {
                meta.late = 1;
            } else if (meta.count_before == 1) {
                meta.complete = 1;
            }
        } else {
            meta.count_before = read_count.execute(meta.pool_index);
            if (meta.count_before == 0) {
                meta.complete = 1;
            }
        }
    }
}

#endif
