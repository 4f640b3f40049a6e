/* netagg (TNA): results come only from the switch; see v1model/control/source_guard.p4.
 * Same table and actions. Here the control only computes flags (meta.spoof_*); the
 * ingress's single decision chain turns them into a drop reason, so that nothing waits
 * for an earlier drop_reason write (each such wait costs a Tofino stage). */
#ifndef _NETAGG_TNA_SOURCE_GUARD_P4_
#define _NETAGG_TNA_SOURCE_GUARD_P4_

control SourceGuard(in tna_headers_t hdr, in port_t ingress_port, inout ingress_metadata_t meta) {
    action switch_only() {
        meta.spoof_address = 1;
    }

    action bind_to_port(port_t port) {
        meta.source_bound = 1;
        meta.bound_port = port;
    }

    action unbound() {
        meta.source_bound = 0;
    }

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
        sources.apply();
        if (meta.source_bound == 1 && meta.bound_port != ingress_port) {
            meta.spoof_port = 1;
        }
    }
}

#endif
