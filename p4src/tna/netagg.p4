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
 * Wide packets (256 values, four cells) take one pass per chunk after pass 1, and a wide result
 * eight more to read its sums back (WideStep); the jobs table carries each job's width as the
 * v1model program's does, and a packet whose width is not its job's is refused as WRONG_WIDTH.
 * The controller's default width for this target is 64 (docs/tofino.md, "Wide packets": the
 * recirculation port's bytes). */
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
#include "tna/control/wide_steps.p4"
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
    ResultRelease() result_release;
    WideStep() wide_step;
    UpDelivery() up_delivery;
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

    /* The packet's checks, in the order the v1model program makes them (its if/else chain): the
     * first matching entry decides. A chain of ifs would cost a logical table per branch in the
     * stages that the lookups already fill (Tofino 1: 16 per stage); one ternary table costs one.
     * A check "field != value" (parser error, version, pool) is its value required in every entry
     * after it, and the check itself an entry after the packets that pass. */
    action refuse(bit<8> reason, bit<1> reject) {
        meta.drop_reason = reason;
        ig_dprsr_md.drop_ctl = 1;
        meta.reject = reject;
    }
    action forward() {}
    action admit() {}
    table checks {
        key = {
            ig_prsr_md.parser_err: ternary @name("parser_err");
            hdr.ipv4.isValid(): ternary @name("ipv4");
            hdr.udp.isValid(): ternary @name("udp");
            hdr.netagg.isValid(): ternary @name("netagg");
            meta.down: ternary @name("down");
            hdr.udp.src_port: ternary @name("udp_src");
            meta.spoof_address: ternary @name("spoof_address");
            meta.spoof_port: ternary @name("spoof_port");
            hdr.netagg.version: ternary @name("version");
            meta.bad_shape: ternary @name("bad_shape");
            hdr.netagg.flags: ternary @name("flags");
            meta.job_hit: ternary @name("job_hit");
            meta.worker_hit: ternary @name("worker_hit");
            meta.wrong_width: ternary @name("wrong_width");
            meta.slot_out_of_range: ternary @name("slot_out_of_range");
            hdr.netagg.pool: ternary @name("pool");
            meta.rank_mismatch: ternary @name("rank_mismatch");
            meta.not_member: ternary @name("not_member");
        }
        actions = { refuse; forward; admit; }
        const entries = {
            /* err ipv4  udp   netagg down sport            sA sP version         shape flags                          job wkr wid rng pool         rank mem */
            (0, false, _,    _,     _,   _,               _, _, _,              _, _,                              _, _, _, _, _,            _, _): refuse(DROP_NOT_IPV4, 0);
            /* A parent's result comes from the netagg port: SourceGuard does not apply to it. */
            (0, true,  true, _,     0,   NETAGG_UDP_PORT, _, _, _,              _, _,                              _, _, _, _, _,            _, _): refuse(DROP_SPOOFED_SOURCE, 0);
            (0, true,  _,    _,     0,   _,               1, _, _,              _, _,                              _, _, _, _, _,            _, _): refuse(DROP_SPOOFED_SOURCE, 0);
            (0, true,  _,    _,     0,   _,               _, 1, _,              _, _,                              _, _, _, _, _,            _, _): refuse(DROP_SPOOFED_SOURCE, 0);
            (0, true,  _,    false, _,   _,               _, _, _,              _, _,                              _, _, _, _, _,            _, _): forward();
            (0, true,  _,    _,     _,   _,               _, _, NETAGG_VERSION, 1, _,                              _, _, _, _, _,            _, _): refuse(DROP_MALFORMED, 0);
            (0, true,  _,    _,     0,   _,               _, _, NETAGG_VERSION, _, FLAG_RESULT &&& FLAG_RESULT,    _, _, _, _, _,            _, _): refuse(DROP_RESULT_FROM_HOST, 0);
            (0, true,  _,    _,     _,   _,               _, _, NETAGG_VERSION, _, _,                              0, _, _, _, _,            _, _): refuse(DROP_UNKNOWN_JOB, 0);
            (0, true,  _,    _,     0,   _,               _, _, NETAGG_VERSION, _, _,                              _, 0, _, _, _,            _, _): refuse(DROP_UNKNOWN_WORKER, 1);
            /* Another width than the job's. */
            (0, true,  _,    _,     _,   _,               _, _, NETAGG_VERSION, _, _,                              _, _, 1, _, _,            _, _): refuse(DROP_WRONG_WIDTH, 1);
            (0, true,  _,    _,     _,   _,               _, _, NETAGG_VERSION, _, _,                              _, _, _, 1, _,            _, _): refuse(DROP_SLOT_OUT_OF_RANGE, 1);
            (0, true,  _,    _,     0,   _,               _, _, NETAGG_VERSION, _, _,                              _, _, _, _, 0 &&& 0xfe,   1, _): refuse(DROP_RANK_MISMATCH, 1);
            (0, true,  _,    _,     0,   _,               _, _, NETAGG_VERSION, _, _,                              _, _, _, _, 0 &&& 0xfe,   _, 1): refuse(DROP_NOT_A_MEMBER, 1);
            /* Deadline rounds are not built in this twin (docs/tofino.md, "Deadline rounds on Tofino
             * (design)"): every close request, and every parent's result of a closed round, is
             * refused before any register changes, so a host never reads an echoed CLOSE bit as a
             * closed round. */
            (0, true,  _,    _,     _,   _,               _, _, NETAGG_VERSION, _, FLAG_CLOSE &&& FLAG_CLOSE,      _, _, _, _, 0 &&& 0xfe,   _, _): refuse(DROP_CLOSE_REFUSED, 1);
            (0, true,  _,    _,     _,   _,               _, _, NETAGG_VERSION, _, _,                              _, _, _, _, 0 &&& 0xfe,   _, _): admit();
            /* pool > 1, version right */
            (0, true,  _,    _,     _,   _,               _, _, NETAGG_VERSION, _, _,                              _, _, _, _, _,            _, _): refuse(DROP_BAD_POOL, 1);
            /* version wrong */
            (0, true,  _,    _,     _,   _,               _, _, _,              _, _,                              _, _, _, _, _,            _, _): refuse(DROP_BAD_VERSION, 0);
        }
        /* A parser error. */
        const default_action = refuse(DROP_MALFORMED, 0);
        size = 32;
    }

    action shape_bad() {
        meta.bad_shape = 1;
    }
    /* The lengths of the packet's width, and no fragment; an undefined width code is malformed. (A
     * wide packet of the right shape is refused later, as WRONG_WIDTH: see WorkerLookup.) */
    table shape {
        key = {
            hdr.netagg.width: exact @name("width");
            hdr.ipv4.total_len: exact @name("ipv4_total_len");
            hdr.udp.length: exact @name("udp_length");
            hdr.ipv4.flags[0:0]: exact @name("more_fragments");
            hdr.ipv4.frag_offset: exact @name("frag_offset");
        }
        actions = { shape_bad; NoAction; }
        const entries = {
            (NETAGG_WIDTH, NETAGG_IPV4_TOTAL_LENGTH, NETAGG_UDP_LENGTH, 0, 0): NoAction();
            (NETAGG_WIDTH_WIDE, NETAGG_WIDE_IPV4_TOTAL_LENGTH, NETAGG_WIDE_UDP_LENGTH, 0, 0): NoAction();
        }
        const default_action = shape_bad();
        size = 2;
    }

    apply {
        hdr.bridge.setValid();
        hdr.bridge.to_group = 0;
        hdr.bridge.mgid = 0;

        if (hdr.recirc.isValid()) {
            /* A narrow packet's pass 2 (W/M/R) or 3 (READ_HI), or a wide packet's step: the value
             * pairs (below), then onwards. */
            /* Where the packet goes (ResultDelivery) is decided before the value pairs, which
             * depend on it only for a malformed pass: on Tofino 1 a branch's tables are placed in
             * the order they are applied, and the pairs need most of the pipe. Only the recirc
             * header's own rewrites come after them. */
            result_delivery.apply(hdr, meta, ig_intr_md, ig_prsr_md, ig_dprsr_md, ig_tm_md);
            value_sum.apply(hdr, meta);
            if (hdr.recirc.step == 0) {
                if (hdr.recirc.deliver != DELIVER_NONE) {
                    if (hdr.recirc.value_op == OP_MERGE || hdr.recirc.value_op == OP_READ) {
                        hdr.recirc.value_op = OP_READ_HI;
                    } else {
                        result_release.apply(hdr, ig_tm_md);
                    }
                }
            } else if (hdr.recirc.step == WIDE_STEP_LAST) {
                result_release.apply(hdr, ig_tm_md);
            } else {
                wide_step.apply(hdr);
            }
        } else if (meta.wide_whole == 1 && ig_prsr_md.parser_err == 0) {
            /* A wide packet is whole (the parser read its last value): once more as it arrived, and
             * that is its pass 1. */
            ig_dprsr_md.resubmit_type = RESUBMIT_WIDE;
        } else {
            /* Pass 1. Lookups and flags first, all independent of each other but the lookups
             * keyed by the job id, which wait for DownLink's rewrite; then the checks table sets
             * drop_reason once on every path. */
            /* What the value pairs do next and where the packet goes: nothing, unless the
             * decision below says otherwise (the recirc header is valid only if it recirculates). */
            hdr.recirc.value_op = OP_NONE;
            hdr.recirc.deliver = DELIVER_NONE;
            /* Width code 0 (narrow) is step 0; code 1 (wide) starts at chunk 0's step, 1. Another code
             * is MALFORMED (the shape table), so the header never leaves with it. */
#if NETAGG_WIDTH != 0 || NETAGG_WIDTH_WIDE != 1 || WIDE_STEP_CHUNK_0 != 1
#error "pass 1 copies the width code into recirc_h.step: narrow must be 0 and wide WIDE_STEP_CHUNK_0"
#endif
            hdr.recirc.step = hdr.netagg.width;
            ig_tm_md.ucast_egress_port = RECIRC_PORT_OF(ig_intr_md.ingress_port);
            down_link.apply(hdr, ig_intr_md.ingress_port, meta);
            /* The per-job counters' index: the packet's job, or a parent's result's local job. */
            job_index_t job = (job_index_t)hdr.netagg.job_id;
            source_guard.apply(hdr, ig_intr_md.ingress_port, meta);
            worker_lookup.apply(hdr, ig_intr_md.ingress_port, meta);
            up_link.apply(hdr, meta);
            recirc_prepare.apply(hdr, ig_intr_md.ingress_port);
            member_count.apply(hdr, meta);
            meta.exponent_key = ((bit<8>)hdr.netagg.exponent) + 8w0x80;
            /* The flags split by slices, not by masks: an action may apply one ALU operation to a
             * field, and the compiler carries a mask's AND into every later use of its result
             * ((flags & ROUND_FLAGS) | x: an "action spanning multiple stages", docs/tofino.md).
             * The slices follow ROUND_FLAGS (0x78) and ROUND_CE (0x01); the parser zeroed the rest. */
#if ROUND_FLAGS != 0x78 || ROUND_CE != 0x01 || FLAG_RETRANSMIT != 0x02
#error "the flags' slices (netagg.p4, result_delivery.p4's up actions) follow ROUND_FLAGS, ROUND_CE and FLAG_RETRANSMIT"
#endif
            meta.flags_keep[7:7] = hdr.netagg.flags[7:7];
            meta.flags_keep[2:0] = hdr.netagg.flags[2:0];
            meta.flags_round[6:3] = hdr.netagg.flags[6:3];
            /* Congestion marks (docs/protocol.md): a CE-marked packet ORs ROUND_CE into its round. */
            if (hdr.ipv4.diffserv[1:0] == ECN_CE) {
                meta.flags_round[0:0] = 1;
            }
            shape.apply();
            if (hdr.ipv4.isValid() && hdr.ipv4.ihl == 5) {
                meta.update_checksum = 1;
            }

            switch (checks.apply().action_run) {
                forward: {
                    ipv4_forward.apply(hdr, meta, ig_tm_md, ig_dprsr_md);
                }
                admit: {
                    slot_owner.apply(hdr, meta);
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
                                worker_count.apply(hdr, meta);
                            }
                            /* A parent's result: UP -> FINAL; a contribution: OPEN / UP (tree_links.p4). */
                            level_state.apply(hdr, meta);
                            if (meta.down == 1) {
                                if (meta.level == LEVEL_UP) {
                                    /* The parent's result replaces the partial (values, exponent and
                                     * round flags) and goes to the local group, as the local job's. */
                                    /* Its RESULT bit would read as ROUND_CE in the last pass, which
                                     * sets RESULT again (ResultDelivery). */
                                    hdr.netagg.flags[0:0] = 0;
                                    hdr.recirc.value_op = OP_WRITE;
                                    meta.flags_in = meta.flags_round;
                                    hdr.recirc.deliver = DELIVER_GROUP;
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
                                    /* OUT_OF_STEP, and ROUND_CE if the packet came CE-marked: one deposit. */
                                    meta.flags_in = ((bit<7>)(FLAG_OUT_OF_STEP >> 1)) ++ meta.flags_round[0:0];
                                    meta.flags_out = meta.flags_keep | FLAG_OUT_OF_STEP;
                                    if (meta.complete == 1) {
                                        hdr.recirc.value_op = OP_READ;
                                    }
                                } else {
                                    job_contributions.count(job);
                                    meta.flags_in = meta.flags_round;
                                    meta.flags_out = hdr.netagg.flags;
                                    if (meta.first == 1) {
                                        hdr.recirc.value_op = OP_WRITE;
                                    } else {
                                        hdr.recirc.value_op = OP_MERGE;
                                    }
                                }
                                if (meta.complete == 1) {
                                    if (meta.has_up == 1) {
                                        /* Not the root of the job's tree: the partial goes to the parent. */
                                        hdr.recirc.deliver = DELIVER_UP;
                                    } else {
                                        hdr.recirc.deliver = DELIVER_GROUP;
                                        job_results.count(job);
                                    }
                                }
                            } else if (meta.fresh == 0 && meta.complete == 1) {
                                /* A resend to a complete round: the stored result back to the sender,
                                 * or, while the parent's result is outstanding, the partial to the
                                 * parent again. */
                                hdr.recirc.value_op = OP_READ;
                                meta.flags_out = meta.flags_keep;
                                job_retransmit_results.count(job);
                                if (meta.has_up == 1 && meta.level != LEVEL_FINAL) {
                                    hdr.recirc.deliver = DELIVER_UP_RESEND;
                                } else {
                                    hdr.recirc.deliver = DELIVER_SENDER;
                                }
                            } else {
                                job_duplicates.count(job);
                            }
                            /* Whether or not anything leaves: a mismatched contribution marks the round. */
                            round_flags.apply(hdr, meta);
                            if (hdr.recirc.value_op == OP_NONE) {
                                /* A duplicate of an incomplete round, or late: nothing leaves. */
                                ig_dprsr_md.drop_ctl = 1;
                            } else {
                                exponent_max.apply(hdr, meta);
                                hdr.recirc.setValid();
                                if (hdr.recirc.deliver == DELIVER_UP || hdr.recirc.deliver == DELIVER_UP_RESEND) {
                                    up_delivery.apply(hdr, meta);
                                }
                            }
                        }
                    }
                }
            }
            if (meta.reject == 1) {
                job_rejects.count(job);
            }
        }
        /* Pass 1's drop reasons, and a later pass's MALFORMED (ResultDelivery). */
        if (meta.drop_reason != DROP_NONE) {
            drop_reasons.count((drop_index_t)meta.drop_reason);
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
            /* enq_qdepth >= ECN_MARK_QDEPTH, split so that a gateway can compare it (a 19-bit order
             * test exceeds what a gateway reads). */
#if ECN_MARK_QDEPTH >= 32
#error "the egress queue-depth test (netagg.p4) splits enq_qdepth at bit 5: ECN_MARK_QDEPTH must be < 32"
#endif
            if (eg_intr_md.enq_qdepth[18:5] != 0 || eg_intr_md.enq_qdepth[4:0] >= (bit<5>)ECN_MARK_QDEPTH) {
                if (hdr.ipv4.diffserv[1:0] != ECN_NOT_ECT) {
                    hdr.ipv4.diffserv[1:0] = ECN_CE;
                }
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
