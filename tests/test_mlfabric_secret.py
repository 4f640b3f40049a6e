"""The job's shared secret on the MLfabric protocol: PS primary, replica and aggregator refuse requests without it."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
import yaml

from netagg.jobconfig import WorkerConfig
from netagg.jobsecret import REFUSAL as SECRET_REFUSAL
from netagg.mlfabric.aggregation import AggregationService
from netagg.mlfabric.async_server import FabricServer
from netagg.mlfabric.protocol import Connection, Refused
from netagg.mlfabric.worker import FabricClient
from netagg.testing.mlfabric import loopback_configs, write_configs

pytestmark = pytest.mark.timeout(60)

WRONG = "not-the-jobs-secret"
#: What an intruder may send in the secret field: nothing, a wrong secret, not even a string.
BAD_SECRETS = [{}, {"secret": WRONG}, {"secret": ""}, {"secret": 12345}]


def _refused(conn: Connection, header: dict, blob: bytes = b"") -> str:
    """The reason ``header`` is refused (the server's answer: the error's type and message)."""
    with pytest.raises(Refused) as info:
        conn.call(header, blob)
    return str(info.value)


def _secret_refusal(reason: str) -> bool:
    """Whether ``reason`` is the refusal for a missing or wrong secret, without repeating what was sent."""
    return reason == f"ValueError: {SECRET_REFUSAL}" and WRONG not in reason


def test_the_primary_refuses_worker_ops_halt_stats_and_join_without_the_secret_and_changes_nothing(caplog):
    caplog.set_level(logging.DEBUG, logger="netagg.mlfabric")
    configs = loopback_configs(2, update_mode="async", delay_bound=5, replicas=1)
    secret = configs[0].secret
    assert secret and configs[1].secret == secret  # testing.py gives every job a secret, the same for all ranks
    ps, replica_endpoint = configs[0].ps.as_tuple(), configs[0].replicas[0].as_tuple()
    # An unreplicated primary (a promoted replica, say) that a node on the replica's endpoint may join.
    head = FabricServer(dataclasses.replace(configs[0], replicas=()), gate_timeout=0,
                        chain_members=[ps, replica_endpoint]).start()
    joiner = None
    try:
        client = FabricClient.from_config(configs[0])
        client.hello()
        client.init(np.zeros(3, np.float32))
        assert client.push("0:0", 0, np.ones(3, np.float32))["outcome"] == "applied"
        model = head.model.copy()
        before = dataclasses.replace(head.stats)
        conn = Connection(ps, timeout=5)  # no secret of its own: each header below says what it carries
        gradient = np.ones(3, np.float32).tobytes()
        requests = [
            ({"op": "push", "job_id": 1, "rank": 1, "update_id": "1:0", "version": 1}, gradient),
            ({"op": "pull", "job_id": 1, "rank": 1}, b""),
            ({"op": "hello", "job_id": 1, "rank": 1, "agg": ["127.0.0.1", 9]}, b""),
            ({"op": "halt", "job_id": 1}, b""),
            ({"op": "stats", "job_id": 1, "log": True, "model": True}, b""),
            ({"op": "chain_state", "job_id": 1}, b""),
            ({"op": "join", "job_id": 1, "endpoint": list(replica_endpoint)}, b""),
            ({"op": "promote", "job_id": 1}, b""),
        ]
        for header, blob in requests:
            for bad in BAD_SECRETS:
                reason = _refused(conn, {**header, **bad}, blob)
                assert _secret_refusal(reason), (header["op"], bad, reason)
        refusals = len(requests) * len(BAD_SECRETS)
        assert head.stats.bad_secret == refusals and head.stats.bad_requests == before.bad_requests + refusals
        # Nothing changed: no update applied, not halted, nobody joined the chain, no worker registered.
        assert head.version == 1 and head.seq == 2 and not head.halted and head.forwarder is None
        assert head.model.tobytes() == model.tobytes() and [e.update_id for e in head.log] == ["0:0"]
        assert set(head.workers) == {0} and head.stats.pushes == before.pushes
        # The connection stays open: the same requests with the secret work on it.
        response, data = conn.call({"op": "stats", "job_id": 1, "model": True, "secret": secret})
        assert response["stats"]["bad_secret"] == refusals and data == model.tobytes()
        assert conn.call({"op": "pull", "job_id": 1, "rank": 1, "secret": secret})[0]["version"] == 1
        conn.close()
        # A worker with the wrong secret is told why at once (no failover hides it).
        intruder = FabricClient.from_config(dataclasses.replace(configs[1], secret=WRONG), failover_timeout=5)
        with pytest.raises(Refused, match=SECRET_REFUSAL):
            intruder.pull()
        assert intruder.failovers == 0 and head.version == 1
        intruder.close()
        # The job's own node joins with the secret (FabricServer.join) and its forwarder reaches it (chain_hello,
        # snapshot, replicate all carry the secret: the joiner would refuse them otherwise).
        joiner = FabricServer(configs[0], replica=0, joining=True, gate_timeout=0).start()
        assert joiner.join(ps)["rejoined"] is False and head.forwarder is not None
        assert client.push("0:1", 1, np.ones(3, np.float32))["outcome"] == "applied"
        assert joiner.version == head.version == 2 and joiner.model.tobytes() == head.model.tobytes()
        assert joiner.stats.bad_secret == 0 and joiner.stats.snapshots_installed == 1
        client.halt()
        assert head.halted and joiner.halted
        # The secret is in no answer, counter, error or log line.
        stats, _ = client.stats(log=True)
        client.close()
        assert _secret_refusal(head.stats.last_error)
        assert secret not in json.dumps(stats) and WRONG not in json.dumps(stats)
        assert "joined the chain" in caplog.text and "state transfer" in caplog.text  # the logs were captured
        assert secret not in caplog.text and secret not in repr(configs[0])
    finally:
        head.stop()
        if joiner is not None:
            joiner.stop()


def test_a_replica_refuses_chain_ops_without_the_secret_and_stays_out_of_any_chain():
    configs = loopback_configs(1, update_mode="async", delay_bound=5, replicas=1)
    secret = configs[0].secret
    replica = FabricServer(configs[0], replica=0, gate_timeout=0).start()  # its primary never starts
    try:
        conn = Connection(configs[0].replicas[0].as_tuple(), timeout=5)
        for bad in BAD_SECRETS:
            assert _secret_refusal(_refused(conn, {"op": "chain_hello", "job_id": 1, "head": 0, **bad}))
        # Not counted as an upstream, not caught up: it cannot be promoted, and no record is taken.
        assert replica._upstream == 0 and not replica._caught_up and replica.stats.bad_secret == len(BAD_SECRETS)
        assert conn.call({"op": "chain_hello", "job_id": 1, "head": 0, "secret": secret})[0]["seq"] == 0
        assert replica._upstream == 1 and replica._caught_up
        # Even on a connection that said chain_hello with the secret, every record must carry it.
        init = np.arange(3, dtype=np.float32).tobytes()
        for bad in BAD_SECRETS:
            assert _secret_refusal(_refused(conn, {"op": "replicate", "job_id": 1, "seq": 1, "kind": "init", **bad},
                                            init))
            assert _secret_refusal(_refused(conn, {"op": "snapshot", "job_id": 1, "seq": 5, "version": 4,
                                                   "model_bytes": 0, **bad}, b"{}"))
        assert replica.seq == 0 and replica.model is None and replica.stats.snapshots_installed == 0
        assert replica.stats.bad_secret == 3 * len(BAD_SECRETS)
        assert replica.stats.bad_requests == 3 * len(BAD_SECRETS)
        response, _ = conn.call({"op": "replicate", "job_id": 1, "seq": 1, "kind": "init", "secret": secret}, init)
        assert response["seq"] == 1 and replica.model is not None
        conn.close()
    finally:
        replica.stop()


class _RecordingClient:
    """Stands in for the aggregator's client of the PS: records what it would push."""

    def __init__(self) -> None:
        self.pushes: list[tuple[str, int, list]] = []

    def agg_grant(self, group: int) -> dict:
        return {"ok": True, "members": []}

    def push(self, update_id: str, version: int, update: np.ndarray, parts: list) -> dict:
        self.pushes.append((update_id, version, parts))
        return {"outcome": "applied", "delays": [0] * len(parts), "version": version + len(parts)}

    def close(self) -> None:
        pass


