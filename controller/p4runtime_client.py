"""The P4Runtime session of the controller and the tests: one code path for BMv2 and the software target.

One device: the channel, the StreamChannel and its arbitration (primary or backup), and the
RPCs (pipeline, Write, Read). Entities are built from names and values by ``p4rt_entities``
(through the P4Info in ``index``). Every RPC has a deadline; failures raise ``P4RuntimeError``
whose ``str()`` is one line a CLI can print.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import grpc
from google.rpc import code_pb2
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2 as p4rt
from p4.v1 import p4runtime_pb2_grpc

from netagg.controller.errors import P4RuntimeError, UpdateError, client_error
from netagg.controller.p4rt_entities import (
    UPDATE_TYPES,
    EntityBuilder,
    EntryOp,
    MatchValue,
    TableEntryView,
    multicast_group_entity,
)
from netagg.p4info import P4InfoIndex, decode_int, load_p4info

#: EntryOp, MatchValue, TableEntryView (p4rt_entities) and the errors (errors) are part of this API.
__all__ = [
    "EntryOp",
    "MatchValue",
    "P4RuntimeClient",
    "P4RuntimeError",
    "TableEntryView",
    "UpdateError",
]

_MAX_MESSAGE_BYTES = 64 << 20
_U64 = (1 << 64) - 1
#: How long to wait for an answer to an arbitration with an unchanged id (PI sends none).
_REPEAT_ARBITRATION_WAIT = 0.5
#: gRPC's own reconnection backoff of a channel whose server went away (its defaults: 1 s growing to
#: 120 s): a restarted switch is reached within a fraction of a second, and never after more than 5 s.
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 5000),
]


def _closed_channel_error(err: ValueError, address: str) -> P4RuntimeError:
    """gRPC's ValueError for an RPC on a channel that another thread closed (a reconnect) as UNAVAILABLE."""
    if "closed channel" not in str(err):
        raise err
    return P4RuntimeError("UNAVAILABLE", f"the channel to {address} was closed (reconnecting)")


def _election_tuple(election_id: tuple[int, int] | int) -> tuple[int, int]:
    if isinstance(election_id, int):
        return election_id >> 64, election_id & _U64
    return election_id


# --------------------------------------------------------------------------- client


