/* netagg: is this packet for its (slot, pool)'s current round, a newer one, or an older one?
 * Hosts number the uses of each slot (header field `round`, +1 per use, mod 2^16). The
 * switch keeps the current round of both pools of a slot in one 32-bit register entry
 * (pool 0 in the low half, pool 1 in the high half) and compares with serial-number
 * arithmetic: equal = SAME round (a contribution, duplicate or resend), ahead = a NEW
 * round (its state starts afresh), behind = an OLD copy (dropped, changes nothing).
 * This is what makes a delayed copy of an earlier round harmless even after every
 * worker has moved on. A slot taken over (meta.stale: from another job, or zeroed by a
 * switch restart) starts a NEW round in this pool and marks the other pool TWO rounds
 * behind this packet: the round just before it (round - 1, the other pool's) is then
 * still ahead and starts afresh (a worker that lost its result after a restart finishes it
 * with the others' copies), and no host sends round - 2 in the other pool (rounds alternate
 * pools), so no packet is SAME with the other pool's leftover registers. A parent's result
 * coming down (meta.down) changes nothing: SAME if it is the current round of a slot this job
 * owns, else OLD. */
#ifndef _NETAGG_ROUND_CHECK_P4_
#define _NETAGG_ROUND_CHECK_P4_

control RoundCheck(in headers_t hdr, inout metadata_t meta) {
    @id(0x16000006)
    register<bit<32>>(NUM_SLOTS) round_tags;

    apply {
        bit<32> tags;
        round_tags.read(tags, meta.slot_index);
        bit<16> current = tags[15:0];
        if (hdr.netagg.pool == 1) {
            current = tags[31:16];
        }
        bit<16> ahead = hdr.netagg.round - current;
        if (meta.down == 1) {
            /* A parent's result only reads: it is for the slot's current round, or it is OLD. */
            if (meta.stale == 0 && ahead == 0) {
                meta.round_state = ROUND_SAME;
            } else {
                meta.round_state = ROUND_OLD;
            }
        } else if (meta.stale == 1) {
            meta.round_state = ROUND_NEW;
            bit<16> behind = hdr.netagg.round - 2;
            if (hdr.netagg.pool == 0) {
                round_tags.write(meta.slot_index, behind ++ hdr.netagg.round);
            } else {
                round_tags.write(meta.slot_index, hdr.netagg.round ++ behind);
            }
        } else if (ahead == 0) {
            meta.round_state = ROUND_SAME;
        } else if (ahead[15:15] == 0) {
            meta.round_state = ROUND_NEW;
            if (hdr.netagg.pool == 0) {
                round_tags.write(meta.slot_index, tags[31:16] ++ hdr.netagg.round);
            } else {
                round_tags.write(meta.slot_index, hdr.netagg.round ++ tags[15:0]);
            }
        } else {
            meta.round_state = ROUND_OLD;
        }
    }
}

#endif
