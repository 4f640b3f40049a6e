"""A worker over several threads (hoststack/threads.py): the slot ranges, the steering of results to the
thread that owns their slot, and allreduces bit-identical to one thread, with and without loss."""

from __future__ import annotations

import dataclasses
import json
import select
import socket
import time

import numpy as np
import pytest
import yaml

from netagg import steering, wire
from netagg.hoststack.envconfig import config_from_env
from netagg.hoststack.threads import split_blocks, thread_shares
from netagg.jobconfig import ConfigError, Endpoint, WorkerConfig
from netagg.testing.hoststack import block_scaled_inputs, expected_allreduce, run_workers

testing = pytest.importorskip("netagg.testing.softswitch")

N = 4


def _inputs(size: int, seed: int) -> list[np.ndarray]:
    return block_scaled_inputs(N, size, seed, decades=20)


def test_thread_shares_are_contiguous_whole_blocks_covering_every_slot():
    assert thread_shares(256, 2) == [(0, 128), (128, 128)]
    assert thread_shares(256, 3) == [(0, 128), (128, 64), (192, 64)]
    assert thread_shares(200, 2) == [(0, 128), (128, 72)]  # the last block is partial
    assert thread_shares(100, 4) == [(0, 64), (64, 36)]  # only 2 blocks: 2 threads
    assert thread_shares(32, 8) == [(0, 32)]
    for slots in (1, 63, 64, 65, 300, 4096):
        for threads in (1, 2, 3, 5, 8):
            shares = thread_shares(slots, threads)
            assert sum(count for _, count in shares) == slots
            assert all(first % 64 == 0 for first, _ in shares)
            assert [first for first, _ in shares[1:]] == [f + c for f, c in shares[:-1]]


def test_split_blocks_cuts_in_proportion_to_each_threads_slots():
    assert split_blocks(100, [(0, 128), (128, 64), (192, 64)]) == [(0, 50), (50, 75), (75, 100)]
    assert split_blocks(0, [(0, 64), (64, 64)]) == [(0, 0), (0, 0)]
    assert split_blocks(1, [(0, 64), (64, 64)]) == [(0, 0), (0, 1)]


def test_a_range_program_steers_each_result_to_the_thread_that_owns_its_slot():
    bases = [0, 128, 192]
    socks = steering.udp_group("127.0.0.1", 0, 3, program=steering.udp_range_program(bases))
    try:
        port = socks[0].getsockname()[1]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
            for slot in (0, 1, 127, 128, 191, 192, 300, 65535):
                header = wire.HEADER_STRUCT.pack(wire.VERSION, wire.FLAG_RESULT, 9, slot, 0, 0, 0, 0, 1, 0, 0, 0)
                tx.sendto(header + bytes(wire.PAYLOAD_BYTES), ("127.0.0.1", port))
                select.select(socks, [], [], 2)
                time.sleep(0.01)
                got = [i for i, s in enumerate(socks) if select.select([s], [], [], 0)[0]]
                for i in got:
                    socks[i].recv(4096)
                want = 2 if slot >= 192 else 1 if slot >= 128 else 0
                assert got == [want], slot
    finally:
        for sock in socks:
            sock.close()
    for bad in ([64, 128], [0, 100], [0, 128, 128]):
        with pytest.raises(ValueError):
            steering.udp_range_program(bad)


