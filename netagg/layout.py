"""The netagg header's byte offsets as named constants, for code that reads packets as bytes.

Derived from ``wire.HEADER_FIELDS`` (the one definition of the header), so the compiled kernels
(``softswitch.fastpath_kernels``, ``hoststack.transport_kernels``), the PS's aggregator and the steering
programs all read the same positions; numba freezes these module-level ints into its compiled code, which is
why each kernel module also states the ``wire.layout()`` it was written for (``wire.check_compiled_layout``).
"""

from __future__ import annotations

from netagg import wire

_AT = wire.FIELD_OFFSETS

VERSION_AT = _AT["version"]
FLAGS_AT = _AT["flags"]
JOB_AT = _AT["job_id"]
SLOT_AT = _AT["slot"]
POOL_AT = _AT["pool"]
RANK_AT = _AT["rank"]
EXPONENT_AT = _AT["exponent"]
WIDTH_AT = _AT["width"]
ROUND_AT = _AT["round"]
SEQ_AT = _AT["seq"]
MEMBERS_AT = _AT["members"]
EXCHANGE_AT = _AT["exchange"]
#: The values, after the header.
VALUES_AT = wire.HEADER_BYTES

#: Every name above, by header field (checked against ``wire.FIELD_OFFSETS`` by tests/test_wire.py).
BY_FIELD = {"version": VERSION_AT, "flags": FLAGS_AT, "job_id": JOB_AT, "slot": SLOT_AT, "pool": POOL_AT,
            "rank": RANK_AT, "exponent": EXPONENT_AT, "width": WIDTH_AT, "round": ROUND_AT, "seq": SEQ_AT,
            "members": MEMBERS_AT, "exchange": EXCHANGE_AT}
