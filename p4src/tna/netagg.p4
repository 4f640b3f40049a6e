/* netagg for Tofino (TNA): the same semantics as v1model/netagg.p4, within Tofino 1's limits.
 *
 * Every register is touched at most once per pass through one RegisterAction per operation.
 * K = 64 does not fit one pass (the slot state's dependent ALUs take the first stages, and 32
 * value pairs need 8 more of the 12), so the SwitchML way: pass 1 checks the packet and
 * updates the slot state; an accepted contribution or resend recirculates once, and pass 2
 * writes, adds or reads the 32 value pairs; a result recirculates once more for the pairs'
 * high words (a Tofino 1 ALU returns 32 bits per access). See docs/tofino.md for the
 * compiler's resource report. Pass 1 also keeps each round's collective (ExchangeCheck) and the
 * OR of its round flags (RoundFlags), as the v1model program does. In a tree of switches
 * (tree_links.p4), a segment with an up link sends its completed partial to the parent instead
 * of its group, and a parent's result coming down (a RESULT from the parent on the up port)
 * is stored and sent to the local group: its job is known from down_links in pass 1's first
 * stage, it passes the same checks and registers read-only up to LevelState, and an accepted
 * one goes through pass 2 like a first contribution (its values written) to the group.
 * Wide packets (256 values) are not aggregated: the jobs table carries each job's width as the
 * v1model program's does, and a wide packet, or one whose width is not its job's, is refused as
 * WRONG_WIDTH; the controller's default width for this target is 64 (docs/tofino.md, "Wide
 * packets", for the four-pass design that would add them). */
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
#include "tna/control/member_count.p4"
#include "tna/control/bitmap_check.p4"
#include "tna/control/exchange_check.p4"
#include "tna/control/worker_count.p4"
#include "tna/control/exponent_max.p4"
#include "tna/control/round_flags.p4"
#include "tna/control/value_sum.p4"
#include "tna/control/result_delivery.p4"
#include "tna/control/tree_links.p4"
#include "tna/control/ipv4_forward.p4"

