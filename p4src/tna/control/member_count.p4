/* netagg (TNA): how many contributions does a round expect? The job's worker count, or for a
 * subset round (hdr.netagg.members != 0) the number of its members (v1model/control/
 * worker_count.p4 adds the 32 bits one by one, which Tofino cannot do in a few stages).
 * Here four 256-entry exact tables, one per byte of members, give the bytes' numbers of set
 * bits in the first stage, and two additions sum them: the count is ready long before
 * WorkerCount, which needs it only after the slot owner, round and bitmap stages. Where a
 * subset round's members are checked: see bitmap_check.p4 (the round's members share the
 * bitmap's register entry, so that no stateful ALU is added). */
#ifndef _NETAGG_TNA_MEMBER_COUNT_P4_
#define _NETAGG_TNA_MEMBER_COUNT_P4_

/* The 256 entries of a byte's table: byte value -> its number of set bits (ones(n) is the
 * byte table's action). POPCOUNT_ROW(a, h, o): the 16 bytes with high nibble h, which has o
 * set bits. */
#define POPCOUNT_ROW(a, h, o)                                                               \
    h * 16 + 0: a(o + 0); h * 16 + 1: a(o + 1); h * 16 + 2: a(o + 1); h * 16 + 3: a(o + 2);   \
    h * 16 + 4: a(o + 1); h * 16 + 5: a(o + 2); h * 16 + 6: a(o + 2); h * 16 + 7: a(o + 3);   \
    h * 16 + 8: a(o + 1); h * 16 + 9: a(o + 2); h * 16 + 10: a(o + 2); h * 16 + 11: a(o + 3); \
    h * 16 + 12: a(o + 2); h * 16 + 13: a(o + 3); h * 16 + 14: a(o + 3); h * 16 + 15: a(o + 4);
#define POPCOUNT_ENTRIES(a)                                                                 \
    POPCOUNT_ROW(a, 0, 0) POPCOUNT_ROW(a, 1, 1) POPCOUNT_ROW(a, 2, 1) POPCOUNT_ROW(a, 3, 2)     \
    POPCOUNT_ROW(a, 4, 1) POPCOUNT_ROW(a, 5, 2) POPCOUNT_ROW(a, 6, 2) POPCOUNT_ROW(a, 7, 3)     \
    POPCOUNT_ROW(a, 8, 1) POPCOUNT_ROW(a, 9, 2) POPCOUNT_ROW(a, 10, 2) POPCOUNT_ROW(a, 11, 3)   \
    POPCOUNT_ROW(a, 12, 2) POPCOUNT_ROW(a, 13, 3) POPCOUNT_ROW(a, 14, 3) POPCOUNT_ROW(a, 15, 4)

#define MEMBER_BYTE_TABLE(n, hi, lo)                                                        \
    action ones_##n(bit<8> ones) {                                                          \
        meta.member_byte_##n = ones;                                                        \
    }                                                                                       \
    table member_byte_##n {                                                                 \
        key = {                                                                             \
            hdr.netagg.members[hi:lo]: exact @name("members_byte");                         \
        }                                                                                   \
        actions = {                                                                         \
            ones_##n;                                                                       \
        }                                                                                   \
        const entries = {                                                                   \
            POPCOUNT_ENTRIES(ones_##n)                                                      \
        }                                                                                   \
        const default_action = ones_##n(0);                                                 \
        size = 256;                                                                         \
    }

control MemberCount(in tna_headers_t hdr, inout ingress_metadata_t meta) {
    MEMBER_BYTE_TABLE(0, 7, 0)
    MEMBER_BYTE_TABLE(1, 15, 8)
    MEMBER_BYTE_TABLE(2, 23, 16)
    MEMBER_BYTE_TABLE(3, 31, 24)

    apply {
        member_byte_0.apply();
        member_byte_1.apply();
        member_byte_2.apply();
        member_byte_3.apply();
        meta.member_byte_0 = meta.member_byte_0 + meta.member_byte_1;
        meta.member_byte_2 = meta.member_byte_2 + meta.member_byte_3;
        if (hdr.netagg.members == 0) {
            meta.expected = meta.num_workers;
        } else {
            meta.expected = meta.member_byte_0 + meta.member_byte_2;
        }
    }
}

#endif