@pytest.mark.parametrize(("threads", "shards"), [(2, 1), pytest.param(3, 2, marks=pytest.mark.slow)])
def test_allreduce_over_threads_is_bit_identical_to_one_thread(threads, shards):
    inputs = _inputs(60_000, 7)
    expected, _ = expected_allreduce(inputs)
    with testing.LoopbackSwitch(shards=shards) as switch:
        configs = [dataclasses.replace(c, threads=threads) for c in switch.add_job(N, slot_count=256)]
        results = run_workers(configs, lambda w, rank: (w.transport.threads,
                                                        [w.allreduce(inputs[rank]) for _ in range(2)][-1],
                                                        w.transport.stats))
        counters = switch.counters(configs[0].job_id)
    for used, got, stats in results:
        assert used == threads
        np.testing.assert_array_equal(got, expected)
        assert stats.exchanges == 2 and stats.blocks == 2 * -(-60_000 // wire.K)
    blocks = -(-60_000 // wire.K)
    assert counters["results"] == 2 * (blocks + 256)  # every round once (each thread probes its own slots)


@pytest.mark.slow
def test_exchanges_of_growing_and_shrinking_sizes_over_processes_stay_exact():
    """The shares' shared memory grows with the exchange (a new segment) and is reused for smaller ones."""
    sizes = [1_000, 90_000, 5_000, 0, 130_000]
    inputs = {size: _inputs(size, size) for size in sizes}
    with testing.LoopbackSwitch() as switch:
        configs = [dataclasses.replace(c, threads=2) for c in switch.add_job(N, slot_count=128)]
        results = run_workers(configs, lambda w, rank: [w.allreduce(inputs[size][rank]) for size in sizes])
    for per_rank in results:
        for size, got in zip(sizes, per_rank, strict=True):
            np.testing.assert_array_equal(got, expected_allreduce(inputs[size])[0])


@pytest.mark.slow
@pytest.mark.parametrize("faults", [{"drop": 0.05, "duplicate": 0.02, "reorder": 0.02, "seed": 3},
                                    {"burst": 0.004, "burst_length": 64, "seed": 11}])
def test_allreduce_over_threads_under_loss_stays_exact(faults):
    inputs = _inputs(30_000, 8)
    expected, _ = expected_allreduce(inputs)
    with testing.LoopbackSwitch(**faults) as switch:
        configs = [dataclasses.replace(c, threads=2) for c in switch.add_job(N, slot_count=128)]
        # The exactness under loss is the point, not the start: on a busy machine another rank's share process
        # may still be starting when this one's first round times out, so give the peers time.
        results = run_workers(configs, lambda w, rank: [w.allreduce(inputs[rank]) for _ in range(2)],
                              rto_initial=0.01, progress_timeout=30.0)
        counters = switch.counters(configs[0].job_id)
    for pair in results:
        for got in pair:
            np.testing.assert_array_equal(got, expected)
    assert counters["retransmit_results"] > 0
    assert counters["results"] == 2 * (-(-30_000 // wire.K) + 128)


def test_threads_is_a_checked_job_setting():
    base = dict(job_id=1, rank=0, num_workers=2, slot_count=128, mode="allreduce",
                aggregator=Endpoint("127.0.0.1", 1), bind=Endpoint("127.0.0.1", 2))
    assert WorkerConfig(**base, threads=4).threads == 4
    for bad in (0, 65, True, 2.0):
        with pytest.raises(ConfigError, match="threads"):
            WorkerConfig(**base, threads=bad)
    with pytest.raises(ConfigError, match="threads"):
        WorkerConfig(**{**base, "mode": "ps", "ps": Endpoint("127.0.0.1", 3)}, threads=2)
    with pytest.raises(ConfigError, match="threads"):
        WorkerConfig(**base, threads=2, senders=1)
    env = {"NETAGG_JOB_ID": "1", "DMLC_NUM_WORKER": "2", "NETAGG_RANK": "0", "NETAGG_SLOTS": "128",
           "NETAGG_MODE": "allreduce", "NETAGG_AGGREGATOR": "127.0.0.1:28900", "NETAGG_BIND": "127.0.0.1:40000",
           "NETAGG_THREADS": "3"}
    assert config_from_env(env).threads == 3
    with pytest.raises(ConfigError, match="NETAGG_THREADS"):
        config_from_env({**env, "NETAGG_THREADS": "0"})


def test_the_controller_writes_threads_into_every_workers_config_and_refuses_bad_values(capsys, soft_controller):
    from netagg.controller.cli import EXIT_CODES, main

    from conftest import TOKENS, free_udp_port

    def cli(*args: str) -> tuple[int, str, str]:
        code = main(["--config", str(soft_controller.config), "--json", "--token", TOKENS["alice"], *args])
        out, err = capsys.readouterr()
        return code, out, err

    workers = ",".join(f"local:{free_udp_port()}" for _ in range(2))
    code, out, err = cli("job", "create", "--workers", workers, "--slots", "8", "--mode", "allreduce", "--threads", "3")
    assert code == 0, err
    job = json.loads(out)["job"]
    assert job["threads"] == 3
    code, out, err = cli("job", "config", str(job["job_id"]), "--rank", "1")
    assert code == 0, err
    assert WorkerConfig.from_dict(yaml.safe_load(out)).threads == 3
    bad = ((["--threads", "0"], "threads must be an integer in 1..64"),
           (["--threads", "2", "--mode", "ps", "--ps", "ps0"], "--threads above 1 needs --mode allreduce"))
    for args, message in bad:
        code, _, err = cli("job", "create", "--workers", f"local:{free_udp_port()}", "--slots", "8", *args)
        assert code == EXIT_CODES["invalid_argument"], err
        assert message in err, err
