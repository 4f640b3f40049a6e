"""``python -m netagg.apps.warmup``: compile netagg's numba kernels into numba's on-disk cache, once.

``make`` runs it right after installing, so that neither the software target nor a worker
compiles (tens of seconds on a 2-core machine) when it starts; later processes load the
cached machine code in well under a second. Without numba it says so and does nothing:
the reference paths run.
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    from netagg.softswitch import fastpath

    reason = fastpath.unavailable()
    if reason is not None:
        print(f"netagg: compiled fast paths unavailable here ({reason}); the reference paths will run")
        return 0
    start = time.monotonic()
    fastpath.warm_up()
    from netagg.hoststack.transport import Transport
    from netagg.jobconfig import Endpoint, WorkerConfig

    config = WorkerConfig(job_id=1, rank=0, num_workers=1, slot_count=4, mode="allreduce",
                          aggregator=Endpoint("127.0.0.1", 9), bind=Endpoint("127.0.0.1", 0))
    Transport(config).close()  # its constructor compiles (or loads) the transport's kernels
    print(f"netagg: compiled fast paths ready ({time.monotonic() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
