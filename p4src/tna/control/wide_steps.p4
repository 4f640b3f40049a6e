/* netagg (TNA): a wide packet's next pass (docs/tofino.md, "Wide packets"). Applied after the
 * value pairs of every pass but a wide packet's last (recirc_h.step != 0, != WIDE_STEP_LAST).
 * A Tofino 1 stateful ALU touches one register index per pass, and a wide slot's 256 values
 * are four cells: one chunk per pass, at cell + c * stride (WorkerLookup). The pairs of steps
 * 1 .. 4 write, add or read the chunk the parser extracted, which is then left out of the
 * packet. A packet that leaves with the sums reads them back in steps 8 .. 15, one half of a
 * chunk per pass, from the last cell to the first: each half goes in front of those read
 * before, so the packet leaves with chunk 0's low and high words, then chunk 1's, and so on,
 * the wire's order. */
#ifndef _NETAGG_TNA_WIDE_STEPS_P4_
#define _NETAGG_TNA_WIDE_STEPS_P4_

control WideStep(inout tna_headers_t hdr) {
    /* Chunks 0 .. 2 done: the next chunk's cell. */
    action next_chunk(bit<8> step) {
        hdr.values_lo.setInvalid();
        hdr.values_hi.setInvalid();
        hdr.recirc.step = step;
        hdr.recirc.reg_index = hdr.recirc.reg_index + hdr.recirc.stride;
    }

    /* Chunk 3 done (an absorbed contribution was dropped in this pass): the read passes start at
     * the cell it left, chunk 3's. */
    action chunks_done() {
        hdr.values_lo.setInvalid();
        hdr.values_hi.setInvalid();
        hdr.recirc.step = WIDE_STEP_READ_FIRST;
        hdr.recirc.value_op = OP_READ_HI;
    }

    /* A chunk's high words read: its low words next. */
    action low_half(bit<8> step) {
        hdr.recirc.step = step;
        hdr.recirc.value_op = OP_READ;
    }

    /* A chunk's low words read: the previous chunk's high words next. */
    action previous_chunk(bit<8> step) {
        hdr.recirc.step = step;
        hdr.recirc.value_op = OP_READ_HI;
        hdr.recirc.reg_index = hdr.recirc.reg_index - hdr.recirc.stride;
    }

    table wide_next {
        key = {
            hdr.recirc.step: exact @name("step");
        }
        actions = { next_chunk; chunks_done; low_half; previous_chunk; NoAction; }
        const entries = {
            1: next_chunk(2);
            2: next_chunk(3);
            3: next_chunk(WIDE_STEP_CHUNK_3);
            WIDE_STEP_CHUNK_3: chunks_done();
            WIDE_STEP_READ_FIRST: low_half(9);
            9: previous_chunk(10);
            10: low_half(11);
            11: previous_chunk(12);
            12: low_half(13);
            13: previous_chunk(14);
            14: low_half(WIDE_STEP_LAST);
        }
        const default_action = NoAction();
        size = 16;
    }

    apply {
        wide_next.apply();
    }
}

#endif
