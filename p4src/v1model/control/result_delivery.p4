/* netagg: where a result goes.
 * Ingress (ResultDelivery): a completed round goes to the job's multicast group;
 *   a retransmission that finds the round complete gets the result back, unicast
 *   to its sender. Either way the packet becomes a RESULT from the aggregator
 *   address the workers sent to.
 * Egress (ResultRewrite): every replica of a group copy gets the destination MAC,
 *   IPv4 address and UDP port of its receiver from replicas[(mgid, rid)]; with the
 *   group holding only a parameter server, this forwards the aggregate to the PS. */
#ifndef _NETAGG_RESULT_DELIVERY_P4_
#define _NETAGG_RESULT_DELIVERY_P4_

control ResultDelivery(inout headers_t hdr, inout metadata_t meta,
                       inout standard_metadata_t standard_metadata) {
    apply {
        mac_addr_t sender_mac = hdr.ethernet.src_addr;
        ipv4_addr_t sender_addr = hdr.ipv4.src_addr;
        bit<16> sender_port = hdr.udp.src_port;
        /* The result comes from the aggregator address the sender used. */
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.udp.src_port = NETAGG_UDP_PORT;
        hdr.ipv4.ttl = RESULT_TTL;
        hdr.udp.checksum = 0;
        hdr.netagg.flags = hdr.netagg.flags | FLAG_RESULT;
        if (meta.to_group == 1) {
            standard_metadata.mcast_grp = meta.mgid;
        } else {
            hdr.ethernet.dst_addr = sender_mac;
            hdr.ipv4.dst_addr = sender_addr;
            hdr.udp.dst_port = sender_port;
            standard_metadata.egress_spec = standard_metadata.ingress_port;
        }
    }
}

control ResultRewrite(inout headers_t hdr, inout metadata_t meta,
                      inout standard_metadata_t standard_metadata) {
    @id(0x01000005)
    action set_destination(mac_addr_t dst_mac, ipv4_addr_t dst_addr, bit<16> dst_port) {
        hdr.ethernet.dst_addr = dst_mac;
        hdr.ipv4.dst_addr = dst_addr;
        hdr.udp.dst_port = dst_port;
    }

    @id(0x01000006)
    action no_replica() {
        meta.drop_reason = DROP_NO_REPLICA;
    }

    @id(0x02000003)
    table replicas {
        key = {
            meta.mgid: exact @name("mgid");
            standard_metadata.egress_rid: exact @name("rid");
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
