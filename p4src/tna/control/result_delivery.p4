/* netagg (TNA): where a result goes; see v1model/control/result_delivery.p4.
 * Ingress, pass 1: the recirc header's addressing fields early (RecircPrepare); the decision
 *   sets its operation and destination, and a packet that goes on recirculates to its pipe's
 *   recirculation port (set at the start of pass 1) with the header made valid.
 * Ingress, every later pass (ResultDelivery, one table): absorbed, once more (a narrow packet's
 *   high words, a wide packet's next chunk or half: WideStep), or the last pass: a completed
 *   round's packet becomes a RESULT from the aggregator address (for the job's group, or back to
 *   a resending sender), or a partial for the parent. A pass whose parser failed (a wide packet
 *   shorter than its lengths say, which the first arrival's probe already refuses) is dropped as
 *   MALFORMED.
 * Ingress, last pass, after the value pairs (ResultRelease): send the packet where pass 1 said
 *   (for a partial going up the tree: out of the up port, see tree_links.p4).
 * Egress (ResultRewrite): each replica of a group copy gets its receiver's MAC, IPv4 address
 *   and UDP port from replicas[(mgid, rid)]; mgid comes bridged from ingress. */
#ifndef _NETAGG_TNA_RESULT_DELIVERY_P4_
#define _NETAGG_TNA_RESULT_DELIVERY_P4_

control ResultDelivery(inout tna_headers_t hdr, inout ingress_metadata_t meta,
                       in ingress_intrinsic_metadata_t ig_intr_md,
                       in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                       inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                       inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    /* A contribution absorbed into the slot. */
    action absorb() {
        ig_dprsr_md.drop_ctl = 1;
    }

    /* The low words are in; once more for the high words, back where it came from: the pipe's
     * recirculation port (a copy: RECIRC_PORT_OF's concatenation takes two instructions). */
    action again() {
        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port;
    }

    /* A wide result's read pass: once more, with the half this pass reads in front of the payload. */
    action again_high() {
        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port;
        hdr.values_hi.setValid();
    }
    action again_low() {
        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port;
        hdr.values_lo.setValid();
    }

    /* The parser failed (no entry matches): dropped, and the value pairs left alone. */
    action malformed() {
        ig_dprsr_md.drop_ctl = 1;
        meta.drop_reason = DROP_MALFORMED;
        hdr.recirc.value_op = OP_NONE;
    }

    /* A RESULT from the aggregator address, to the job's group (the egress rewrites each copy's
     * destination) or back to a resending sender; or a partial for the parent (DELIVER_UP, or
     * DELIVER_UP_RESEND for a resend; UpDelivery rewrote its addresses in pass 1). Each is one
     * action, so a swap's old values are read in the same VLIW step as they are overwritten (no
     * PHV for temporaries), and each has a twin (`_ce`) that also marks the packet CE: merge_flags
     * left the round's ROUND_CE in the flags' RESULT bit in pass 1 (a parent's result cleared its
     * own there). The exponent register's biased value is unbiased once, here (see ExponentMax).
     * The TTL is set here, so the last pass recomputes the IPv4 checksum (a unicast packet's
     * egress does not parse IPv4). A partial keeps, of the flags, the round's (RoundFlags put them
     * in the packet in pass 1), with RETRANSMIT on a resend and no RESULT: the round's bits
     * deposited into a constant, one instruction (see the flags' split in netagg.p4). The low words'
     * half is made valid: a wide result's last pass reads chunk 0's into it (a narrow one has it). */
#define RESULT_HEADER                                                                       \
        hdr.values_lo.setValid();                                                           \
        hdr.ipv4.ttl = RESULT_TTL;                                                          \
        hdr.udp.checksum = 0;                                                               \
        hdr.netagg.flags = hdr.netagg.flags | FLAG_RESULT;                                  \
        hdr.netagg.exponent = hdr.netagg.exponent + 8s0x40 + 8s0x40;                        \
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;                                      \
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;                                              \
        hdr.udp.src_port = NETAGG_UDP_PORT;                                                 \
        meta.update_checksum = 1;
#define TO_SENDER                                                                           \
        mac_addr_t sender_mac = hdr.ethernet.src_addr;                                      \
        ipv4_addr_t sender_addr = hdr.ipv4.src_addr;                                        \
        bit<16> sender_port = hdr.udp.src_port;                                             \
        RESULT_HEADER                                                                       \
        hdr.ethernet.dst_addr = sender_mac;                                                 \
        hdr.ipv4.dst_addr = sender_addr;                                                    \
        hdr.udp.dst_port = sender_port;
#define PARTIAL_UP(low_flags)                                                               \
        hdr.values_lo.setValid();                                                           \
        hdr.netagg.exponent = hdr.netagg.exponent + 8s0x40 + 8s0x40;                        \
        hdr.netagg.flags = 1w0 ++ hdr.netagg.flags[6:3] ++ low_flags;                       \
        meta.update_checksum = 1;
    action to_group() { RESULT_HEADER }
    action to_group_ce() { RESULT_HEADER hdr.ipv4.diffserv[1:0] = ECN_CE; }
    action to_sender() { TO_SENDER }
    action to_sender_ce() { TO_SENDER hdr.ipv4.diffserv[1:0] = ECN_CE; }
    action up() { PARTIAL_UP(3w0b000) }
    action up_ce() { PARTIAL_UP(3w0b000) hdr.ipv4.diffserv[1:0] = ECN_CE; }
    action up_resend() { PARTIAL_UP(3w0b010) }
    action up_resend_ce() { PARTIAL_UP(3w0b010) hdr.ipv4.diffserv[1:0] = ECN_CE; }

    /* Every pass after the first: one table instead of a branch per case (a logical table each,
     * in the stages the value pairs need). It is applied before the value pairs: only its
     * malformed() changes their operation. Every entry wants no parser error. A wide packet's
     * steps (tna/defines.p4) come first; a delivery is a narrow packet's last pass (step 0) or a
     * wide one's (WIDE_STEP_LAST). */
    table delivery {
        key = {
            hdr.recirc.deliver: ternary @name("deliver");
            hdr.recirc.value_op: ternary @name("value_op");
            hdr.netagg.flags[0:0]: ternary @name("round_ce");
            hdr.recirc.step: ternary @name("step");
            ig_prsr_md.parser_err: ternary @name("parser_err");
        }
        actions = { absorb; again; again_high; again_low; malformed; to_group; to_group_ce; to_sender;
                    to_sender_ce; up; up_ce; up_resend; up_resend_ce; }
        const entries = {
            /* A wide packet's chunks 0 .. 3; an absorbed one ends with the last. */
            (_, _, _, 1, 0): again();
            (_, _, _, 2, 0): again();
            (_, _, _, 3, 0): again();
            (DELIVER_NONE, _, _, WIDE_STEP_CHUNK_3, 0): absorb();
            (_, _, _, WIDE_STEP_CHUNK_3, 0): again();
            /* A wide result's read steps but the last: 8, 10, 12, 14 high words; 9, 11, 13 low. */
            (_, _, _, 8 &&& 0xf9, 0): again_high();
            (_, _, _, 9, 0): again_low();
            (_, _, _, 11, 0): again_low();
            (_, _, _, 13, 0): again_low();
            /* A narrow packet's second pass. */
            (DELIVER_NONE, _, _, 0, 0): absorb();
            (_, OP_MERGE, _, 0, 0): again();
            (_, OP_READ, _, 0, 0): again();
            /* The last pass: a narrow packet's (step 0), or a wide one's (WIDE_STEP_LAST). */
            (DELIVER_GROUP, _, 0, _, 0): to_group();
            (DELIVER_GROUP, _, 1, _, 0): to_group_ce();
            (DELIVER_SENDER, _, 0, _, 0): to_sender();
            (DELIVER_SENDER, _, 1, _, 0): to_sender_ce();
            (DELIVER_UP, _, 0, _, 0): up();
            (DELIVER_UP, _, 1, _, 0): up_ce();
            (DELIVER_UP_RESEND, _, 0, _, 0): up_resend();
            (DELIVER_UP_RESEND, _, 1, _, 0): up_resend_ce();
        }
        const default_action = malformed();
        size = 32;
    }

    apply {
        delivery.apply();
    }
}