def test_an_aggregation_endpoint_refuses_agg_push_without_the_secret_and_keeps_no_state():
    secret = loopback_configs(1)[0].secret
    fake = _RecordingClient()
    with AggregationService(lambda: fake, 1, ("127.0.0.1", 0), secret=secret) as agg:
        conn = Connection(agg.address, timeout=5)
        header = {"op": "agg_push", "job_id": 1, "group": 7, "group_size": 1, "update_id": "0:0", "rank": 0,
                  "version": 0}
        blob = np.ones(4, np.float32).tobytes()
        for bad in BAD_SECRETS:
            assert _secret_refusal(_refused(conn, {**header, **bad}, blob))
        assert agg.stats.bad_secret == agg.stats.bad_requests == len(BAD_SECRETS)
        assert agg.stats.members == agg.stats.groups == 0 and not agg._groups and fake.pushes == []
        # The wrong job is refused before the secret is looked at; a wrong op with the secret is a bad request.
        assert "this aggregator serves job 1" in _refused(conn, {**header, "job_id": 2})
        assert "takes agg_push, not 'push'" in _refused(conn, {**header, "op": "push", "secret": secret}, blob)
        assert agg.stats.bad_secret == len(BAD_SECRETS) and agg.stats.bad_requests == len(BAD_SECRETS) + 2
        # With the secret, on the same connection: summed and pushed.
        response, _ = conn.call({**header, "secret": secret}, blob)
        assert response["outcome"] == "applied" and fake.pushes == [("agg7", 0, [["0:0", 0, 0]])]
        assert agg.stats.members == agg.stats.groups == 1
        conn.close()


