/* netagg: do a round's contributions belong to the same collective?
 * Every packet names its collective in hdr.netagg.exchange (wire.exchange_id: the collective's
 * number, size and tag). A NEW round stores the packet's exchange in its (slot, pool)'s
 * round_exchange entry; in the SAME round the stored value is compared with the packet's and
 * meta.exchange_mismatch says whether they differ. Nothing is dropped here: the ingress decides
 * (docs/protocol.md, "Round flags"): a fresh contribution of another collective is not added but
 * still counts towards completion, and RoundFlags marks the round OUT_OF_STEP; a resend ignores
 * the mismatch. The round's first packet can never mismatch. Applied to contributions only
 * (a parent's result coming down skips it), after MemberCheck, to packets of a current or new
 * round that nothing has rejected. */
#ifndef _NETAGG_EXCHANGE_CHECK_P4_
#define _NETAGG_EXCHANGE_CHECK_P4_

control ExchangeCheck(in headers_t hdr, inout metadata_t meta) {
    @id(0x16000009)
    register<bit<32>>(NUM_POOL_SLOTS) round_exchange;

    apply {
        meta.exchange_mismatch = 0;
        if (meta.round_state == ROUND_NEW) {
            round_exchange.write(meta.pool_index, hdr.netagg.exchange);
        } else {
            bit<32> expected;
            round_exchange.read(expected, meta.pool_index);
            if (expected != hdr.netagg.exchange) {
                meta.exchange_mismatch = 1;
            }
        }
    }
}

#endif
