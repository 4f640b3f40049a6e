/* netagg (TNA): which job and worker sent this packet, and may it touch the slot it names?
 * Same tables as v1model/control/worker_lookup.p4. Both lookups run unconditionally and only
 * set their own outputs (hits, action data, the absolute slot and the slot's room); the
 * ingress's checks table turns misses and mismatches into drop reasons. Both are keyed by the
 * packet's job id, which DownLink rewrites to the local job's for a parent's result coming down
 * (as the v1model program does before its jobs lookup), so they run one stage after down_links.
 * A parent's result needs only the job: the checks ignore the worker miss and the sender checks
 * for it (meta.down), as the v1model program skips them. The jobs action writes the recirc
 * header's mgid and absolute slot directly (no metadata copy), and the worker action takes
 * members & worker_mask into sender_seen (free until BitmapCheck's stage).
 * The range test is a subtraction whose sign a gateway reads (a gateway compares two fields
 * for equality, not order); with slot < NUM_SLOTS (which the controller's slot_base +
 * slot_count <= NUM_SLOTS implies) 16 bits hold it. A subset round's sender outside its members
 * is flagged (meta.not_member) from members & worker_mask. Registers are indexed pool * NUM_SLOTS +
 * slot here (v1model: slot * NUM_POOLS + pool): that layout needs no shift.
 * The jobs entry carries the job's width (set_job's last parameter, as in the P4Info); a packet
 * whose width is not its job's is flagged (meta.wrong_width) and refused as WRONG_WIDTH. A slot's
 * state is at cell slot_base + slot for both widths; a wide slot's four chunks of values are at
 * that cell plus 0, 1, 2 and 3 times the job's slot count (the recirc header's stride), inside
 * the job's slot_base + 4 * slot_count cells as the v1model program's slot_base + 4 * slot + c
 * (docs/tofino.md, "Wide packets"). */
#ifndef _NETAGG_TNA_WORKER_LOOKUP_P4_
#define _NETAGG_TNA_WORKER_LOOKUP_P4_

control WorkerLookup(inout tna_headers_t hdr, in port_t ingress_port, inout ingress_metadata_t meta) {
    action set_job(bit<8> num_workers, slot_index_t slot_base, bit<16> slot_count,
                   bit<16> mgid, bit<32> generation, bit<8> width) {
        meta.job_hit = 1;
        meta.num_workers = num_workers;
        hdr.recirc.mgid = mgid;
        meta.generation = generation;
        meta.job_width = width;
        hdr.recirc.reg_index = slot_base[15:0] + hdr.netagg.slot;
        hdr.recirc.stride = slot_count;
        meta.slot_room = slot_count - hdr.netagg.slot;
    }

    action unknown_job() {
        meta.job_hit = 0;
    }

    table jobs {
        key = {
            hdr.netagg.job_id: exact @name("job_id");
        }
        actions = {
            set_job;
            @defaultonly unknown_job;
        }
        const default_action = unknown_job();
        size = JOB_TABLE_SIZE;
    }

    action set_worker(bit<8> rank, worker_mask_t worker_mask) {
        meta.worker_hit = 1;
        meta.rank = rank;
        meta.worker_mask = worker_mask;
        meta.sender_seen = hdr.netagg.members & worker_mask;
    }

    action unknown_worker() {
        meta.worker_hit = 0;
    }

    table workers {
        key = {
            hdr.netagg.job_id: exact @name("job_id");
            hdr.ipv4.src_addr: exact @name("ipv4_src");
            hdr.udp.src_port: exact @name("udp_src");
            ingress_port: exact @name("ingress_port");
        }
        actions = {
            set_worker;
            @defaultonly unknown_worker;
        }
        const default_action = unknown_worker();
        size = WORKER_TABLE_SIZE;
    }

    apply {
        jobs.apply();
        workers.apply();
        if (hdr.netagg.slot[15:12] != 0 || meta.slot_room[15:15] == 1 || meta.slot_room == 0) {
            meta.slot_out_of_range = 1;
        }
        /* A packet of another width than its job's is WRONG_WIDTH. */
        if (hdr.netagg.width != meta.job_width) {
            meta.wrong_width = 1;
        }
        if (hdr.netagg.rank != meta.rank) {
            meta.rank_mismatch = 1;
        }
        if (hdr.netagg.members != 0 && meta.sender_seen == 0) {
            meta.not_member = 1;
        }
        /* The absolute slot is < NUM_SLOTS (4096) where a register is touched: its bit 12 takes the
         * pool (one deposit; a concatenation is two instructions). */
        hdr.recirc.reg_index[12:12] = hdr.netagg.pool[0:0];
    }
}

#endif
