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

    action do_write() { hdr.netagg.exponent = (int<8>)write_exponent.execute(POOL_INDEX); }
    action do_merge() { hdr.netagg.exponent = (int<8>)merge_exponent.execute(POOL_INDEX); }
    action do_read() { hdr.netagg.exponent = (int<8>)read_exponent.execute(POOL_INDEX); }

    /* The access follows the value operation (the recirc header's, set by the decision). */
    table exponent_access {
        key = { hdr.recirc.value_op: exact @name("value_op"); }
        actions = { do_write; do_merge; do_read; NoAction; }
        const entries = {
            OP_WRITE: do_write();
            OP_MERGE: do_merge();
            OP_READ: do_read();
        }
        const default_action = NoAction();
        size = 4;
    }

    apply {
        exponent_access.apply();
    }
}

#endif
