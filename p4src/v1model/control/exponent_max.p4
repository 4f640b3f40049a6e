/* netagg: the block exponent of a slot's round: the first contribution writes
 * its exponent, later ones keep the maximum (signed), a resent result reads it.
 * The packet leaves carrying the register's new value. */
#ifndef _NETAGG_EXPONENT_MAX_P4_
#define _NETAGG_EXPONENT_MAX_P4_

control ExponentMax(inout headers_t hdr, in metadata_t meta) {
    @id(0x16000005)
    register<bit<8>>(NUM_POOL_SLOTS) exponent_max;

    apply {
        bit<8> stored;
        exponent_max.read(stored, meta.pool_index);
        if (meta.value_op == OP_WRITE) {
            stored = (bit<8>)hdr.netagg.exponent;
            exponent_max.write(meta.pool_index, stored);
        } else if (meta.value_op == OP_MERGE) {
            if (hdr.netagg.exponent > (int<8>)stored) {
                stored = (bit<8>)hdr.netagg.exponent;
            }
            exponent_max.write(meta.pool_index, stored);
        }
        hdr.netagg.exponent = (int<8>)stored;
    }
}

#endif
