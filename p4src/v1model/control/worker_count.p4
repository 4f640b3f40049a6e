/* netagg: how many contributions does this slot's round still miss?
 * A round expects num_workers contributions, or as many as its members (a subset round:
 * hdr.netagg.members != 0, counted bit by bit; MemberCheck fixed them for the round).
 * The round's first contribution sets the count to that number - 1 (so nothing
 * ever needs zeroing), each further new contribution decrements it, and 0 means
 * complete. A new contribution that finds the count already 0 belongs to a round
 * that has completed (a late copy) and is marked late. Duplicates only read.
 * A close request (FLAG_CLOSE) that leaves the round incomplete completes it: the count
 * becomes 0 and meta.closes is set (RoundFlags then marks the round closed). */
#ifndef _NETAGG_WORKER_COUNT_P4_
#define _NETAGG_WORKER_COUNT_P4_

#define MEMBER_BIT(i) + (bit<8>)hdr.netagg.members[i:i]

control WorkerCount(in headers_t hdr, inout metadata_t meta) {
    @id(0x16000004)
    register<bit<8>>(NUM_POOL_SLOTS) worker_count;

    apply {
        bit<8> count;
        worker_count.read(count, meta.pool_index);
        meta.count_before = count;
        meta.late = 0;
        if (meta.fresh == 1) {
            if (meta.first == 1) {
                bit<8> expected = meta.num_workers;
                if (hdr.netagg.members != 0) {
                    expected = 0 FOR_EACH_MEMBER_BIT(MEMBER_BIT);
                }
                count = expected - 1;
                worker_count.write(meta.pool_index, count);
            } else if (count == 0) {
                meta.late = 1;
            } else {
                count = count - 1;
                worker_count.write(meta.pool_index, count);
            }
        }
        meta.closes = 0;
        if (count == 0 && meta.late == 0) {
            meta.complete = 1;
        } else {
            meta.complete = 0;
            if ((hdr.netagg.flags & FLAG_CLOSE) != 0 && meta.late == 0) {
                count = 0;
                worker_count.write(meta.pool_index, count);
                meta.closes = 1;
                meta.complete = 1;
            }
        }
    }
}

#endif
