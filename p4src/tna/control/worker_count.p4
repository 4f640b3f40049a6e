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

control WorkerCount(in tna_headers_t hdr, inout ingress_metadata_t meta) {
    Register<bit<8>, pool_reg_index_t>(NUM_POOL_SLOTS, 0) worker_count;

    RegisterAction<bit<8>, pool_reg_index_t, bit<8>>(worker_count) start_count = {
        void apply(inout bit<8> count) {
            count = meta.expected - 1;
        }
    };
    RegisterAction<bit<8>, pool_reg_index_t, bit<8>>(worker_count) count_step = {
        void apply(inout bit<8> count, out bit<8> before) {
            before = count;
            if (count != 0) {
                count = count - 1;
            }
        }
    };
    RegisterAction<bit<8>, pool_reg_index_t, bit<8>>(worker_count) count_peek = {
        void apply(inout bit<8> count, out bit<8> before) {
            before = count;
        }
    };

    action do_start_count() {
        start_count.execute(POOL_INDEX);
        meta.count_before = 0;
    }
    /* Every path writes count_before, so that its live range starts here; the entries cover every
     * packet. */
    action no_access() { meta.count_before = 0; }
    action do_count_step() { meta.count_before = count_step.execute(POOL_INDEX); }
    action do_count_peek() { meta.count_before = count_peek.execute(POOL_INDEX); }

    /* The round's first contribution starts the count; a new sender counts down; a sender seen
     * before (sender_seen != 0: a resend or duplicate) only reads it. */
    table count_access {
        key = {
            meta.first: ternary;
            meta.sender_seen: ternary;
        }
        actions = { do_start_count; do_count_step; do_count_peek; no_access; }
        const entries = {
            (1, _): do_start_count();
            (0, 0): do_count_step();
            (0, _): do_count_peek();
        }
        const default_action = no_access();
        size = 3;
    }

    action set_complete() { meta.complete = 1; }
    action set_late() { meta.late = 1; }

    /* What the count says (complete and late stay 0 otherwise, as the parser set them): a first
     * contribution completes a round of one; a new sender finding 0 left is late, 1 left completes
     * the round; a sender seen before finds the round complete at 0. */
    table count_outcome {
        key = {
            meta.first: ternary;
            meta.expected: ternary;
            meta.fresh: ternary;
            meta.count_before: ternary;
        }
        actions = { set_complete; set_late; NoAction; }
        const entries = {
            (1, 1, _, _): set_complete();
            (0, _, 1, 0): set_late();
            (0, _, 1, 1): set_complete();
            (0, _, 0, 0): set_complete();
        }
        const default_action = NoAction();
        size = 4;
    }

    apply {
        count_access.apply();
        count_outcome.apply();
    }
}

#endif
