/* netagg for Tofino (TNA): the same semantics as v1model/netagg.p4, within Tofino's limits.
 *
 * Every register is touched once per packet through one RegisterAction per operation;
 * the values are 32 register pairs, and a packet that leaves with the sums takes a second
 * pass through the pipeline (one recirculation) to read the pairs' high words, because a
 * Tofino 1 stateful ALU returns 32 bits per access. Non-completing contributions, which
 * are all but one per round, take one pass. See docs/tofino.md for the compiler's report. */
#include <core.p4>
#include <tna.p4>

#include "shared/defines.p4"
#include "shared/headers.p4"
#include "tna/defines.p4"
#include "tna/headers.p4"
#include "tna/parser.p4"
#include "tna/control/source_guard.p4"
#include "tna/control/worker_lookup.p4"
#include "tna/control/slot_owner.p4"
#include "tna/control/round_check.p4"
#include "tna/control/bitmap_check.p4"
#include "tna/control/worker_count.p4"
#include "tna/control/exponent_max.p4"
#include "tna/control/value_sum.p4"
#include "tna/control/result_delivery.p4"
#include "tna/control/ipv4_forward.p4"

typedef bit<10> job_index_t;
typedef bit<4> drop_index_t;

control NetaggIngress(inout tna_headers_t hdr,
                      inout ingress_metadata_t meta,
                      in ingress_intrinsic_metadata_t ig_intr_md,
                      in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                      inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                      inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    /* Packets rejected, by reason (DROP_* in shared/defines.p4), and per job. */
    Counter<bit<32>, drop_index_t>(DROP_REASONS, CounterType_t.PACKETS) drop_reasons;
    Counter<bit<32>, job_index_t>(MAX_JOBS, CounterType_t.PACKETS_AND_BYTES) job_contributions;
    Counter<bit<32>, job_index_t>(MAX_JOBS, CounterType_t.PACKETS) job_results;
    Counter<bit<32>, job_index_t>(MAX_JOBS, CounterType_t.PACKETS) job_duplicates;
    Counter<bit<32>, job_index_t>(MAX_JOBS, CounterType_t.PACKETS) job_retransmit_results;
    Counter<bit<32>, job_index_t>(MAX_JOBS, CounterType_t.PACKETS) job_rejects;

    SourceGuard() source_guard;
    WorkerLookup() worker_lookup;
    SlotOwner() slot_owner;
    RoundCheck() round_check;
    BitmapCheck() bitmap_check;
    WorkerCount() worker_count;
    ExponentMax() exponent_max;
    ValueSum() value_sum;
    ResultDelivery() result_delivery;
    ResultRelease() result_release;
    Ipv4Forward() ipv4_forward;

    apply {
        meta.drop_reason = DROP_NONE;
        meta.value_op = OP_NONE;
        meta.to_group = 0;
        meta.recirculate = 0;
        meta.update_checksum = 0;
        hdr.bridge.setValid();
        hdr.bridge.to_group = 0;
        hdr.bridge.mgid = 0;
        job_index_t job = (job_index_t)hdr.netagg.job_id;

        if (hdr.recirc.isValid()) {
            /* Pass 2 of a result: read the high words (below), then deliver. */
            meta.pool_index = hdr.recirc.pool[0:0] ++ hdr.recirc.slot_index[11:0];
            meta.value_op = OP_READ_HI;
            result_release.apply(hdr, ig_tm_md);
        } else {
            if (ig_prsr_md.parser_err != PARSER_ERROR_OK) {
                meta.drop_reason = DROP_MALFORMED;
            } else if (!hdr.ipv4.isValid()) {
                meta.drop_reason = DROP_NOT_IPV4;
            } else {
                source_guard.apply(hdr, ig_intr_md.ingress_port, meta);
                /* A netagg packet's lengths and fragment bits (two gateways: 4 bytes each). */
                if (hdr.ipv4.total_len != NETAGG_IPV4_TOTAL_LENGTH || hdr.udp.length != NETAGG_UDP_LENGTH) {
                    meta.bad_shape = 1;
                }
                if (hdr.ipv4.flags[0:0] == 1 || hdr.ipv4.frag_offset != 0) {
                    meta.bad_shape = 1;
                }
                if (hdr.ipv4.ihl == 5) {
                    meta.update_checksum = 1;
                }
            }
            if (meta.drop_reason != DROP_NONE) {
                /* Counted and dropped below. */
            } else if (!hdr.netagg.isValid()) {
                ipv4_forward.apply(hdr, meta, ig_tm_md);
            } else if (hdr.netagg.version != NETAGG_VERSION) {
                meta.drop_reason = DROP_BAD_VERSION;
            } else if (meta.bad_shape == 1) {
                meta.drop_reason = DROP_MALFORMED;
            } else if ((hdr.netagg.flags & FLAG_RESULT) != 0) {
                meta.drop_reason = DROP_RESULT_FROM_HOST;
            } else {
                meta.round_behind = hdr.netagg.round - 1;
                meta.exponent_key = ((bit<8>)hdr.netagg.exponent) ^ 0x80;
                worker_lookup.apply(hdr, ig_intr_md.ingress_port, meta);
                if (meta.drop_reason == DROP_NONE) {
                    slot_owner.apply(meta);
                    round_check.apply(hdr, meta);
                }
                if (meta.drop_reason == DROP_NONE && meta.round_state == ROUND_OLD) {
                    /* A copy of a round that has been superseded: harmless, dropped. */
                    job_duplicates.count(job);
                    ig_dprsr_md.drop_ctl = 1;
                } else if (meta.drop_reason == DROP_NONE) {
                    bitmap_check.apply(meta);
                    worker_count.apply(meta);
                    if (meta.fresh == 1 && meta.late == 0) {
                        job_contributions.count(job);
                        if (meta.first == 1) {
                            meta.value_op = OP_WRITE;
                        } else {
                            meta.value_op = OP_MERGE;
                        }
                        if (meta.complete == 1) {
                            meta.to_group = 1;
                            job_results.count(job);
                        }
                    } else if (meta.fresh == 0 && meta.complete == 1) {
                        meta.value_op = OP_READ;
                        job_retransmit_results.count(job);
                    } else {
                        job_duplicates.count(job);
                    }
                    if (meta.value_op != OP_NONE) {
                        exponent_max.apply(hdr, meta);
                    }
                    if (meta.complete == 1 && meta.late == 0) {
                        if (meta.value_op != OP_WRITE) {
                            meta.recirculate = 1;
                        }
                        result_delivery.apply(hdr, meta, ig_intr_md, ig_tm_md);
                    } else {
                        /* Absorbed into the slot, or a duplicate: nothing leaves. */
                        ig_dprsr_md.drop_ctl = 1;
                    }
                } else if (meta.drop_reason != DROP_UNKNOWN_JOB) {
                    job_rejects.count(job);
                }
            }
            if (meta.drop_reason != DROP_NONE) {
                drop_reasons.count((drop_index_t)meta.drop_reason);
                ig_dprsr_md.drop_ctl = 1;
            }
        }
        /* Both passes: each pair's table picks its RegisterAction by value_op. */
        value_sum.apply(hdr, meta);
    }
}

control NetaggEgress(inout tna_headers_t hdr,
                     inout egress_metadata_t meta,
                     in egress_intrinsic_metadata_t eg_intr_md,
                     in egress_intrinsic_metadata_from_parser_t eg_prsr_md,
                     inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md,
                     inout egress_intrinsic_metadata_for_output_port_t eg_oport_md) {
    /* Replicas dropped in egress, by reason (only DROP_NO_REPLICA today). */
    Counter<bit<32>, drop_index_t>(DROP_REASONS, CounterType_t.PACKETS) egress_drop_reasons;

    ResultRewrite() result_rewrite;

    apply {
        meta.drop_reason = DROP_NONE;
        if (hdr.bridge.to_group != 0) {
            result_rewrite.apply(hdr, meta, eg_intr_md);
            if (meta.drop_reason != DROP_NONE) {
                egress_drop_reasons.count((drop_index_t)meta.drop_reason);
                eg_dprsr_md.drop_ctl = 1;
            }
        }
    }
}

Pipeline(
    NetaggIngressParser(),
    NetaggIngress(),
    NetaggIngressDeparser(),
    NetaggEgressParser(),
    NetaggEgress(),
    NetaggEgressDeparser()
) pipe;

Switch(pipe) main;
