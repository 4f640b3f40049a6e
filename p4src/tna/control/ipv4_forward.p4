/* netagg (TNA): everything that is not netagg is routed by longest prefix on the IPv4
 * destination; see v1model/control/ipv4_forward.p4. */
#ifndef _NETAGG_TNA_IPV4_FORWARD_P4_
#define _NETAGG_TNA_IPV4_FORWARD_P4_

control Ipv4Forward(inout tna_headers_t hdr, inout ingress_metadata_t meta,
                    inout ingress_intrinsic_metadata_for_tm_t ig_tm_md,
                    inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    action forward(port_t port, mac_addr_t dst_mac) {
        ig_tm_md.ucast_egress_port = port;
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = dst_mac;
    }

    action no_route() {
        meta.drop_reason = DROP_NO_ROUTE;
        ig_dprsr_md.drop_ctl = 1;
    }

    table routes {
        key = {
            hdr.ipv4.dst_addr: lpm @name("ipv4_dst");
        }
        actions = {
            forward;
            @defaultonly no_route;
        }
        const default_action = no_route();
        size = IPV4_TABLE_SIZE;
    }

    apply {
        if (hdr.ipv4.ttl <= 1) {
            meta.drop_reason = DROP_TTL_EXPIRED;
            ig_dprsr_md.drop_ctl = 1;
        } else {
            routes.apply();
            if (hdr.ipv4.ihl == 5) {
                hdr.ipv4.ttl = hdr.ipv4.ttl - 1;
            }
        }
    }
}

#endif
