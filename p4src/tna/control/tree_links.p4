/* netagg (TNA): a switch in a tree of switches (docs/hierarchy.md); see
 * v1model/control/tree_links.p4 for the semantics, which are the same here. Same tables, keys,
 * actions and action parameters:
 * up_links:   job id                                  -> parent port, job, rank; parent MAC and address
 * down_links: (ingress port, IPv4 source, job id)     -> the local job id
 * Both tables are empty on a switch that is not part of a tree. What differs (docs/tofino.md,
 * "Tree paths"):
 * - DownLink runs in pass 1's first stage, only for a RESULT (as in the v1model program), and
 *   rewrites a parent's result's job id to the local job's at once, so that the jobs table
 *   (WorkerLookup) and the per-job counters use it; a result that is not accepted is dropped.
 * - UpLink runs for every packet, on the (local) job id; only the contribution path reads has_up
 *   (the v1model program does not look it up for a result from above, whose path never reads
 *   it).
 * - LevelState is one stateful ALU with four RegisterActions, chosen by one table from what the
 *   packet is; it returns the level the packet found where the ingress needs it.
 * - The up rewrite is split over the passes: UpDelivery (pass 1, once the recirc header is
 *   valid) writes the addresses, ports, parent job, rank and members, and the up port as the
 *   recirc header's port, from up_links' action data, which only pass 1 has; ResultDelivery's
 *   `up` and `up_resend` (the last pass) set the flags from the round flags that RoundFlags put
 *   in the packet, and remove the exponent's bias, as for a result. */
#ifndef _NETAGG_TNA_TREE_LINKS_P4_
#define _NETAGG_TNA_TREE_LINKS_P4_

control DownLink(inout tna_headers_t hdr, in port_t ingress_port, inout ingress_metadata_t meta) {
    action set_down_link(bit<16> job) {
        meta.down = 1;
        hdr.netagg.job_id = job;
    }

    action no_down_link() {
        meta.down = 0;
    }

    table down_links {
        key = {
            ingress_port: exact @name("ingress_port");
            hdr.ipv4.src_addr: exact @name("ipv4_src");
            hdr.netagg.job_id: exact @name("job_id");
        }
        actions = {
            set_down_link;
            @defaultonly no_down_link;
        }
        const default_action = no_down_link();
        size = TREE_LINK_TABLE_SIZE;
    }

    apply {
        if (hdr.netagg.isValid() && (hdr.netagg.flags & FLAG_RESULT) != 0) {
            /* Only a RESULT can be a parent's result (a contribution on the up port is not). */
            down_links.apply();
        }
    }
}

control UpLink(in tna_headers_t hdr, inout ingress_metadata_t meta) {
    action set_up_link(port_t port, bit<16> parent_job, bit<8> parent_rank, mac_addr_t parent_mac,
                       ipv4_addr_t parent_addr) {
        meta.has_up = 1;
        meta.up_port = (bit<16>)port;
        meta.up_job = parent_job;
        meta.up_rank = parent_rank;
        meta.up_mac = parent_mac;
        meta.up_addr = parent_addr;
    }

    action no_up_link() {
        meta.has_up = 0;
    }

    table up_links {
        key = {
            hdr.netagg.job_id: exact @name("job_id");
        }
        actions = {
            set_up_link;
            @defaultonly no_up_link;
        }
        const default_action = no_up_link();
        size = TREE_LINK_TABLE_SIZE;
    }

    apply {
        up_links.apply();
    }
}

