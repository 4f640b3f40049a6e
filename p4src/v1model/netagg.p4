/* netagg: in-network gradient aggregation for multi-tenant training (v1model).
 *
 * Workers send K (narrow) or WIDE_K (wide: the job's width) quantized int32 values per packet
 * to an aggregation slot of their job; the switch sums them exactly once per (slot, pool
 * version), one cell of value registers per 64 values (value_sum.p4), keeps
 * the maximum block exponent, and delivers the completed sum to the job's
 * multicast group (all workers, or the job's parameter server). In a tree of
 * switches, a switch with an up link for the job sends the completed partial to its
 * parent instead and delivers the parent's result when it comes down (tree_links.p4).
 * Each round also keeps the collective its first packet named (exchange_check.p4) and the OR of
 * its contributions' round flags (round_flags.p4): a contribution of another collective is not
 * added but completes the round as usual, which then reaches every member marked OUT_OF_STEP.
 * A member may close a round at a deadline (FLAG_CLOSE): the round completes with the
 * contributions it has, its result carries their bitmap, and nothing is added to it afterwards
 * (round_flags.p4, worker_count.p4).
 * Everything else is IPv4-forwarded. See docs/protocol.md, docs/hierarchy.md and
 * docs/tofino.md. */
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
#include "v1model/control/exchange_check.p4"
#include "v1model/control/bitmap_check.p4"
#include "v1model/control/worker_count.p4"
#include "v1model/control/exponent_max.p4"
#include "v1model/control/round_flags.p4"
#include "v1model/control/value_sum.p4"
#include "v1model/control/result_delivery.p4"
#include "v1model/control/tree_links.p4"
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

    DownLink() down_link;
    SourceGuard() source_guard;
    WorkerLookup() worker_lookup;
    SlotOwner() slot_owner;
    RoundCheck() round_check;
    MemberCheck() member_check;
    ExchangeCheck() exchange_check;
    BitmapCheck() bitmap_check;
    WorkerCount() worker_count;
    UpLink() up_link;
    LevelState() level_state;
    ExponentMax() exponent_max;
    RoundFlags() round_flags;
    ValueSum() value_sum;
    ResultDelivery() result_delivery;
    UpDelivery() up_delivery;
    Ipv4Forward() ipv4_forward;

    apply {
        meta.drop_reason = DROP_NONE;
        meta.value_op = OP_NONE;
        meta.to_group = 0;
        meta.to_up = 0;
        meta.down = 0;
        meta.has_up = 0;
        meta.first = 0;
        meta.fresh = 0;
        meta.complete = 0;
        meta.late = 0;
        meta.exchange_mismatch = 0;
        meta.closed = 0;
        meta.closes = 0;
        meta.close_check = 0;
        if (standard_metadata.parser_error != error.NoError) {
            meta.drop_reason = DROP_MALFORMED;
        } else if (!hdr.ipv4.isValid()) {
            meta.drop_reason = DROP_NOT_IPV4;
        } else {
            if (hdr.netagg.isValid() && (hdr.netagg.flags & FLAG_RESULT) != 0) {
                /* A parent's result on the up port (tree_links.p4) is not a forgery. */
                down_link.apply(hdr, standard_metadata.ingress_port, meta);
            }
            if (meta.down == 0) {
                source_guard.apply(hdr, standard_metadata.ingress_port, meta);
            }
        }
        if (meta.drop_reason != DROP_NONE) {
            /* Counted and dropped below. */
        } else if (!hdr.netagg.isValid()) {
            ipv4_forward.apply(hdr, meta, standard_metadata);
        } else if (hdr.netagg.version != NETAGG_VERSION) {
            meta.drop_reason = DROP_BAD_VERSION;
        } else if (!((hdr.netagg.width == NETAGG_WIDTH
                      && hdr.ipv4.total_len == NETAGG_IPV4_TOTAL_LENGTH
                      && hdr.udp.length == NETAGG_UDP_LENGTH)
                     || (hdr.netagg.width == NETAGG_WIDTH_WIDE
                         && hdr.ipv4.total_len == NETAGG_WIDE_IPV4_TOTAL_LENGTH
                         && hdr.udp.length == NETAGG_WIDE_UDP_LENGTH))
                   || hdr.ipv4.flags[0:0] == 1 || hdr.ipv4.frag_offset != 0) {
            /* An undefined width code, lengths other than the width's, or a fragment. */
            meta.drop_reason = DROP_MALFORMED;
        } else if ((hdr.netagg.flags & FLAG_RESULT) != 0 && meta.down == 0) {
            meta.drop_reason = DROP_RESULT_FROM_HOST;
        } else {
            if (meta.down == 1) {
                /* From here on the parent's result is a packet of the local job. */
                hdr.netagg.job_id = meta.down_job;
            }
            worker_lookup.apply(hdr, standard_metadata.ingress_port, meta);
            if (meta.drop_reason == DROP_NONE && meta.down == 0) {
                up_link.apply(hdr, meta);
            }
            if (meta.drop_reason == DROP_NONE && (hdr.netagg.flags & FLAG_CLOSE) != 0
                    && (meta.has_up == 1 || meta.down == 1)) {
                /* Deadline rounds are one switch's: a close on a segment with an up link, or a
                 * parent's result of a closed round, is refused before any register changes. */
                meta.drop_reason = DROP_CLOSE_REFUSED;
            }
            if (meta.drop_reason == DROP_NONE) {
                slot_owner.apply(meta);
                round_check.apply(hdr, meta);
                if (meta.round_state != ROUND_OLD && meta.down == 0) {
                    member_check.apply(hdr, meta);
                    if (meta.drop_reason == DROP_NONE) {
                        exchange_check.apply(hdr, meta);
                    }
                }
            }
            if (meta.drop_reason == DROP_NONE && meta.round_state == ROUND_OLD) {
                /* A copy of a round that has been superseded (or, coming down, is not this
                 * slot's current round): harmless, dropped. */
                job_duplicates.count((bit<32>)hdr.netagg.job_id);
                mark_to_drop(standard_metadata);
            } else if (meta.drop_reason == DROP_NONE) {
                if (meta.down == 0) {
                    /* CloseCheck: RoundFlags only reads (meta.closed, meta.stored_flags). */
                    meta.close_check = 1;
                    round_flags.apply(hdr, meta);
                }
                if (meta.closed == 1) {
                    /* CloseCheck: the round was closed at a deadline. Nothing changes; the stored
                     * result, with the bitmap of its contributors, goes back to the sender alone. A
                     * sender not among them is late: its values are not added. */
                    bitmap_check.apply(hdr, meta);  /* close_check: only reads */
                    job_retransmit_results.count((bit<32>)hdr.netagg.job_id);
                    if (meta.fresh == 1) {
                        drop_reasons.count((bit<32>)DROP_LATE_FOR_CLOSED_ROUND);
                    }
                    meta.value_op = OP_READ;
                    exponent_max.apply(hdr, meta);
                    value_sum.apply(hdr, meta);
                    hdr.netagg.flags = (hdr.netagg.flags & ~((bit<8>)STORED_FLAGS))
                                       | (meta.stored_flags & STORED_FLAGS);
                    if ((meta.stored_flags & ROUND_CE) != 0) {
                        hdr.ipv4.diffserv[1:0] = ECN_CE;
                    }
                    if (meta.exchange_mismatch == 1 && meta.fresh == 1) {
                        hdr.netagg.flags = hdr.netagg.flags | FLAG_OUT_OF_STEP;
                    }
                    hdr.netagg.members = meta.bitmap_before;
                    result_delivery.apply(hdr, meta, standard_metadata);
                } else {
                    meta.close_check = 0;
                    if (meta.down == 0) {
                        bitmap_check.apply(hdr, meta);
                        worker_count.apply(hdr, meta);
                    }
                    level_state.apply(meta);
                    if (meta.down == 1) {
                        if (meta.down_accepted == 1) {
                            /* The parent's result replaces the partial and goes to the local group. */
                            meta.value_op = OP_WRITE;
                            meta.to_group = 1;
                            job_results.count((bit<32>)hdr.netagg.job_id);
                        } else {
                            job_duplicates.count((bit<32>)hdr.netagg.job_id);
                        }
                    } else if (meta.fresh == 1 && meta.late == 0) {
                        if (meta.exchange_mismatch == 1) {
                            /* Another collective's contribution: not added (RoundFlags marks the round
                             * OUT_OF_STEP), but its bit is set and it counts towards completion; if it
                             * completes the round it leaves with the stored sums and exponent. */
                            drop_reasons.count((bit<32>)DROP_EXCHANGE_MISMATCH);
                            job_rejects.count((bit<32>)hdr.netagg.job_id);
                            if (meta.complete == 1) {
                                meta.value_op = OP_READ;
                            }
                        } else {
                            job_contributions.count((bit<32>)hdr.netagg.job_id);
                            if (meta.first == 1) {
                                meta.value_op = OP_WRITE;
                            } else {
                                meta.value_op = OP_MERGE;
                            }
                        }
                        if (meta.complete == 1) {
                            if (meta.has_up == 1) {
                                meta.to_up = 1;
                            } else {
                                meta.to_group = 1;
                                job_results.count((bit<32>)hdr.netagg.job_id);
                            }
                        }
                    } else if (meta.closes == 1) {
                        /* A resend's close request: the round's result, to the group. */
                        meta.value_op = OP_READ;
                        meta.to_group = 1;
                        job_results.count((bit<32>)hdr.netagg.job_id);
                    } else if (meta.fresh == 0 && meta.complete == 1) {
                        /* A resend to a complete round: the stored result back to the sender, or,
                         * while the parent's result is outstanding, the partial to the parent again. */
                        meta.value_op = OP_READ;
                        job_retransmit_results.count((bit<32>)hdr.netagg.job_id);
                        if (meta.has_up == 1 && meta.level != LEVEL_FINAL) {
                            meta.to_up = 1;
                        }
                    } else {
                        job_duplicates.count((bit<32>)hdr.netagg.job_id);
                    }
                    if (meta.value_op != OP_NONE) {
                        exponent_max.apply(hdr, meta);
                        value_sum.apply(hdr, meta);
                    }
                    /* Also without a value operation: a mismatched contribution marks the round. */
                    round_flags.apply(hdr, meta);
                    if (meta.closes == 1) {
                        /* Who is in the closed round's sum. */
                        hdr.netagg.members = meta.bitmap_before | meta.worker_mask;
                    }
                    if (meta.to_up == 1) {
                        up_delivery.apply(hdr, meta, standard_metadata);
                    } else if (meta.to_group == 1 || (meta.complete == 1 && meta.late == 0)) {
                        result_delivery.apply(hdr, meta, standard_metadata);
                    } else {
                        /* Absorbed into the slot, or a duplicate: nothing leaves. */
                        mark_to_drop(standard_metadata);
                    }
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
        /* Congestion marks: an ECN-capable packet that found its egress queue deep leaves CE. */
        if (hdr.ipv4.isValid() && hdr.ipv4.diffserv[1:0] != ECN_NOT_ECT
                && standard_metadata.enq_qdepth >= (bit<19>)ECN_MARK_QDEPTH) {
            hdr.ipv4.diffserv[1:0] = ECN_CE;
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