/* The recirc header's addressing fields, written early in pass 1 whatever becomes of the
 * packet (they only leave the switch's pipeline if the header is made valid). The jobs table's
 * action writes its mgid and reg_index (WorkerLookup). */
control RecircPrepare(inout tna_headers_t hdr, in port_t ingress_port) {
    apply {
        /* A slice (one instruction; a zero-extending copy is two): the last pass reads only these
         * bits (as PortId_t). */
        hdr.recirc.port[8:0] = ingress_port;
    }
}

control ResultRelease(inout tna_headers_t hdr, inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    apply {
        if (hdr.recirc.deliver == DELIVER_GROUP) {
            ig_tm_md.mcast_grp_a = hdr.recirc.mgid;
            hdr.bridge.to_group = 1;
            hdr.bridge.mgid = hdr.recirc.mgid;
        } else {
            ig_tm_md.ucast_egress_port = (PortId_t)hdr.recirc.port;
        }
        hdr.recirc.setInvalid();
    }
}

control ResultRewrite(inout tna_headers_t hdr, inout egress_metadata_t meta,
                      in egress_intrinsic_metadata_t eg_intr_md) {
    action set_destination(mac_addr_t dst_mac, ipv4_addr_t dst_addr, bit<16> dst_port) {
        hdr.ethernet.dst_addr = dst_mac;
        hdr.ipv4.dst_addr = dst_addr;
        hdr.udp.dst_port = dst_port;
    }

    action no_replica() {
        meta.drop_reason = DROP_NO_REPLICA;
    }

    table replicas {
        key = {
            hdr.bridge.mgid: exact @name("mgid");
            eg_intr_md.egress_rid: exact @name("rid");
        }
        actions = {
            set_destination;
            @defaultonly no_replica;
        }
        const default_action = no_replica();
        size = REPLICA_TABLE_SIZE;
    }

    apply {
        replicas.apply();
    }
}

#endif
