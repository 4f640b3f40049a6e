/* netagg: everything that is not netagg (PS traffic, control, baselines) is
 * routed by longest prefix on the IPv4 destination. TTL is decremented on
 * packets without options (whose checksum the deparser recomputes). */
#ifndef _NETAGG_IPV4_FORWARD_P4_
#define _NETAGG_IPV4_FORWARD_P4_

control Ipv4Forward(inout headers_t hdr, inout metadata_t meta,
                    inout standard_metadata_t standard_metadata) {
    @id(0x01000007)
    action forward(port_t port, mac_addr_t dst_mac) {
        standard_metadata.egress_spec = port;
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = dst_mac;
    }

    @id(0x01000008)
    action no_route() {
        meta.drop_reason = DROP_NO_ROUTE;
    }

    @id(0x02000004)
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
        } else {
            routes.apply();
            if (hdr.ipv4.ihl == 5) {
                hdr.ipv4.ttl = hdr.ipv4.ttl - 1;
            }
        }
    }
}

#endif
