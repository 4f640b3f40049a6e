/* netagg (TNA): where a result goes; see v1model/control/result_delivery.p4.
 * Ingress, last pass (ResultDelivery): a completed round's packet becomes a RESULT from the
 *   aggregator address (for the job's group, or back to a resending sender).
 * Ingress, pass 1 and 2 (Recirculate): the packet goes to its pipe's recirculation port with
 *   a recirc header saying what the value pairs do next and where it goes afterwards.
 * Ingress, last pass (ResultRelease): the sums are complete; send the packet where pass 1 said
 *   (for a partial going up the tree: out of the up port, see tree_links.p4).
 * Egress (ResultRewrite): each replica of a group copy gets its receiver's MAC, IPv4 address
 *   and UDP port from replicas[(mgid, rid)]; mgid comes bridged from ingress. */
#ifndef _NETAGG_TNA_RESULT_DELIVERY_P4_
#define _NETAGG_TNA_RESULT_DELIVERY_P4_

control ResultDelivery(inout tna_headers_t hdr) {
    apply {
        mac_addr_t sender_mac = hdr.ethernet.src_addr;
        ipv4_addr_t sender_addr = hdr.ipv4.src_addr;
        bit<16> sender_port = hdr.udp.src_port;
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.udp.src_port = NETAGG_UDP_PORT;
        hdr.ipv4.ttl = RESULT_TTL;
        hdr.udp.checksum = 0;
        hdr.netagg.flags = hdr.netagg.flags | FLAG_RESULT;
        /* The exponent register's biased value, unbiased once, here (see ExponentMax). */
        hdr.netagg.exponent = hdr.netagg.exponent + 8s0x40 + 8s0x40;
        if (hdr.recirc.deliver == DELIVER_SENDER) {
            hdr.ethernet.dst_addr = sender_mac;
            hdr.ipv4.dst_addr = sender_addr;
            hdr.udp.dst_port = sender_port;
        }
    }
}

/* The recirc header's addressing fields, written early in pass 1 whatever becomes of the
 * packet (they only leave the switch's pipeline if Recirculate makes the header valid). */
control RecircPrepare(inout tna_headers_t hdr, in ingress_metadata_t meta, in port_t ingress_port) {
    apply {
        hdr.recirc.mgid = meta.mgid;
        hdr.recirc.port = (bit<16>)ingress_port;
        hdr.recirc.slot_index = meta.slot_index;
        hdr.recirc.pool = (bit<16>)hdr.netagg.pool;
    }
}

control Recirculate(inout tna_headers_t hdr, in ingress_metadata_t meta,
                    in ingress_intrinsic_metadata_t ig_intr_md,
                    inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    apply {
        hdr.recirc.setValid();
        hdr.recirc.value_op = (bit<16>)meta.value_op;
        /* to_group first: a parent's accepted result (tree_links.p4) goes to the group without
         * completing anything here; a completed round's packet has to_group or to_up set, or is a
         * resend's answer. */
        if (meta.to_group == 1) {
            hdr.recirc.deliver = DELIVER_GROUP;
        } else if (meta.to_up == 1) {
            if (meta.fresh == 1) {
                hdr.recirc.deliver = DELIVER_UP;
            } else {
                hdr.recirc.deliver = DELIVER_UP_RESEND;
            }
        } else if (meta.complete == 0) {
            hdr.recirc.deliver = DELIVER_NONE;
        } else {
            hdr.recirc.deliver = DELIVER_SENDER;
        }
        ig_tm_md.ucast_egress_port = RECIRC_PORT_OF(ig_intr_md.ingress_port);
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
