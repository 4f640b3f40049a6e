"""The software target's pipeline on arbitrary and mutated frames: no crash, only well-formed output.

Hostile or broken hosts can put any bytes on a port. Every frame must end as emitted
packets or a drop (counted when the P4 program counts it); the model must never raise,
and every packet it emits must be a whole netagg result or a forwarded frame.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netagg import dataplane as dp
from netagg import wire

testing = pytest.importorskip("netagg.testing.softswitch")
from netagg.softswitch.target import LOOPBACK_PORT_NUMBER  # noqa: E402


@pytest.fixture(scope="module")
def switch_and_frames():
    with testing.LoopbackSwitch() as switch:
        configs = switch.add_job(2, slot_count=4)
        port = switch.target.loopback
        frames = []
        for config in configs:
            header = wire.Header(job_id=config.job_id, slot=1, pool=0, rank=config.rank, seq=7, exponent=3, round=1)
            payload = wire.pack(header, np.arange(wire.K, dtype=np.int32))
            frames.append(port._frame_for(payload, config.bind.host, config.bind.port))
        yield switch, frames


_ACCOUNTING = (dp.COUNTER_DROP_REASONS, dp.COUNTER_EGRESS_DROP_REASONS, dp.COUNTER_JOB_CONTRIBUTIONS,
               dp.COUNTER_JOB_DUPLICATES, dp.COUNTER_JOB_REJECTS)


def _mutate(frame: bytes, data: st.DataObject) -> bytes:
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "random"]))
    if kind == "random":
        return data.draw(st.binary(max_size=400))
    if kind == "truncate":
        return frame[:data.draw(st.integers(0, len(frame) - 1))]
    if kind == "extend":
        return frame + data.draw(st.binary(min_size=1, max_size=64))
    out = bytearray(frame)
    for _ in range(data.draw(st.integers(1, 8))):
        out[data.draw(st.integers(0, len(out) - 1))] = data.draw(st.integers(0, 255))
    return bytes(out)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_frame_ends_as_well_formed_output_or_a_drop_never_an_exception(switch_and_frames, data):
    switch, frames = switch_and_frames
    pipeline = switch.target.pipeline
    frame = _mutate(data.draw(st.sampled_from(frames)), data)
    state = switch.target.state
    before = {name: state.counter_total(name) for name in _ACCOUNTING}
    out = pipeline.process(frame, LOOPBACK_PORT_NUMBER)
    moved = {name for name in _ACCOUNTING if state.counter_total(name) != before[name]}
    # Emitted, or accounted for: a counted drop, or a contribution/duplicate/reject of some job.
    assert out or moved, f"frame {frame.hex()} vanished without a count"
    for egress_port, emitted in out:
        assert isinstance(egress_port, int) and egress_port >= 0
        if len(emitted) == wire.FRAME_BYTES:  # a netagg result: its payload decodes
            header, _ = wire.unpack(emitted[-wire.NETAGG_BYTES:])
            assert header.is_result


def test_clean_rounds_still_aggregate_after_the_fuzzing(switch_and_frames):
    switch, _ = switch_and_frames
    port = switch.target.loopback
    configs = switch.add_job(2, slot_count=2)
    out = []
    for config in configs:
        header = wire.Header(job_id=config.job_id, slot=0, pool=0, rank=config.rank, seq=1, round=1)
        frame = port._frame_for(wire.pack(header, np.full(wire.K, 5, np.int32)), config.bind.host, config.bind.port)
        out = switch.target.pipeline.process(frame, LOOPBACK_PORT_NUMBER)
    assert out, "the second contribution completes the round"
    header, values = wire.unpack(out[0][1][-wire.NETAGG_BYTES:])
    assert header.is_result and header.job_id == configs[0].job_id
    np.testing.assert_array_equal(values, np.full(wire.K, 10, np.int32))