class P4RuntimeClient:
    """A P4Runtime client for one device: arbitration stream, pipeline, tables, multicast, counters."""

    def __init__(self, address: str, device_id: int = 1,
                 election_id: tuple[int, int] | int = (0, 1),
                 p4info_path: str | Path | None = None, timeout: float = 10.0) -> None:
        self.address = address
        self.device_id = device_id
        self.election_id = _election_tuple(election_id)
        self.timeout = timeout
        self.index: P4InfoIndex | None = P4InfoIndex.from_file(p4info_path) if p4info_path else None
        self._p4info_path = p4info_path
        self._channel: grpc.Channel | None = None
        self._stub: p4runtime_pb2_grpc.P4RuntimeStub | None = None
        self._stream: grpc.Future | None = None
        self._reader: threading.Thread | None = None
        self._cond = threading.Condition()
        #: Counts connect()s: a reader thread of an older session leaves the current one's state alone.
        self._session = 0
        self._reset_stream_state()

    def _reset_stream_state(self) -> None:
        self._requests: queue.Queue[p4rt.StreamMessageRequest | None] = queue.Queue()
        self._arbitrations = 0
        self._primary = False
        self._primary_election_id: tuple[int, int] | None = None
        self._stream_error: P4RuntimeError | None = None
        self._stream_ended = False
        #: StreamError messages the server sent (e.g. a refused packet-out).
        self.stream_errors: list[p4rt.StreamError] = []

    # ---- connection

    def connect(self, timeout: float | None = None) -> P4RuntimeClient:
        """Open the channel and StreamChannel, arbitrate, and learn whether this client is primary.

        ``timeout``: how long to wait for the server to accept the connection (default: the
        client's RPC timeout).
        """
        if self._channel is not None:
            return self
        with self._cond:
            self._session += 1
            session = self._session
            self._reset_stream_state()
        self._channel = grpc.insecure_channel(self.address, options=_CHANNEL_OPTIONS)
        wait = self.timeout if timeout is None else timeout
        try:
            grpc.channel_ready_future(self._channel).result(timeout=wait)
        except grpc.FutureTimeoutError:
            self.close()
            raise P4RuntimeError("UNAVAILABLE", f"cannot reach the P4Runtime server at "
                                 f"{self.address} within {wait:g} s") from None
        self._stub = p4runtime_pb2_grpc.P4RuntimeStub(self._channel)
        # The iterator gets this session's queue: a later session's requests never go to an old stream.
        self._stream = self._stub.StreamChannel(self._request_iter(self._requests))
        self._reader = threading.Thread(target=self._read_stream, args=(self._stream, session), daemon=True,
                                        name=f"p4rt-client-{self.address}")
        self._reader.start()
        try:
            self.arbitrate()
        except P4RuntimeError:
            self.close()
            raise
        return self

    def arbitrate(self, election_id: tuple[int, int] | int | None = None) -> bool:
        """Send a MasterArbitrationUpdate (optionally with a new election id); True if primary."""
        new_id = _election_tuple(election_id) if election_id is not None else self.election_id
        with self._cond:
            seen = self._arbitrations
            # PI does not answer a repeated update with an unchanged id: do not wait long for it.
            repeat = seen > 0 and new_id == self.election_id
        self.election_id = new_id
        self._requests.put(p4rt.StreamMessageRequest(arbitration=p4rt.MasterArbitrationUpdate(
            device_id=self.device_id, election_id=p4rt.Uint128(high=new_id[0], low=new_id[1]))))
        wait = min(self.timeout, _REPEAT_ARBITRATION_WAIT) if repeat else self.timeout
        deadline = time.monotonic() + wait
        with self._cond:
            while self._arbitrations == seen and not self._stream_ended:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if repeat:
                        return self._primary
                    raise P4RuntimeError("DEADLINE_EXCEEDED", f"no arbitration answer from "
                                         f"{self.address} within {self.timeout:g} s")
                self._cond.wait(remaining)
            if self._arbitrations == seen:
                raise self._stream_error or P4RuntimeError(
                    "UNAVAILABLE", f"the StreamChannel to {self.address} closed during arbitration")
            return self._primary

    def reconnect(self, timeout: float | None = None) -> P4RuntimeClient:
        """Drop the channel and stream (if any) and connect again: a fresh channel, StreamChannel and
        arbitration with the same election id (after the server restarted, or the stream broke)."""
        self.close()
        return self.connect(timeout)

    @property
    def connected(self) -> bool:
        """Whether the StreamChannel is open (False before connect, after close, or once the server ended it)."""
        with self._cond:
            return self._stream is not None and not self._stream_ended

    @property
    def stream_error(self) -> P4RuntimeError | None:
        """Why the StreamChannel ended (None while it is open, or when it was closed by this client)."""
        with self._cond:
            return self._stream_error

    def wait_disconnected(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the StreamChannel to end; True if it has ended (or never opened)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._stream is not None and not self._stream_ended:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    @property
    def is_primary(self) -> bool:
        """Whether the last arbitration update from the server says this client is primary."""
        with self._cond:
            return self._primary and not self._stream_ended

    @property
    def primary_election_id(self) -> tuple[int, int] | None:
        """The primary's election id as last announced by the server."""
        with self._cond:
            return self._primary_election_id

    @staticmethod
    def _request_iter(requests: queue.Queue[p4rt.StreamMessageRequest | None],
                      ) -> Iterator[p4rt.StreamMessageRequest]:
        while True:
            request = requests.get()
            if request is None:
                return
            yield request

    def _read_stream(self, stream: grpc.Future, session: int) -> None:
        try:
            for response in stream:  # type: ignore[attr-defined]
                kind = response.WhichOneof("update")
                if kind == "arbitration":
                    self._on_arbitration(response.arbitration, session)
                elif kind == "error":
                    with self._cond:
                        if session == self._session:
                            self.stream_errors.append(response.error)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                with self._cond:
                    if session == self._session:
                        self._stream_error = P4RuntimeError.from_rpc_error(e, "StreamChannel")
        finally:
            with self._cond:
                if session == self._session:
                    self._stream_ended = True
                    self._primary = False
                self._cond.notify_all()

    def _on_arbitration(self, update: p4rt.MasterArbitrationUpdate, session: int) -> None:
        with self._cond:
            if session != self._session:
                return
            self._arbitrations += 1
            self._primary = update.status.code == code_pb2.OK
            if update.HasField("election_id"):
                self._primary_election_id = (update.election_id.high, update.election_id.low)
            self._cond.notify_all()

    def close(self) -> None:
        """End the StreamChannel and close the channel (idempotent)."""
        self._requests.put(None)
        if self._reader is not None:
            self._reader.join(timeout=1.0)
        if self._stream is not None:
            self._stream.cancel()
            with self._cond:
                self._stream = None
                self._cond.notify_all()
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._stub = None

    def __enter__(self) -> P4RuntimeClient:
        return self.connect()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ---- low level

    @property
    def stub(self) -> p4runtime_pb2_grpc.P4RuntimeStub:
        if self._stub is None:
            raise P4RuntimeError("FAILED_PRECONDITION", f"not connected to {self.address}: "
                                 "call connect() first")
        return self._stub

    def _uint128(self) -> p4rt.Uint128:
        return p4rt.Uint128(high=self.election_id[0], low=self.election_id[1])

    def _p4info_index(self) -> P4InfoIndex:
        if self.index is None:
            raise P4RuntimeError("FAILED_PRECONDITION", "(client) no P4Info: pass p4info_path, or "
                                 "call set_pipeline() or get_pipeline_p4info() first")
        return self.index

    def write(self, updates: Iterable[p4rt.Update]) -> None:
        """One Write RPC with these updates (CONTINUE_ON_ERROR)."""
        request = self._write_request()
        request.updates.extend(updates)
        self._send(request)

    def _write_request(self) -> p4rt.WriteRequest:
        return p4rt.WriteRequest(device_id=self.device_id, election_id=self._uint128())

    def _send(self, request: p4rt.WriteRequest) -> None:
        try:
            self.stub.Write(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise P4RuntimeError.from_rpc_error(e, f"Write to {self.address}") from None
        except ValueError as e:
            raise _closed_channel_error(e, self.address) from None

    def read(self, entities: Iterable[p4rt.Entity]) -> list[p4rt.Entity]:
        """One Read RPC; all entities of all responses."""
        request = p4rt.ReadRequest(device_id=self.device_id, entities=list(entities))
        try:
            return [e for response in self.stub.Read(request, timeout=self.timeout)
                    for e in response.entities]
        except grpc.RpcError as e:
            raise P4RuntimeError.from_rpc_error(e, f"Read from {self.address}") from None
        except ValueError as e:
            raise _closed_channel_error(e, self.address) from None

    def capabilities(self) -> str:
        """The server's P4Runtime API version."""
        try:
            return self.stub.Capabilities(p4rt.CapabilitiesRequest(),
                                          timeout=self.timeout).p4runtime_api_version
        except grpc.RpcError as e:
            raise P4RuntimeError.from_rpc_error(e, f"Capabilities of {self.address}") from None

    # ---- pipeline

    def set_pipeline(self, p4info: str | Path | p4info_pb2.P4Info | None = None,
                     device_config: bytes | None = None,
                     action: int = p4rt.SetForwardingPipelineConfigRequest.VERIFY_AND_COMMIT,
                     cookie: int | None = None) -> None:
        """Install a pipeline (VERIFY_AND_COMMIT by default) from a P4Info path or message.

        ``cookie``: a 64-bit tag stored with the pipeline and returned by GetForwardingPipelineConfig
        (``get_pipeline_cookie``): whoever set it can later tell its own pipeline from any other.
        """
        source = p4info if p4info is not None else self._p4info_path
        if source is None:
            raise client_error("set_pipeline needs a P4Info (argument or p4info_path)")
        message = source if isinstance(source, p4info_pb2.P4Info) else load_p4info(source)
        config = p4rt.ForwardingPipelineConfig(p4info=message, p4_device_config=device_config or b"")
        if cookie is not None:
            config.cookie.cookie = cookie & _U64
        request = p4rt.SetForwardingPipelineConfigRequest(
            device_id=self.device_id, election_id=self._uint128(), action=action, config=config)
        try:
            self.stub.SetForwardingPipelineConfig(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise P4RuntimeError.from_rpc_error(e, f"SetForwardingPipelineConfig on "
                                                f"{self.address}") from None
        self.index = P4InfoIndex(message)

    def get_pipeline_cookie(self, timeout: float | None = None) -> int | None:
        """The installed pipeline's cookie (0 when it was set without one), or None if no pipeline is set.

        GetForwardingPipelineConfig with COOKIE_ONLY: the cheapest question a switch answers, and
        one that tells a switch which restarted (no pipeline, or another cookie) from one which did not.
        """
        request = p4rt.GetForwardingPipelineConfigRequest(
            device_id=self.device_id, response_type=p4rt.GetForwardingPipelineConfigRequest.COOKIE_ONLY)
        try:
            response = self.stub.GetForwardingPipelineConfig(
                request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # no pipeline yet
                return None
            raise P4RuntimeError.from_rpc_error(e, f"GetForwardingPipelineConfig on "
                                                f"{self.address}") from None
        except ValueError as e:
            raise _closed_channel_error(e, self.address) from None
        if not response.HasField("config"):
            return None
        return response.config.cookie.cookie if response.config.HasField("cookie") else 0

    def get_pipeline_p4info(self) -> p4info_pb2.P4Info | None:
        """The installed P4Info, or None if no pipeline is set; adopted if the client has none."""
        request = p4rt.GetForwardingPipelineConfigRequest(
            device_id=self.device_id,
            response_type=p4rt.GetForwardingPipelineConfigRequest.P4INFO_AND_COOKIE)
        try:
            response = self.stub.GetForwardingPipelineConfig(request, timeout=self.timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # PI/BMv2: no pipeline yet
                return None
            raise P4RuntimeError.from_rpc_error(e, f"GetForwardingPipelineConfig on "
                                                f"{self.address}") from None
        if not response.HasField("config") or not response.config.HasField("p4info"):
            return None
        if self.index is None:
            self.index = P4InfoIndex(response.config.p4info)
        return response.config.p4info

    # ---- table entries

    @property
    def entities(self) -> EntityBuilder:
        """The entity builder of this client's P4Info (``index``)."""
        return EntityBuilder(self._p4info_index())

    def insert_entry(self, table: str, match: Mapping[str, MatchValue], action: str,
                     params: Mapping[str, int] | None = None, priority: int = 0) -> None:
        """INSERT one entry."""
        self.write_entries([EntryOp.insert(table, match, action, params, priority)])

    def modify_entry(self, table: str, match: Mapping[str, MatchValue], action: str,
                     params: Mapping[str, int] | None = None, priority: int = 0) -> None:
        """MODIFY one entry's action."""
        self.write_entries([EntryOp.modify(table, match, action, params, priority)])

    def delete_entry(self, table: str, match: Mapping[str, MatchValue], priority: int = 0) -> None:
        """DELETE one entry."""
        self.write_entries([EntryOp.delete(table, match, priority)])

    def write_entries(self, ops: Iterable[EntryOp]) -> None:
        """Several table-entry updates in one Write RPC; P4RuntimeError.errors lists failures."""
        entities = self.entities
        request = self._write_request()
        for op in ops:
            update = request.updates.add(type=UPDATE_TYPES[op.kind])
            entities.table_entry(op.table, op.match, op.action, op.params, op.priority,
                                 into=update.entity.table_entry)
        self._send(request)

    def read_entries(self, table: str | None = None) -> list[TableEntryView]:
        """All entries of one table, or of every table."""
        entities = self.entities
        found = self.read([entities.table_read(table)])
        return [entities.view(e.table_entry) for e in found if e.HasField("table_entry")]

    # ---- multicast

    def set_multicast_group(self, group_id: int, replicas: Sequence[tuple[int, int]]) -> None:
        """Create group ``group_id`` with these (port, instance) replicas, or replace its replicas."""
        entity = multicast_group_entity(group_id, replicas)
        try:
            self.write([p4rt.Update(type=p4rt.Update.INSERT, entity=entity)])
        except P4RuntimeError as e:
            if not (e.errors and e.errors[0].code == "ALREADY_EXISTS"):
                raise
            self.write([p4rt.Update(type=p4rt.Update.MODIFY, entity=entity)])

    def delete_multicast_group(self, group_id: int) -> None:
        """Delete a multicast group."""
        self.write([p4rt.Update(type=p4rt.Update.DELETE, entity=multicast_group_entity(group_id))])

    def read_multicast_groups(self) -> dict[int, list[tuple[int, int]]]:
        """All multicast groups: id -> [(port, instance)] (either port encoding is understood)."""
        groups: dict[int, list[tuple[int, int]]] = {}
        for entity in self.read([multicast_group_entity(0)]):
            group = entity.packet_replication_engine_entry.multicast_group_entry
            groups[group.multicast_group_id] = [
                (decode_int(r.port) if r.WhichOneof("port_kind") == "port" else r.egress_port,
                 r.instance)
                for r in group.replicas]
        return groups

    # ---- counters

    def read_counter(self, name: str, index: int) -> tuple[int, int]:
        """(packets, bytes) of one counter cell."""
        for found in self.read([self.entities.counter_entity(name, index)]):
            data = found.counter_entry.data
            return data.packet_count, data.byte_count
        raise P4RuntimeError("NOT_FOUND", f"counter '{name}' index {index}: empty read response")

    def read_counters(self, name: str) -> dict[int, tuple[int, int]]:
        """index -> (packets, bytes) for every cell of one counter."""
        entity = self.entities.counter_entity(name)
        return {e.counter_entry.index.index: (e.counter_entry.data.packet_count,
                                              e.counter_entry.data.byte_count)
                for e in self.read([entity])}
