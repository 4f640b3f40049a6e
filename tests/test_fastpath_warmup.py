"""After warm-up, real traffic compiles nothing: every numba kernel the software target's loop and the
worker's transport call was compiled (or loaded from the cache) before the first packet.

A kernel compiled for other array layouts than the loop passes would compile again on the first
batch, inside the switch's loop or a worker's progress timeout (seconds on 2 cores).
"""

from __future__ import annotations

import numpy as np
import pytest

from netagg.softswitch import fastpath

if fastpath.unavailable():
    pytest.skip(f"compiled fast paths unavailable: {fastpath.unavailable()}", allow_module_level=True)

from netagg.hoststack import transport_kernels
from netagg.hoststack.transport import Transport
from netagg.softswitch import batch_switch, fastpath_kernels, io_kernels, raw_segmentation
from netagg.testing.hoststack import expected_allreduce, run_workers
from netagg.testing.softswitch import LoopbackSwitch


def _signatures() -> dict[str, int]:
    found = {}
    for module in (fastpath_kernels, io_kernels, raw_segmentation, transport_kernels):
        for name in dir(module):
            kernel = getattr(module, name)
            if hasattr(kernel, "signatures") and hasattr(kernel, "py_func"):
                found[f"{module.__name__}.{name}"] = len(kernel.signatures)
    return found


def test_a_job_through_the_batch_loop_compiles_nothing_after_warm_up():
    rng = np.random.default_rng(4)
    inputs = [rng.standard_normal(20_000).astype(np.float32) for _ in range(3)]
    with LoopbackSwitch() as switch:  # the target warms its kernels before it starts
        assert isinstance(switch.target.switch, batch_switch.BatchSwitch)
        configs = switch.add_job(3, slot_count=32)
        for config in configs:  # a transport warms its kernels when it is created
            Transport(config).close()
        before = _signatures()
        results = run_workers(configs, lambda w, rank: w.allreduce(inputs[rank]))
        after = _signatures()
    expected, _ = expected_allreduce(inputs)
    for result in results:
        np.testing.assert_array_equal(result, expected)
    grew = {name: (before.get(name, 0), count) for name, count in after.items() if count != before.get(name, 0)}
    assert not grew, f"kernels compiled during traffic (signatures before, after): {grew}"
