/* netagg: a subset round's expected contributors are fixed by its first packet.
 * hdr.netagg.members is 0 for a round of the whole job, or the bitmap of the ranks expected
 * in this round of the (slot, pool). A NEW round stores the packet's members; in the SAME
 * round a packet must carry the same members, or it is dropped (MEMBERS_MISMATCH) before
 * it touches the bitmap, the count or the values. That the sender is a member is checked
 * in WorkerLookup, and WorkerCount expects as many contributions as there are members.
 * The TNA twin has no file of this name: there the members share the bitmap's register entry
 * (tna/control/bitmap_check.p4, no extra stateful ALU), and tna/control/member_count.p4 counts
 * them in table stages, which WorkerCount does bit by bit here. Every other control file has
 * the same name in both trees. */
#ifndef _NETAGG_MEMBER_CHECK_P4_
#define _NETAGG_MEMBER_CHECK_P4_

control MemberCheck(in headers_t hdr, inout metadata_t meta) {
    @id(0x16000007)
    register<worker_mask_t>(NUM_POOL_SLOTS) round_members;

    apply {
        if (meta.round_state == ROUND_NEW) {
            round_members.write(meta.pool_index, hdr.netagg.members);
        } else {
            worker_mask_t expected;
            round_members.read(expected, meta.pool_index);
            if (expected != hdr.netagg.members) {
                meta.drop_reason = DROP_MEMBERS_MISMATCH;
            }
        }
    }
}

#endif
