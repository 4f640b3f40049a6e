/* netagg (TNA): where a result goes; see v1model/control/result_delivery.p4.
 * Ingress (ResultDelivery): the packet becomes a RESULT from the aggregator address; a
 *   completed round goes to the job's multicast group, a resend that finds the round complete
 *   goes back to its sender. When the sums still miss their high words (merge or read), the
 *   packet first recirculates once with a recirc header saying where it goes (pass 2).
 * Egress (ResultRewrite): each replica of a group copy gets its receiver's MAC, IPv4 address
 *   and UDP port from replicas[(mgid, rid)]; mgid comes bridged from ingress. */
#ifndef _NETAGG_TNA_RESULT_DELIVERY_P4_
#define _NETAGG_TNA_RESULT_DELIVERY_P4_

control ResultDelivery(inout tna_headers_t hdr, inout ingress_metadata_t meta,
                       in ingress_intrinsic_metadata_t ig_intr_md,
                       inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
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
        if (meta.to_group == 0) {
            hdr.ethernet.dst_addr = sender_mac;
            hdr.ipv4.dst_addr = sender_addr;
            hdr.udp.dst_port = sender_port;
        }
        if (meta.recirculate == 1) {
            hdr.recirc.setValid();
            hdr.recirc.to_group = (bit<16>)meta.to_group;
            hdr.recirc.mgid = meta.mgid;
            hdr.recirc.port = (bit<16>)ig_intr_md.ingress_port;
            hdr.recirc.slot_index = (bit<16>)meta.pool_index[11:0];
            hdr.recirc.pool = (bit<16>)meta.pool_index[12:12];
            ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port[8:7] ++ (bit<7>)RECIRC_PORT_LOCAL;
        } else if (meta.to_group == 1) {
            ig_tm_md.mcast_grp_a = meta.mgid;
            hdr.bridge.to_group = 1;
            hdr.bridge.mgid = meta.mgid;
        } else {
            ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port;
        }
    }
}

/* Pass 2: the high words are in the packet now; send it where pass 1 decided. */
control ResultRelease(inout tna_headers_t hdr, inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    apply {
        if (hdr.recirc.to_group != 0) {
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
