/* netagg: the K running sums of a slot's round, one register per value index.
 * write: the round's first contribution overwrites (no zeroing needed);
 * merge: a new contribution adds (two's complement, no overflow by construction
 *        of the host's quantization) and the packet carries the new sums;
 * read:  a resent result copies the stored sums into the packet. */
#ifndef _NETAGG_VALUE_SUM_P4_
#define _NETAGG_VALUE_SUM_P4_

#define VALUE_REGISTER(i) @id(0x160001##i) register<bit<32>>(NUM_POOL_SLOTS) value_##i;
#define VALUE_WRITE(i) value_##i.write(meta.pool_index, hdr.values.v##i);
#define VALUE_MERGE(i) \
    value_##i.read(sum, meta.pool_index); \
    sum = sum + hdr.values.v##i; \
    value_##i.write(meta.pool_index, sum); \
    hdr.values.v##i = sum;
#define VALUE_READ(i) value_##i.read(hdr.values.v##i, meta.pool_index);

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

    apply {
        if (meta.value_op == OP_WRITE) {
            write_values();
        } else if (meta.value_op == OP_MERGE) {
            merge_values();
        } else if (meta.value_op == OP_READ) {
            read_values();
        }
    }
}

#endif
