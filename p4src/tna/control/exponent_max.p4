/* netagg (TNA): the block exponent of a slot's round; see v1model/control/exponent_max.p4.
 * The register holds exponent + 0x80 (mod 256), so that the stateful ALU's unsigned max orders the
 * signed exponents. The packet carries the register's new (biased) value on to its last
 * pass, where ResultDelivery unbiases it: one fewer stage in pass 1. */
#ifndef _NETAGG_TNA_EXPONENT_MAX_P4_
#define _NETAGG_TNA_EXPONENT_MAX_P4_

control ExponentMax(inout tna_headers_t hdr, inout ingress_metadata_t meta) {
    Register<bit<8>, pool_reg_index_t>(NUM_POOL_SLOTS, 0x80) exponent_max;

    RegisterAction<bit<8>, pool_reg_index_t, bit<8>>(exponent_max) write_exponent = {
        void apply(inout bit<8> stored, out bit<8> result) {
            stored = meta.exponent_key;
            result = stored;
        }
    };
    RegisterAction<bit<8>, pool_reg_index_t, bit<8>>(exponent_max) merge_exponent = {
        void apply(inout bit<8> stored, out bit<8> result) {
            stored = max(stored, meta.exponent_key);
            result = stored;
        }
    };
    RegisterAction<bit<8>, pool_reg_index_t, bit<8>>(exponent_max) read_exponent = {
        void apply(inout bit<8> stored, out bit<8> result) {
            result = stored;
        }
    };

    apply {
        if (meta.value_op == OP_WRITE) {
            hdr.netagg.exponent = (int<8>)write_exponent.execute(meta.pool_index);
        } else if (meta.value_op == OP_MERGE) {
            hdr.netagg.exponent = (int<8>)merge_exponent.execute(meta.pool_index);
        } else if (meta.value_op == OP_READ) {
            hdr.netagg.exponent = (int<8>)read_exponent.execute(meta.pool_index);
        }
    }
}

#endif