/* Where a round of a (slot, pool) stands beyond this switch: OPEN, UP (complete here, the
 * partial sent to the parent) or FINAL (the parent's result stored); the v1model LevelState's
 * rules, as four RegisterActions of one 8-bit register per (slot, pool), one executed per packet:
 *   take_result (a parent's result for the slot's current round): UP becomes FINAL; returns the
 *                level found, and the ingress accepts the result iff that was UP;
 *   start_open  (a round's first contribution, unless start_up's): OPEN;
 *   start_up    (a round's first contribution that completes it, with an up link): UP, which is
 *                what the v1model program's reset to OPEN and then UP leaves;
 *   raise_level (a later packet of a complete round, not late, with an up link: the completing
 *                contribution, or a resend): UP unless FINAL; returns the level found, which
 *                decides whether a resend goes up again (not FINAL) or gets the stored result.
 * Every other packet leaves the level as it is (the v1model program writes back what it read),
 * so it does not access the register; meta.level then keeps OPEN, its parser value, which no
 * such packet reads (the v1model program reads meta.level only for a resend to a complete
 * round with an up link, which raise_level serves). The choice needs complete and late, which
 * come from the count (WorkerCount) one stage before; a parent's result skips the count. */
control LevelState(in tna_headers_t hdr, inout ingress_metadata_t meta) {
    Register<bit<8>, pool_reg_index_t>(NUM_POOL_SLOTS, LEVEL_OPEN) level_state;

    RegisterAction<bit<8>, pool_reg_index_t, bit<8>>(level_state) take_result = {
        void apply(inout bit<8> level, out bit<8> found) {
            found = level;
            if (level == LEVEL_UP) {
                level = LEVEL_FINAL;
            }
        }
    };
    RegisterAction<bit<8>, pool_reg_index_t, bit<8>>(level_state) start_open = {
        void apply(inout bit<8> level) {
            level = LEVEL_OPEN;
        }
    };
    RegisterAction<bit<8>, pool_reg_index_t, bit<8>>(level_state) start_up = {
        void apply(inout bit<8> level) {
            level = LEVEL_UP;
        }
    };
    RegisterAction<bit<8>, pool_reg_index_t, bit<8>>(level_state) raise_level = {
        void apply(inout bit<8> level, out bit<8> found) {
            found = level;
            if (level != LEVEL_FINAL) {
                level = LEVEL_UP;
            }
        }
    };

    action do_take_result() { meta.level = take_result.execute(POOL_INDEX); }
    action do_start_open() { start_open.execute(POOL_INDEX); }
    action do_start_up() { start_up.execute(POOL_INDEX); }
    action do_raise_level() { meta.level = raise_level.execute(POOL_INDEX); }

    /* The rules above as one table (in this order). */
    table level_access {
        key = {
            meta.down: ternary;
            meta.first: ternary;
            meta.has_up: ternary;
            meta.complete: ternary;
            meta.late: ternary;
        }
        actions = { do_take_result; do_start_open; do_start_up; do_raise_level; NoAction; }
        const entries = {
            (1, _, _, _, _): do_take_result();
            (0, 1, 1, 1, _): do_start_up();
            (0, 1, _, _, _): do_start_open();
            (0, 0, 1, 1, 0): do_raise_level();
        }
        const default_action = NoAction();
        size = 4;
    }

    apply {
        level_access.apply();
    }
}

/* Pass 1: a completed partial (or its resend) becomes a contribution to the parent: from the
 * address and MAC the workers sent to and the tree port, to the parent's netagg port, with the
 * parent's job id and this switch's rank there, members 0; the recirc header's port becomes the
 * up port, which ResultRelease sends it out of after the last pass. Slot, pool, round, seq and
 * exchange stay; the values come in passes 2 and 3, the flags and exponent in ResultDelivery's
 * `up` actions. Applied once the recirc header is valid. */
control UpDelivery(inout tna_headers_t hdr, in ingress_metadata_t meta) {
    apply {
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = meta.up_mac;
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.ipv4.dst_addr = meta.up_addr;
        hdr.ipv4.ttl = RESULT_TTL;
        hdr.udp.src_port = NETAGG_TREE_UDP_PORT;
        hdr.udp.dst_port = NETAGG_UDP_PORT;
        hdr.udp.checksum = 0;
        hdr.netagg.job_id = meta.up_job;
        hdr.netagg.rank = meta.up_rank;
        hdr.netagg.members = 0;
        hdr.recirc.port = meta.up_port;
    }
}

#endif