def test_a_job_without_a_secret_still_works_and_configs_carry_the_secret_through_yaml(tmp_path):
    configs = loopback_configs(2, update_mode="async", delay_bound=5, replicas=1)
    paths = write_configs(configs, tmp_path)
    loaded = [WorkerConfig.load(p) for p in paths]
    assert loaded == configs and loaded[0].secret == configs[0].secret
    assert yaml.safe_load(paths[1].read_text())["secret"] == configs[0].secret
    assert loopback_configs(1)[0].secret != configs[0].secret  # a fresh secret per job
    # A config written before secrets existed (no secret key, or an empty one): the check is off.
    old = yaml.safe_load(paths[0].read_text())
    del old["secret"]
    assert WorkerConfig.from_dict(old, "old.yaml").secret == ""
    plain = loopback_configs(2, update_mode="async", delay_bound=5, replicas=1, secret="")
    assert all(c.secret == "" for c in plain)
    with FabricServer(plain[0], replica=0, gate_timeout=0) as replica, \
            FabricServer(plain[0], gate_timeout=0) as primary:
        client = FabricClient.from_config(plain[1])
        client.hello()
        client.init(np.zeros(3, np.float32))
        assert client.push("1:0", 0, np.ones(3, np.float32))["outcome"] == "applied"
        assert replica.version == primary.version == 1
        # A client that does send a secret is not refused either.
        stranger = FabricClient.from_config(dataclasses.replace(plain[0], secret=WRONG), observer=True)
        assert stranger.stats()[0]["version"] == 1
        stranger.close()
        client.close()
        assert primary.stats.bad_secret == replica.stats.bad_secret == 0
