"""The data plane's control contract: P4Runtime names, counter indices, paths.

These are the names in ``p4src/v1model/netagg.p4info.txtpb`` that the controller writes
and reads, and the drop reasons indexing the ``drop_reasons`` counter. The P4
source defines the same numbers (``p4src/shared/defines.p4``); a test checks
that they agree.
"""

from __future__ import annotations

from enum import IntEnum
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
P4SRC_DIR = REPO_ROOT / "p4src"
SHARED_P4_DIR = P4SRC_DIR / "shared"
#: The v1model program (BMv2 and the software target) and the TNA program (Tofino).
P4_PROGRAM = P4SRC_DIR / "v1model" / "netagg.p4"
TNA_PROGRAM = P4SRC_DIR / "tna" / "netagg.p4"
#: The committed P4Info (explicit @ids); ``make build`` regenerates it with p4c.
P4INFO_PATH = P4SRC_DIR / "v1model" / "netagg.p4info.txtpb"
BUILD_DIR = REPO_ROOT / "build"
#: BMv2 JSON produced by ``make build`` (only needed for the BMv2 target).
BMV2_JSON_PATH = BUILD_DIR / "netagg.json"

# Tables.
TABLE_JOBS = "NetaggIngress.worker_lookup.jobs"
TABLE_WORKERS = "NetaggIngress.worker_lookup.workers"
TABLE_ROUTES = "NetaggIngress.ipv4_forward.routes"
TABLE_REPLICAS = "NetaggEgress.result_rewrite.replicas"
TABLE_SOURCES = "NetaggIngress.source_guard.sources"
#: A tree of switches (p4src/v1model/control/tree_links.p4, docs/hierarchy.md).
TABLE_UP_LINKS = "NetaggIngress.up_link.up_links"
TABLE_DOWN_LINKS = "NetaggIngress.down_link.down_links"

# Actions.
ACTION_SET_JOB = "NetaggIngress.worker_lookup.set_job"
ACTION_UNKNOWN_JOB = "NetaggIngress.worker_lookup.unknown_job"
ACTION_SET_WORKER = "NetaggIngress.worker_lookup.set_worker"
ACTION_UNKNOWN_WORKER = "NetaggIngress.worker_lookup.unknown_worker"
ACTION_FORWARD = "NetaggIngress.ipv4_forward.forward"
ACTION_NO_ROUTE = "NetaggIngress.ipv4_forward.no_route"
ACTION_SET_DESTINATION = "NetaggEgress.result_rewrite.set_destination"
ACTION_NO_REPLICA = "NetaggEgress.result_rewrite.no_replica"
ACTION_SWITCH_ONLY = "NetaggIngress.source_guard.switch_only"
ACTION_BIND_TO_PORT = "NetaggIngress.source_guard.bind_to_port"
ACTION_SET_UP_LINK = "NetaggIngress.up_link.set_up_link"
ACTION_SET_DOWN_LINK = "NetaggIngress.down_link.set_down_link"

# Counters.
COUNTER_DROP_REASONS = "NetaggIngress.drop_reasons"
COUNTER_EGRESS_DROP_REASONS = "NetaggEgress.egress_drop_reasons"
COUNTER_JOB_CONTRIBUTIONS = "NetaggIngress.job_contributions"
COUNTER_JOB_RESULTS = "NetaggIngress.job_results"
COUNTER_JOB_DUPLICATES = "NetaggIngress.job_duplicates"
COUNTER_JOB_RETRANSMIT_RESULTS = "NetaggIngress.job_retransmit_results"
COUNTER_JOB_REJECTS = "NetaggIngress.job_rejects"

#: Per-job counters (indexed by job id), by the short name the CLI shows.
JOB_COUNTERS: dict[str, str] = {
    "contributions": COUNTER_JOB_CONTRIBUTIONS,
    "results": COUNTER_JOB_RESULTS,
    "duplicates": COUNTER_JOB_DUPLICATES,
    "retransmit_results": COUNTER_JOB_RETRANSMIT_RESULTS,
    "rejects": COUNTER_JOB_REJECTS,
}

# Registers (not readable over P4Runtime on BMv2, see p4lang/PI#376).
REGISTER_SLOT_OWNER = "NetaggIngress.slot_owner.slot_owner"
REGISTER_LEVEL_STATE = "NetaggIngress.level_state.level_state"

#: Port value v1model uses for "drop".
DROP_PORT = 511


class DropReason(IntEnum):
    """Index of the ``drop_reasons`` counters (DROP_* in defines.p4)."""

    NONE = 0
    NOT_IPV4 = 1
    NO_ROUTE = 2
    TTL_EXPIRED = 3
    MALFORMED = 4
    BAD_VERSION = 5
    RESULT_FROM_HOST = 6
    UNKNOWN_JOB = 7
    UNKNOWN_WORKER = 8
    SLOT_OUT_OF_RANGE = 9
    BAD_POOL = 10
    RANK_MISMATCH = 11
    NO_REPLICA = 12
    SPOOFED_SOURCE = 13
    NOT_A_MEMBER = 14
    MEMBERS_MISMATCH = 15
    #: A new contribution naming another collective (``exchange``) than its round's: not added; the round is
    #: marked OUT_OF_STEP (docs/protocol.md, "Collectives out of step").
    EXCHANGE_MISMATCH = 16
    #: A packet whose ``width`` (a defined code) is not its job's: a slot of another width spans other cells.
    WRONG_WIDTH = 17
    #: A close request (``FLAG_CLOSE``) for a job with an up link on this switch, or a parent's result of a closed
    #: round: deadline rounds are a single switch's (docs/protocol.md, "Closing a round at a deadline").
    CLOSE_REFUSED = 18
    #: A new contribution to a round that was closed without it: not added; the sender gets the stored result
    #: (``FLAG_CLOSE``, the contributors in ``members``), which tells it that it missed the round.
    LATE_FOR_CLOSED_ROUND = 19


class Level(IntEnum):
    """Where a (slot, pool)'s round stands in a tree of switches (LEVEL_* in defines.p4)."""

    OPEN = 0  #: collecting (or complete on a switch without an up link)
    UP = 1  #: complete here, the partial sent to the parent, its result not yet back
    FINAL = 2  #: the parent's result is stored in the slot


class ValueOp(IntEnum):
    """What the value and exponent registers do with a packet (OP_* in defines.p4)."""

    NONE = 0
    WRITE = 1
    MERGE = 2
    READ = 3
