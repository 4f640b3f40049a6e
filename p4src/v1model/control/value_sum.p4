/* netagg: the running sums of a slot's round, one register per value index of a cell
 * (NETAGG_K registers of NUM_POOL_SLOTS rows: a row per cell and pool).
 * write: the round's first contribution overwrites (no zeroing needed);
 * merge: a new contribution adds (two's complement, no overflow by construction
 *        of the host's quantization) and the packet carries the new sums;
 * read:  a resent result copies the stored sums into the packet.
 * A narrow packet's values (chunk 0) live in the row of its slot's first cell, meta.pool_index.
 * A wide packet's chunk c (hdr.values1..3, values 64c .. 64c + 63) lives in the row of the
 * cell c after it: pool_index + NUM_POOLS * c. Each chunk has its own three actions (a chunk's
 * header is valid only in a wide packet), generated below. */
#ifndef _NETAGG_VALUE_SUM_P4_
#define _NETAGG_VALUE_SUM_P4_

#define VALUE_REGISTER(i) @id(0x160001##i) register<bit<32>>(NUM_POOL_SLOTS) value_##i;

/* Chunk h (its header) at row pool_index + row. */
#define CHUNK_WRITE(h, row, i) value_##i.write(meta.pool_index + row, hdr.h.v##i);
#define CHUNK_MERGE(h, row, i) \
    value_##i.read(sum, meta.pool_index + row); \
    sum = sum + hdr.h.v##i; \
    value_##i.write(meta.pool_index + row, sum); \
    hdr.h.v##i = sum;
#define CHUNK_READ(h, row, i) value_##i.read(hdr.h.v##i, meta.pool_index + row);

#define VALUE_WRITE(i) CHUNK_WRITE(values, 0, i)
#define VALUE_MERGE(i) CHUNK_MERGE(values, 0, i)
#define VALUE_READ(i) CHUNK_READ(values, 0, i)
#define VALUE_WRITE_1(i) CHUNK_WRITE(values1, NUM_POOLS * 1, i)
#define VALUE_MERGE_1(i) CHUNK_MERGE(values1, NUM_POOLS * 1, i)
#define VALUE_READ_1(i) CHUNK_READ(values1, NUM_POOLS * 1, i)
#define VALUE_WRITE_2(i) CHUNK_WRITE(values2, NUM_POOLS * 2, i)
#define VALUE_MERGE_2(i) CHUNK_MERGE(values2, NUM_POOLS * 2, i)
#define VALUE_READ_2(i) CHUNK_READ(values2, NUM_POOLS * 2, i)
#define VALUE_WRITE_3(i) CHUNK_WRITE(values3, NUM_POOLS * 3, i)
#define VALUE_MERGE_3(i) CHUNK_MERGE(values3, NUM_POOLS * 3, i)
#define VALUE_READ_3(i) CHUNK_READ(values3, NUM_POOLS * 3, i)

/* The write, merge and read actions of wide chunk c, with their @ids. */
#define CHUNK_ACTIONS(c, write_id, merge_id, read_id) \
    @id(write_id) \
    action write_values_##c() { \
        FOR_EACH_VALUE(VALUE_WRITE_##c) \
    } \
    @id(merge_id) \
    action merge_values_##c() { \
        bit<32> sum; \
        FOR_EACH_VALUE(VALUE_MERGE_##c) \
    } \
    @id(read_id) \
    action read_values_##c() { \
        FOR_EACH_VALUE(VALUE_READ_##c) \
    }

control ValueSum(inout headers_t hdr, in metadata_t meta) {
    FOR_EACH_VALUE(VALUE_REGISTER)

    @id(0x01000009)
    action write_values() {
        FOR_EACH_VALUE(VALUE_WRITE)
    }

    @id(0x0100000a)
    action merge_values() {
        bit<32> sum;
        FOR_EACH_VALUE(VALUE_MERGE)
    }

    @id(0x0100000b)
    action read_values() {
        FOR_EACH_VALUE(VALUE_READ)
    }

    CHUNK_ACTIONS(1, 0x01000013, 0x01000014, 0x01000015)
    CHUNK_ACTIONS(2, 0x01000016, 0x01000017, 0x01000018)
    CHUNK_ACTIONS(3, 0x01000019, 0x0100001a, 0x0100001b)

    apply {
        if (meta.value_op == OP_WRITE) {
            write_values();
            if (hdr.values1.isValid()) { write_values_1(); }
            if (hdr.values2.isValid()) { write_values_2(); }
            if (hdr.values3.isValid()) { write_values_3(); }
        } else if (meta.value_op == OP_MERGE) {
            merge_values();
            if (hdr.values1.isValid()) { merge_values_1(); }
            if (hdr.values2.isValid()) { merge_values_2(); }
            if (hdr.values3.isValid()) { merge_values_3(); }
        } else if (meta.value_op == OP_READ) {
            read_values();
            if (hdr.values1.isValid()) { read_values_1(); }
            if (hdr.values2.isValid()) { read_values_2(); }
            if (hdr.values3.isValid()) { read_values_3(); }
        }
    }
}

#endif
