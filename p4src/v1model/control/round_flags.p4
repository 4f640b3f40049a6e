/* netagg: the round flags of a slot's round (ROUND_FLAGS: NaN, +inf, -inf, out of step), the OR
 * over its contributions, returned with its state (docs/protocol.md, "Round flags"), and
 * FLAG_CLOSE once the round was closed at a deadline (docs/protocol.md, "Closing a round at a
 * deadline"). Applied twice: first with meta.close_check = 1 (CloseCheck, before BitmapCheck:
 * only reads; meta.closed says whether the packet's SAME round was closed), then with
 * close_check = 0, with the value operation (meta.value_op), like ExponentMax:
 *   write: the round's first contribution, or a parent's accepted result coming down, stores its
 *          flags & ROUND_FLAGS;
 *   merge: a new contribution ORs its flags & ROUND_FLAGS in;
 *   read / none: the register only reads.
 * A new contribution of another collective (meta.exchange_mismatch, fresh and not late; its value
 * operation is none, or read if it completes the round) ORs FLAG_OUT_OF_STEP in instead of its own
 * flags. A close request that completes the round (meta.closes) adds FLAG_CLOSE (a new round's
 * write clears it). Every packet leaves with flags = (flags & ~STORED_FLAGS) | the register's new
 * value, so that a result to the group or to a sender, a partial up to the parent and its resend
 * carry the round's flags (UpDelivery keeps the ROUND_FLAGS). Congestion marks (docs/protocol.md,
 * "Congestion marks"): a packet that changes the register and arrived ECN CE also stores ROUND_CE,
 * and every packet that leaves with the round's state leaves CE-marked when it is stored. */
#ifndef _NETAGG_ROUND_FLAGS_P4_
#define _NETAGG_ROUND_FLAGS_P4_

control RoundFlags(inout headers_t hdr, inout metadata_t meta) {
    @id(0x1600000a)
    register<bit<8>>(NUM_POOL_SLOTS) round_flags;

    apply {
        bit<8> stored;
        round_flags.read(stored, meta.pool_index);
        if (meta.close_check == 1) {
            meta.stored_flags = stored;
            if (meta.round_state == ROUND_SAME && (stored & FLAG_CLOSE) != 0) {
                meta.closed = 1;
            } else {
                meta.closed = 0;
            }
            return;
        }
        bit<8> mark = 0;
        if (hdr.ipv4.diffserv[1:0] == ECN_CE) {
            mark = ROUND_CE;
        }
        if (meta.exchange_mismatch == 1 && meta.fresh == 1 && meta.late == 0) {
            stored = stored | FLAG_OUT_OF_STEP | mark;
            round_flags.write(meta.pool_index, stored);
        } else if (meta.value_op == OP_WRITE) {
            stored = (hdr.netagg.flags & ROUND_FLAGS) | mark;
            round_flags.write(meta.pool_index, stored);
        } else if (meta.value_op == OP_MERGE) {
            stored = stored | (hdr.netagg.flags & ROUND_FLAGS) | mark;
            round_flags.write(meta.pool_index, stored);
        }
        if (meta.closes == 1) {
            stored = stored | FLAG_CLOSE;
            round_flags.write(meta.pool_index, stored);
        }
        hdr.netagg.flags = (hdr.netagg.flags & ~((bit<8>)STORED_FLAGS)) | (stored & STORED_FLAGS);
        if ((stored & ROUND_CE) != 0) {
            hdr.ipv4.diffserv[1:0] = ECN_CE;
        }
    }
}

#endif
