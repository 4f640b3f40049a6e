/* netagg (TNA): how many contributions does this slot's round still miss?
 * See v1model/control/worker_count.p4. A round starts at the number it expects - 1
 * (meta.expected: the job's worker count, or a subset round's number of members, from
 * MemberCount). Two RegisterActions: start a round, or step it: return the count before the
 * packet and count down if the sender's bit was clear (meta.sender_seen == 0) and the count is
 * not 0 yet. The ALU itself tests the sender's bit, which is known only one stage before, so
 * that no stage is spent on choosing between counting down and reading; completion and
 * lateness follow from the returned count in the next stage. The counts are 32 bits wide
 * (v1model: 8) because an ALU in 8-bit mode cannot read the 32-bit sender_seen. */
#ifndef _NETAGG_TNA_WORKER_COUNT_P4_
#define _NETAGG_TNA_WORKER_COUNT_P4_

control WorkerCount(inout ingress_metadata_t meta) {
    Register<bit<32>, pool_reg_index_t>(NUM_POOL_SLOTS, 0) worker_count;

    RegisterAction<bit<32>, pool_reg_index_t, bit<32>>(worker_count) start_count = {
        void apply(inout bit<32> count) {
            count = meta.expected - 1;
        }
    };
    RegisterAction<bit<32>, pool_reg_index_t, bit<32>>(worker_count) count_step = {
        void apply(inout bit<32> count, out bit<32> before) {
            before = count;
            if (meta.sender_seen == 0 && count != 0) {
                count = count - 1;
            }
        }
    };

    apply {
        meta.late = 0;
        meta.complete = 0;
        if (meta.first == 1) {
            start_count.execute(meta.pool_index);
            if (meta.expected == 1) {
                meta.complete = 1;
            }
        } else {
            meta.count_before = count_step.execute(meta.pool_index);
            if (meta.fresh == 1) {
                if (meta.count_before == 0) {
                    meta.late = 1;
                } else if (meta.count_before == 1) {
                    meta.complete = 1;
                }
            } else if (meta.count_before == 0) {
                meta.complete = 1;
            }
        }
    }
}

#endif
