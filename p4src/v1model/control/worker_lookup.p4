/* netagg: which job and worker sent this packet, and may it touch the slot it names?
 * jobs:    job id                          -> worker count, slot range, group, generation, width
 * workers: (job id, IPv4 source, UDP port, ingress port) -> rank and bitmap bit
 *          (the ingress port: a host cannot contribute under another host's address)
 * A miss, a width other than the job's (WRONG_WIDTH: a narrow job's slot must not reach into
 * its neighbour's cells by claiming to be wide), a slot outside the job's range, a pool other
 * than 0/1, a rank that differs from the sender's registered rank or a sender outside a subset
 * round's members sets meta.drop_reason. A parent's result coming down (meta.down,
 * tree_links.p4) only needs the job: it skips the workers table and the sender checks, not
 * the width and range checks.
 * slot_base is a cell index and slot_count counts the job's slots: job-relative slot s is the
 * cell slot_base + s (narrow) or slot_base + s * NETAGG_WIDE_CELLS (wide), whose pool index
 * (cell * NUM_POOLS + pool) keys every per-round register; value chunk c uses the next cells'. */
#ifndef _NETAGG_WORKER_LOOKUP_P4_
#define _NETAGG_WORKER_LOOKUP_P4_

control WorkerLookup(in headers_t hdr, in bit<9> ingress_port, inout metadata_t meta) {
    @id(0x01000001)
    action set_job(bit<8> num_workers, slot_index_t slot_base, bit<16> slot_count,
                   bit<16> mgid, bit<32> generation, bit<8> width) {
        meta.num_workers = num_workers;
        meta.slot_base = slot_base;
        meta.slot_count = slot_count;
        meta.mgid = mgid;
        meta.generation = generation;
        meta.width = width;
    }

    @id(0x01000002)
    action unknown_job() {
        meta.drop_reason = DROP_UNKNOWN_JOB;
    }

    @id(0x02000001)
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

    @id(0x01000003)
    action set_worker(bit<8> rank, worker_mask_t worker_mask) {
        meta.rank = rank;
        meta.worker_mask = worker_mask;
    }

    @id(0x01000004)
    action unknown_worker() {
        meta.drop_reason = DROP_UNKNOWN_WORKER;
    }

    @id(0x02000002)
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
        if (meta.drop_reason == DROP_NONE && meta.down == 0) {
            workers.apply();
        }
        if (meta.drop_reason == DROP_NONE) {
            if (hdr.netagg.width != meta.width) {
                meta.drop_reason = DROP_WRONG_WIDTH;
            } else if (hdr.netagg.slot >= meta.slot_count) {
                meta.drop_reason = DROP_SLOT_OUT_OF_RANGE;
            } else if (hdr.netagg.pool >= NUM_POOLS) {
                meta.drop_reason = DROP_BAD_POOL;
            } else if (meta.down == 1) {
                /* A parent's result (tree_links.p4): no sender rank or members to check. */
            } else if (hdr.netagg.rank != meta.rank) {
                meta.drop_reason = DROP_RANK_MISMATCH;
            } else if (hdr.netagg.members != 0 && (hdr.netagg.members & meta.worker_mask) == 0) {
                meta.drop_reason = DROP_NOT_A_MEMBER;
            }
        }
        if (meta.drop_reason == DROP_NONE) {
            slot_index_t cell = (slot_index_t)hdr.netagg.slot;
            if (meta.width == NETAGG_WIDTH_WIDE) {
                cell = cell * NETAGG_WIDE_CELLS;
            }
            meta.slot_index = meta.slot_base + cell;
            meta.pool_index = (meta.slot_index << 1) + (slot_index_t)hdr.netagg.pool;
        }
    }
}

#endif