typedef bit<10> job_index_t;
typedef bit<5> drop_index_t;

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

    DownLink() down_link;
    SourceGuard() source_guard;
    WorkerLookup() worker_lookup;
    SlotOwner() slot_owner;
    RoundCheck() round_check;
    MemberCount() member_count;
    BitmapCheck() bitmap_check;
    ExchangeCheck() exchange_check;
    WorkerCount() worker_count;
    UpLink() up_link;
    LevelState() level_state;
    ExponentMax() exponent_max;
    RoundFlags() round_flags;
    ValueSum() value_sum;
    ResultDelivery() result_delivery;
    RecircPrepare() recirc_prepare;
    Recirculate() recirculate;
    ResultRelease() result_release;
    UpDelivery() up_delivery;
    UpFinish() up_finish;
    Ipv4Forward() ipv4_forward;

    /* The sender's bit as it was before this packet (0: fresh). A table, so that the compiler
     * does not fold the AND into the test of its result (a gateway cannot AND two fields). */
    action take_sender_bit() {
        meta.sender_seen = meta.bitmap_before & meta.worker_mask;
    }
    table sender_bit {
        actions = {
            take_sender_bit;
        }
        const default_action = take_sender_bit();
        size = 1;
    }

    apply {
        hdr.bridge.setValid();
        hdr.bridge.to_group = 0;
        hdr.bridge.mgid = 0;

        if (hdr.recirc.isValid()) {
            /* Pass 2 (W/M/R) or 3 (READ_HI): the value pairs (below), then onwards. */
            meta.pair_op = (bit<8>)hdr.recirc.value_op;
            meta.pool_index = hdr.recirc.pool[0:0] ++ hdr.recirc.slot_index[11:0];
            value_sum.apply(hdr, meta);
            if (hdr.recirc.deliver == DELIVER_NONE) {
                /* A contribution absorbed into the slot. */
                ig_dprsr_md.drop_ctl = 1;
            } else if (hdr.recirc.value_op == OP_MERGE || hdr.recirc.value_op == OP_READ) {
                /* The low words are in; once more for the high words. */
                hdr.recirc.value_op = OP_READ_HI;
                ig_tm_md.ucast_egress_port = RECIRC_PORT_OF(ig_intr_md.ingress_port);
            } else {
                if (hdr.recirc.deliver == DELIVER_UP || hdr.recirc.deliver == DELIVER_UP_RESEND) {
                    up_finish.apply(hdr);
                } else {
                    result_delivery.apply(hdr);
                }
                result_release.apply(hdr, ig_tm_md);
                /* The last pass set the TTL (and addresses): the checksum is recomputed here,
                 * since a unicast packet's egress does not parse IPv4. */
                meta.update_checksum = 1;
            }
        } else {
            /* Pass 1. Lookups and flags first, all independent of each other but the jobs
             * table, which is keyed by DownLink's local job; then one decision chain sets
             * drop_reason once on every path. */
            down_link.apply(hdr, ig_intr_md.ingress_port, meta);
            /* The per-job counters' index: the packet's job, or a parent's result's local job. */
            job_index_t job = (job_index_t)meta.local_job;
            source_guard.apply(hdr, ig_intr_md.ingress_port, meta);
            worker_lookup.apply(hdr, ig_intr_md.ingress_port, meta);
            up_link.apply(hdr, meta);
            recirc_prepare.apply(hdr, meta, ig_intr_md.ingress_port);
            member_count.apply(hdr, meta);
            meta.round_behind = hdr.netagg.round - 2;
            meta.exponent_key = ((bit<8>)hdr.netagg.exponent) + 8w0x80;
            /* The flags split by slices, not by masks: an action may apply one ALU operation to a
             * field, and the compiler carries a mask's AND into every later use of its result
             * ((flags & ROUND_FLAGS) | x: an "action spanning multiple stages", docs/tofino.md).
             * The slices follow ROUND_FLAGS (0x78) and ROUND_CE (0x01); the parser zeroed the rest. */
#if ROUND_FLAGS != 0x78 || ROUND_CE != 0x01 || FLAG_RETRANSMIT != 0x02
#error "the flags' slices (netagg.p4, tree_links.p4's UpFinish) follow ROUND_FLAGS, ROUND_CE and FLAG_RETRANSMIT"
#endif
            meta.flags_keep[7:7] = hdr.netagg.flags[7:7];
            meta.flags_keep[2:0] = hdr.netagg.flags[2:0];
            meta.flags_round[6:3] = hdr.netagg.flags[6:3];
            /* Congestion marks (docs/protocol.md): a CE-marked packet ORs ROUND_CE into its round. */
            if (hdr.ipv4.diffserv[1:0] == ECN_CE) {
                meta.ce_mark = ROUND_CE;
                meta.flags_round[0:0] = 1;
            } else {
                meta.ce_mark = 0;
            }
            /* The lengths of the packet's width; an undefined width code is malformed. (A wide
             * packet of the right shape is refused later, as WRONG_WIDTH: see WorkerLookup.) */
            if (hdr.netagg.width == NETAGG_WIDTH) {
                if (hdr.ipv4.total_len != NETAGG_IPV4_TOTAL_LENGTH || hdr.udp.length != NETAGG_UDP_LENGTH) {
                    meta.bad_shape = 1;
                }
            } else if (hdr.netagg.width == NETAGG_WIDTH_WIDE) {
                if (hdr.ipv4.total_len != NETAGG_WIDE_IPV4_TOTAL_LENGTH
                        || hdr.udp.length != NETAGG_WIDE_UDP_LENGTH) {
                    meta.bad_shape = 1;
                }
            } else {
                meta.bad_shape = 1;
            }
            if (hdr.ipv4.flags[0:0] == 1 || hdr.ipv4.frag_offset != 0) {
                meta.bad_shape = 1;
            }
            if (hdr.ipv4.isValid() && hdr.ipv4.ihl == 5) {
                meta.update_checksum = 1;
            }

            if (ig_prsr_md.parser_err != PARSER_ERROR_OK) {
                meta.drop_reason = DROP_MALFORMED;
                ig_dprsr_md.drop_ctl = 1;
            } else if (!hdr.ipv4.isValid()) {
                meta.drop_reason = DROP_NOT_IPV4;
                ig_dprsr_md.drop_ctl = 1;
            } else if (meta.down == 0 && hdr.udp.isValid() && hdr.udp.src_port == NETAGG_UDP_PORT) {
                /* (A parent's result comes from the netagg port: SourceGuard does not apply to it.) */
                meta.drop_reason = DROP_SPOOFED_SOURCE;
                ig_dprsr_md.drop_ctl = 1;
            } else if (meta.down == 0 && (meta.spoof_address == 1 || meta.spoof_port == 1)) {
                meta.drop_reason = DROP_SPOOFED_SOURCE;
                ig_dprsr_md.drop_ctl = 1;
            } else if (!hdr.netagg.isValid()) {
                ipv4_forward.apply(hdr, meta, ig_tm_md, ig_dprsr_md);
            } else if (hdr.netagg.version != NETAGG_VERSION) {
                meta.drop_reason = DROP_BAD_VERSION;
                ig_dprsr_md.drop_ctl = 1;
            } else if (meta.bad_shape == 1) {
                meta.drop_reason = DROP_MALFORMED;
                ig_dprsr_md.drop_ctl = 1;
            } else if ((hdr.netagg.flags & FLAG_RESULT) != 0 && meta.down == 0) {
                meta.drop_reason = DROP_RESULT_FROM_HOST;
                ig_dprsr_md.drop_ctl = 1;
            } else if (meta.job_hit == 0) {
                meta.drop_reason = DROP_UNKNOWN_JOB;
                ig_dprsr_md.drop_ctl = 1;
            } else if (meta.worker_hit == 0 && meta.down == 0) {
                meta.drop_reason = DROP_UNKNOWN_WORKER;
                ig_dprsr_md.drop_ctl = 1;
                meta.reject = 1;
            } else if (meta.wrong_width == 1) {
                /* Another width than the job's, or wide: this twin aggregates narrow packets only. */
                meta.drop_reason = DROP_WRONG_WIDTH;
                ig_dprsr_md.drop_ctl = 1;
                meta.reject = 1;
            } else if (meta.slot_out_of_range == 1) {
                meta.drop_reason = DROP_SLOT_OUT_OF_RANGE;
                ig_dprsr_md.drop_ctl = 1;
                meta.reject = 1;
            } else if (hdr.netagg.pool[7:1] != 0) {
                meta.drop_reason = DROP_BAD_POOL;
                ig_dprsr_md.drop_ctl = 1;
                meta.reject = 1;
            } else if (meta.rank_mismatch == 1 && meta.down == 0) {
                meta.drop_reason = DROP_RANK_MISMATCH;
                ig_dprsr_md.drop_ctl = 1;
                meta.reject = 1;
            } else if (meta.not_member == 1 && meta.down == 0) {
                meta.drop_reason = DROP_NOT_A_MEMBER;
                ig_dprsr_md.drop_ctl = 1;
                meta.reject = 1;
            } else if ((hdr.netagg.flags & FLAG_CLOSE) != 0) {
                /* Deadline rounds are not built in this twin (docs/tofino.md, "Deadline rounds on
                 * Tofino (design)"): every close request, and every parent's result of a closed
                 * round, is refused before any register changes, so a host never reads an echoed
                 * CLOSE bit as a closed round. */
                meta.drop_reason = DROP_CLOSE_REFUSED;
                ig_dprsr_md.drop_ctl = 1;
                meta.reject = 1;
            } else {
                slot_owner.apply(meta);
                round_check.apply(hdr, meta);
                if ((meta.down == 0 && meta.stale == 0 && meta.round_ahead[15:15] == 1)
                        || (meta.down == 1 && (meta.stale == 1 || meta.round_ahead != 0))) {
                    /* A copy of a round that has been superseded, or a parent's result that is
                     * not for the current round of a slot this job owns: harmless, dropped. */
                    job_duplicates.count(job);
                    ig_dprsr_md.drop_ctl = 1;
                } else {
                    if (meta.down == 0) {
                        bitmap_check.apply(hdr, meta);
                        exchange_check.apply(hdr, meta);
                        sender_bit.apply();
                        if (meta.sender_seen == 0) {
                            meta.fresh = 1;
                        }
                    }
                    if (meta.down == 0 && meta.first == 0 && meta.bitmap_before == 0) {
                        /* Other members than the round started with: nothing changed. */
                        meta.drop_reason = DROP_MEMBERS_MISMATCH;
                        ig_dprsr_md.drop_ctl = 1;
                        meta.reject = 1;
                    } else {
                        if (meta.down == 0) {
                            worker_count.apply(meta);
                        }
                        /* A parent's result: UP -> FINAL; a contribution: OPEN / UP (tree_links.p4). */
                        level_state.apply(meta);
                        if (meta.down == 1) {
                            if (meta.level == LEVEL_UP) {
                                /* The parent's result replaces the partial (values, exponent and
                                 * round flags) and goes to the local group, as the local job's. */
                                hdr.netagg.job_id = meta.local_job;
                                meta.value_op = OP_WRITE;
                                meta.flags_in = meta.flags_round;
                                meta.to_group = 1;
                                job_results.count(job);
                            } else {
                                /* Not sent up yet, or already FINAL (a second copy): nothing changes. */
                                job_duplicates.count(job);
                            }
                        } else if (meta.fresh == 1 && meta.late == 0) {
                            if (meta.exchange_mismatch == 1) {
                                /* Another collective's contribution: not added, the round marked
                                 * OUT_OF_STEP; it still counts towards completion, and if it
                                 * completes the round it leaves with the stored state. Counted as a
                                 * drop reason without being dropped. */
                                meta.drop_reason = DROP_EXCHANGE_MISMATCH;
                                meta.reject = 1;
                                meta.flags_in = FLAG_OUT_OF_STEP | meta.ce_mark;
                                meta.flags_out = meta.flags_keep | FLAG_OUT_OF_STEP;
                                if (meta.complete == 1) {
                                    meta.value_op = OP_READ;
                                }
                            } else {
                                job_contributions.count(job);
                                meta.flags_in = meta.flags_round;
                                meta.flags_out = hdr.netagg.flags;
                                if (meta.first == 1) {
                                    meta.value_op = OP_WRITE;
                                } else {
                                    meta.value_op = OP_MERGE;
                                }
                            }
                            if (meta.complete == 1) {
                                if (meta.has_up == 1) {
                                    /* Not the root of the job's tree: the partial goes to the parent. */
                                    meta.to_up = 1;
                                } else {
                                    meta.to_group = 1;
                                    job_results.count(job);
                                }
                            }
                        } else if (meta.fresh == 0 && meta.complete == 1) {
                            /* A resend to a complete round: the stored result back to the sender,
                             * or, while the parent's result is outstanding, the partial to the
                             * parent again. */
                            meta.value_op = OP_READ;
                            meta.flags_out = meta.flags_keep;
                            job_retransmit_results.count(job);
                            if (meta.has_up == 1 && meta.level != LEVEL_FINAL) {
                                meta.to_up = 1;
                            }
                        } else {
                            job_duplicates.count(job);
                        }
                        /* Whether or not anything leaves: a mismatched contribution marks the round. */
                        round_flags.apply(hdr, meta);
                        /* merge_flags returned the round's ROUND_CE in the flags' RESULT position (no
                         * contribution carries RESULT; a parent's result does, and takes write_flags):
                         * the packet leaves CE-marked. ResultDelivery sets RESULT there afterwards. */
                        if (meta.down == 0 && (hdr.netagg.flags & ROUND_CE) != 0) {
                            hdr.ipv4.diffserv[1:0] = ECN_CE;
                        }
                        if (meta.value_op == OP_NONE) {
                            /* A duplicate of an incomplete round, or late: nothing leaves. */
                            ig_dprsr_md.drop_ctl = 1;
                        } else {
                            exponent_max.apply(hdr, meta);
                            recirculate.apply(hdr, meta, ig_intr_md, ig_tm_md);
                            if (meta.to_up == 1) {
                                up_delivery.apply(hdr, meta);
                            }
                        }
                    }
                }
            }
            if (meta.drop_reason != DROP_NONE) {
                drop_reasons.count((drop_index_t)meta.drop_reason);
            }
            if (meta.reject == 1) {
                job_rejects.count(job);
            }
        }
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
            /* Congestion marks: a result copy that found its egress queue deep leaves CE (only the
             * group copies have their IPv4 header parsed in egress; enq_qdepth counts cells). */
            if (hdr.ipv4.diffserv[1:0] != ECN_NOT_ECT
                    && eg_intr_md.enq_qdepth >= (bit<19>)ECN_MARK_QDEPTH) {
                hdr.ipv4.diffserv[1:0] = ECN_CE;
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
