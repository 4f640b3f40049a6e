/* netagg: a switch in a tree of switches (docs/hierarchy.md).
 * A job's segment on a switch that is not the root of the job's tree has an up link: when a
 * round completes here, the partial sum goes to the parent switch as one contribution, not
 * to the local group. The parent needs nothing new: to it this switch is a worker (its
 * workers and sources tables name this switch's address, UDP port and the port it hangs off).
 * The parent's result comes back down as a RESULT from the parent's address on the up port,
 * which down_links maps to the local job; it is stored in the slot (LevelState) and sent to
 * the local group. Up packets leave from NETAGG_TREE_UDP_PORT, so the parent's results (to the
 * group's replicas, or back to a resend's sender) come to that port, which the parser takes for
 * netagg packets too.
 * up_links:   job id                                  -> parent port, job, rank; parent MAC and address
 * down_links: (ingress port, IPv4 source, job id)     -> the local job id
 * Both tables are empty on a switch that is not part of a tree. */
#ifndef _NETAGG_TREE_LINKS_P4_
#define _NETAGG_TREE_LINKS_P4_

control DownLink(in headers_t hdr, in bit<9> ingress_port, inout metadata_t meta) {
    @id(0x0100000f)
    action set_down_link(bit<16> job) {
        meta.down = 1;
        meta.down_job = job;
    }

    @id(0x01000010)
    action no_down_link() {
        meta.down = 0;
    }

    @id(0x02000006)
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
        down_links.apply();
    }
}

control UpLink(in headers_t hdr, inout metadata_t meta) {
    @id(0x01000011)
    action set_up_link(port_t port, bit<16> parent_job, bit<8> parent_rank, mac_addr_t parent_mac,
                       ipv4_addr_t parent_addr) {
        meta.has_up = 1;
        meta.up_port = port;
        meta.up_job = parent_job;
        meta.up_rank = parent_rank;
        meta.up_mac = parent_mac;
        meta.up_addr = parent_addr;
    }

    @id(0x01000012)
    action no_up_link() {
        meta.has_up = 0;
    }

    @id(0x02000007)
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

/* Where a round of a (slot, pool) stands beyond this switch: OPEN (collecting, or complete on
 * a switch without an up link), UP (complete here, the partial sent to the parent, its result
 * not yet back) or FINAL (the parent's result stored in the slot). A round's first contribution
 * opens it; its completion on a switch with an up link makes it UP; the parent's result for
 * the same round turns UP into FINAL (meta.down_accepted). meta.level is the state the packet
 * found (after the reset of a new round). */
control LevelState(inout metadata_t meta) {
    @id(0x16000008)
    register<bit<8>>(NUM_POOL_SLOTS) level_state;

    apply {
        bit<8> level;
        level_state.read(level, meta.pool_index);
        if (meta.first == 1) {
            level = LEVEL_OPEN;
        }
        meta.level = level;
        meta.down_accepted = 0;
        if (meta.down == 1) {
            if (level == LEVEL_UP) {
                level = LEVEL_FINAL;
                meta.down_accepted = 1;
            }
        } else if (meta.has_up == 1 && meta.complete == 1 && meta.late == 0 && level != LEVEL_FINAL) {
            level = LEVEL_UP;
        }
        level_state.write(meta.pool_index, level);
    }
}

/* A completed partial (or its resend) becomes a contribution to the parent: from the address
 * and MAC the workers sent to and the tree port, to the parent's netagg port,
 * with the parent's job id and this switch's rank there, out of the up port. Slot, pool,
 * round, seq and exchange stay; the exponent, values and round flags are the slot's (ExponentMax,
 * ValueSum, RoundFlags); members 0, and of the other flags only RETRANSMIT on a resend. */
control UpDelivery(inout headers_t hdr, in metadata_t meta,
                   inout standard_metadata_t standard_metadata) {
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
        /* The round's flags (RoundFlags put them in the packet), and RETRANSMIT on a resend. */
        if (meta.fresh == 1) {
            hdr.netagg.flags = hdr.netagg.flags & ROUND_FLAGS;
        } else {
            hdr.netagg.flags = (hdr.netagg.flags & ROUND_FLAGS) | FLAG_RETRANSMIT;
        }
        standard_metadata.egress_spec = meta.up_port;
    }
}

#endif
