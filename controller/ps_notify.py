"""Tell the jobs' parameter servers that the switch is back (hoststack/failover.py, "Return").

A job whose switch stayed away runs its exchanges at its PS; the PS retries the switch on a timer, and
sooner when the controller, which watches the switch, says it is in sync again. ``fresh``: the switch
had lost its state (restarted), so its registers hold no round of any job and the PS may return the job
however far its slots' round numbers moved meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from netagg.controller.store import JobRecord
from netagg.psproto import PsClient, PsError

log = logging.getLogger("netagg.controller")

#: Per PS: connect and answer within this (a PS that is not running costs one refused connection).
TIMEOUT = 1.0


def tell_parameter_servers(jobs: Iterable[JobRecord], fresh: bool, timeout: float = TIMEOUT) -> tuple[int, int]:
    """Send ``switch_back`` to the PS of every live job that aggregates on the switch and has one; returns
    (told, not reached). Never raises: a PS that is not running simply has no job on it to bring back."""
    told = missed = 0
    for job in jobs:
        if job.ps is None or job.state != "active" or not job.uses_switch:
            continue
        try:
            client = PsClient((job.ps.ip, job.ps.udp_port), timeout=timeout, secret=job.secret)
            try:
                client.request({"op": "switch_back", "job_id": job.job_id, "fresh": fresh})
            finally:
                client.close()
            told += 1
        except PsError as err:
            missed += 1
            log.debug("job %d: cannot tell its PS %s:%d that the switch is back: %s", job.job_id, job.ps.ip,
                      job.ps.udp_port, err)
    return told, missed
