/* netagg: results come only from the switch.
 * A host's packet whose UDP source port is the netagg port, or whose IPv4 source is
 * the aggregator address, can only be a forged result (the switch itself sends
 * results from that address and port), so it is dropped whatever its destination.
 * The controller also binds the IPv4 address of every host it knows (workers and
 * parameter servers) to that host's switch port: a packet claiming a PS's address
 * from any other port is dropped too, so nobody can pose as the PS that workers
 * accept results from in ps and fallback modes.
 * sources: IPv4 source -> switch_only (the aggregator address) | bind_to_port(port) */
#ifndef _NETAGG_SOURCE_GUARD_P4_
#define _NETAGG_SOURCE_GUARD_P4_

control SourceGuard(in headers_t hdr, in bit<9> ingress_port, inout metadata_t meta) {
    @id(0x0100000c)
    action switch_only() {
        meta.drop_reason = DROP_SPOOFED_SOURCE;
    }

    @id(0x0100000d)
    action bind_to_port(port_t port) {
        meta.source_bound = 1;
        meta.bound_port = port;
    }

    @id(0x0100000e)
    action unbound() {
        meta.source_bound = 0;
    }

    @id(0x02000005)
    table sources {
        key = {
            hdr.ipv4.src_addr: exact @name("ipv4_src");
        }
        actions = {
            switch_only;
            bind_to_port;
            @defaultonly unbound;
        }
        const default_action = unbound();
        size = SOURCE_TABLE_SIZE;
    }

    apply {
        meta.source_bound = 0;
        if (hdr.udp.isValid() && hdr.udp.src_port == NETAGG_UDP_PORT) {
            meta.drop_reason = DROP_SPOOFED_SOURCE;
        } else {
            sources.apply();
            if (meta.source_bound == 1 && meta.bound_port != ingress_port) {
                meta.drop_reason = DROP_SPOOFED_SOURCE;
            }
        }
    }
}

#endif
