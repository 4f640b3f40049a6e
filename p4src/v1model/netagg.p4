/* netagg: in-network gradient aggregation for multi-tenant training (v1model).
 *
 * Workers send K quantized int32 values per packet to an aggregation slot of
 * their job; the switch sums them exactly once per (slot, pool version), keeps
 * the maximum block exponent, and delivers the completed sum to the job's
 * multicast group (all workers, or the job's parameter server). Everything else
 * is IPv4-forwarded. See docs/protocol.md and docs/tofino.md. */
#include <core.p4>
#include <v1model.p4>

#include "shared/defines.p4"
#include "shared/headers.p4"
#include "v1model/metadata.p4"
#include "v1model/parser.p4"
#include "v1model/control/source_guard.p4"
#include "v1model/control/worker_lookup.p4"
#include "v1model/control/slot_owner.p4"
#include "v1model/control/round_check.p4"
#include "v1model/control/member_check.p4"
#include "v1model/control/bitmap_check.p4"
#include "v1model/control/worker_count.p4"
#include "v1model/control/exponent_max.p4"
#include "v1model/control/value_sum.p4"
#include "v1model/control/result_delivery.p4"
#include "v1model/control/ipv4_forward.p4"

control NetaggVerifyChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply { }
}

control NetaggIngress(inout headers_t hdr, inout metadata_t meta,
                      inout standard_metadata_t standard_metadata) {
    /* Packets rejected, by reason (DROP_* in defines.p4). */
    @id(0x12000001) counter(DROP_REASONS, CounterType.packets) drop_reasons;
    /* Per job, indexed by job id. */
    @id(0x12000002) counter(MAX_JOBS, CounterType.packets_and_bytes) job_contributions;
    @id(0x12000003) counter(MAX_JOBS, CounterType.packets) job_results;
    @id(0x12000004) counter(MAX_JOBS, CounterType.packets) job_duplicates;
    @id(0x12000005) counter(MAX_JOBS, CounterType.packets) job_retransmit_results;
    @id(0x12000006) counter(MAX_JOBS, CounterType.packets) job_rejects;

    SourceGuard() source_guard;
    WorkerLookup() worker_lookup;
    SlotOwner() slot_owner;
    RoundCheck() round_check;
    MemberCheck() member_check;
    BitmapCheck() bitmap_check;
    WorkerCount() worker_count;
    ExponentMax() exponent_max;
    ValueSum() value_sum;
    ResultDelivery() result_delivery;
    Ipv4Forward() ipv4_forward;

    apply {
        meta.drop_reason = DROP_NONE;
        meta.value_op = OP_NONE;
        meta.to_group = 0;
        if (standard_metadata.parser_error != error.NoError) {
            meta.drop_reason = DROP_MALFORMED;
        } else if (!hdr.ipv4.isValid()) {
            meta.drop_reason = DROP_NOT_IPV4;
        } else {
            source_guard.apply(hdr, standard_metadata.ingress_port, meta);
        }
        if (meta.drop_reason != DROP_NONE) {
            /* Counted and dropped below. */
        } else if (!hdr.netagg.isValid()) {
            ipv4_forward.apply(hdr, meta, standard_metadata);
        } else if (hdr.netagg.version != NETAGG_VERSION) {
            meta.drop_reason = DROP_BAD_VERSION;
        } else if (hdr.ipv4.total_len != NETAGG_IPV4_TOTAL_LENGTH
                   || hdr.udp.length != NETAGG_UDP_LENGTH
                   || hdr.ipv4.flags[0:0] == 1 || hdr.ipv4.frag_offset != 0) {
            meta.drop_reason = DROP_MALFORMED;
        } else if ((hdr.netagg.flags & FLAG_RESULT) != 0) {
            meta.drop_reason = DROP_RESULT_FROM_HOST;
        } else {
            worker_lookup.apply(hdr, standard_metadata.ingress_port, meta);
            if (meta.drop_reason == DROP_NONE) {
                slot_owner.apply(meta);
                round_check.apply(hdr, meta);
                if (meta.round_state != ROUND_OLD) {
                    member_check.apply(hdr, meta);
                }
            }
            if (meta.drop_reason == DROP_NONE && meta.round_state == ROUND_OLD) {
                /* A copy of a round that has been superseded: harmless, dropped. */
                job_duplicates.count((bit<32>)hdr.netagg.job_id);
                mark_to_drop(standard_metadata);
            } else if (meta.drop_reason == DROP_NONE) {
                bitmap_check.apply(hdr, meta);
                worker_count.apply(hdr, meta);
                if (meta.fresh == 1 && meta.late == 0) {
                    job_contributions.count((bit<32>)hdr.netagg.job_id);
                    if (meta.first == 1) {
                        meta.value_op = OP_WRITE;
                    } else {
                        meta.value_op = OP_MERGE;
                    }
                    if (meta.complete == 1) {
                        meta.to_group = 1;
                        job_results.count((bit<32>)hdr.netagg.job_id);
                    }
                } else if (meta.fresh == 0 && meta.complete == 1) {
                    meta.value_op = OP_READ;
                    job_retransmit_results.count((bit<32>)hdr.netagg.job_id);
                } else {
                    job_duplicates.count((bit<32>)hdr.netagg.job_id);
                }
                if (meta.value_op != OP_NONE) {
                    exponent_max.apply(hdr, meta);
                    value_sum.apply(hdr, meta);
                }
                if (meta.complete == 1 && meta.late == 0) {
                    result_delivery.apply(hdr, meta, standard_metadata);
                } else {
                    /* Absorbed into the slot, or a duplicate: nothing leaves. */
                    mark_to_drop(standard_metadata);
                }
            } else if (meta.drop_reason != DROP_UNKNOWN_JOB) {
                job_rejects.count((bit<32>)hdr.netagg.job_id);
            }
        }
        if (meta.drop_reason != DROP_NONE) {
            drop_reasons.count((bit<32>)meta.drop_reason);
            mark_to_drop(standard_metadata);
        }
    }
}

control NetaggEgress(inout headers_t hdr, inout metadata_t meta,
                     inout standard_metadata_t standard_metadata) {
    /* Replicas dropped in egress, by reason (only DROP_NO_REPLICA today). */
    @id(0x12000007) counter(DROP_REASONS, CounterType.packets) egress_drop_reasons;

    ResultRewrite() result_rewrite;

    apply {
        if (meta.to_group == 1) {
            result_rewrite.apply(hdr, meta, standard_metadata);
            if (meta.drop_reason != DROP_NONE) {
                egress_drop_reasons.count((bit<32>)meta.drop_reason);
                mark_to_drop(standard_metadata);
            }
        }
    }
}

control NetaggComputeChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply {
        update_checksum(
            hdr.ipv4.isValid() && hdr.ipv4.ihl == 5,
            {
                hdr.ipv4.version,
                hdr.ipv4.ihl,
                hdr.ipv4.diffserv,
                hdr.ipv4.total_len,
                hdr.ipv4.identification,
                hdr.ipv4.flags,
                hdr.ipv4.frag_offset,
                hdr.ipv4.ttl,
                hdr.ipv4.protocol,
                hdr.ipv4.src_addr,
                hdr.ipv4.dst_addr
            },
            hdr.ipv4.hdr_checksum,
            HashAlgorithm.csum16);
    }
}

V1Switch(
    NetaggParser(),
    NetaggVerifyChecksum(),
    NetaggIngress(),
    NetaggEgress(),
    NetaggComputeChecksum(),
    NetaggDeparser()
) main;
