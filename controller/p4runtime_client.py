"""The P4Runtime client of the controller and the tests: one code path for BMv2 and the software target.

Names (tables, fields, actions, params, counters) are resolved through the P4Info;
values are ints. Every RPC has a deadline; failures raise ``P4RuntimeError`` whose
``str()`` is one line a CLI can print.

Match values in ``insert_entry`` & co., by the field's match kind: exact and optional
``int``; lpm ``(value, prefix_len)`` (or an int for a full-length prefix); ternary
``(value, mask)``; range ``(low, high)``. Fields left out are don't-care (not allowed
for exact fields).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal

import grpc
from google.rpc import code_pb2, status_pb2
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2 as p4rt
from p4.v1 import p4runtime_pb2_grpc

from netagg.p4info import (
    MatchFieldInfo,
    P4InfoIndex,
    P4InfoLookupError,
    TableInfo,
    decode_int,
    encode_int,
    load_p4info,
)

__all__ = [
    "EntryOp",
    "MatchValue",
    "P4RuntimeClient",
    "P4RuntimeError",
    "TableEntryView",
    "UpdateError",
]

MatchValue = int | tuple[int, int]
_MAX_MESSAGE_BYTES = 64 << 20
_STATUS_DETAILS_KEY = "grpc-status-details-bin"
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


# --------------------------------------------------------------------------- errors


@dataclass(frozen=True, slots=True)
class UpdateError:
    """Why one update of a Write failed."""

    index: int
    code: str
    message: str


class P4RuntimeError(Exception):
    """A failed P4Runtime operation: the gRPC code name, a message, and per-update Write errors."""

    def __init__(self, code: str, message: str, errors: Sequence[UpdateError] = ()) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.errors = tuple(errors)

    def __str__(self) -> str:
        text = f"{self.code}: {self.message}"
        if self.errors:
            text += ": " + "; ".join(f"update #{e.index}: {e.code}: {e.message}" for e in self.errors)
        return " ".join(text.split())

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError, what: str) -> P4RuntimeError:
        """Wrap a gRPC error of the operation ``what``, decoding Write's per-update errors."""
        code = err.code() if hasattr(err, "code") else None
        name = code.name if code is not None else "UNKNOWN"
        total, errors = _update_errors(err)
        if errors:  # the server's own message (empty from PI) would repeat them
            return cls(name, f"{what}: {len(errors)} of {total} update(s) failed", errors)
        details = (err.details() if hasattr(err, "details") else None) or str(err)
        return cls(name, f"{what}: {details}")


def _update_errors(err: grpc.RpcError) -> tuple[int, list[UpdateError]]:
    """(number of updates, the failed ones) from the google.rpc.Status in the trailing metadata.

    That is how PI/BMv2 report a Write's failures: one p4.v1.Error per update, OK or not.
    """
    metadata = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in metadata or ():
        if key != _STATUS_DETAILS_KEY:
            continue
        status = status_pb2.Status.FromString(value)
        errors = []
        for i, packed in enumerate(status.details):
            error = p4rt.Error()
            if packed.Unpack(error) and error.canonical_code != code_pb2.OK:
                errors.append(UpdateError(i, code_pb2.Code.Name(error.canonical_code), error.message))
        return len(status.details), errors
    return 0, []


def _client_error(message: str) -> P4RuntimeError:
    return P4RuntimeError("INVALID_ARGUMENT", f"(client) {message}")


def _closed_channel_error(err: ValueError, address: str) -> P4RuntimeError:
    """gRPC's ValueError for an RPC on a channel that another thread closed (a reconnect) as UNAVAILABLE."""
    if "closed channel" not in str(err):
        raise err
    return P4RuntimeError("UNAVAILABLE", f"the channel to {address} was closed (reconnecting)")


# --------------------------------------------------------------------------- entries


@dataclass(frozen=True, slots=True)
class TableEntryView:
    """A table entry as read back, decoded to names and ints."""

    table: str
    match: dict[str, MatchValue]
    action: str | None
    params: dict[str, int]
    priority: int = 0
    is_default_action: bool = False


@dataclass(frozen=True, slots=True)
class EntryOp:
    """One table-entry update for ``write_entries``."""

    kind: Literal["insert", "modify", "delete"]
    table: str
    match: Mapping[str, MatchValue]
    action: str | None = None
    params: Mapping[str, int] = field(default_factory=dict)
    priority: int = 0

    @classmethod
    def insert(cls, table: str, match: Mapping[str, MatchValue], action: str,
               params: Mapping[str, int] | None = None, priority: int = 0) -> EntryOp:
        return cls("insert", table, match, action, params or {}, priority)

    @classmethod
    def modify(cls, table: str, match: Mapping[str, MatchValue], action: str,
               params: Mapping[str, int] | None = None, priority: int = 0) -> EntryOp:
        return cls("modify", table, match, action, params or {}, priority)

    @classmethod
    def delete(cls, table: str, match: Mapping[str, MatchValue], priority: int = 0) -> EntryOp:
        return cls("delete", table, match, None, {}, priority)


_UPDATE_TYPES = {"insert": p4rt.Update.INSERT, "modify": p4rt.Update.MODIFY,
                 "delete": p4rt.Update.DELETE}


def _encode(value: int, bitwidth: int, what: str) -> bytes:
    try:
        return encode_int(value, bitwidth)
    except ValueError as e:
        raise _client_error(f"{what}: {e}") from None


def _add_field_match(entry: p4rt.TableEntry, table: TableInfo, mf: MatchFieldInfo,
                     value: MatchValue) -> None:
    """Add the FieldMatch for a user value; nothing when it means don't-care (prefix 0, mask 0)."""
    what = f"table '{table.name}' field '{mf.name}'"
    kind, width = mf.match_kind, mf.bitwidth
    pair = isinstance(value, tuple)
    if (kind in ("exact", "optional") and pair) or (kind in ("ternary", "range") and not pair):
        raise _client_error(f"{what} is {kind}: got {value!r}")
    if kind == "exact":
        entry.match.add(field_id=mf.id).exact.value = _encode(value, width, what)  # type: ignore[arg-type]
    elif kind == "optional":
        entry.match.add(field_id=mf.id).optional.value = _encode(value, width, what)  # type: ignore[arg-type]
    elif kind == "lpm":
        prefix, prefix_len = value if isinstance(value, tuple) else (value, width)
        if prefix_len:
            fm = entry.match.add(field_id=mf.id)
            fm.lpm.value, fm.lpm.prefix_len = _encode(prefix, width, what), prefix_len
    elif kind == "ternary":
        if value[1]:  # type: ignore[index]
            fm = entry.match.add(field_id=mf.id)
            fm.ternary.value = _encode(value[0], width, what)  # type: ignore[index]
            fm.ternary.mask = _encode(value[1], width, what)  # type: ignore[index]
    elif kind == "range":
        fm = entry.match.add(field_id=mf.id)
        fm.range.low = _encode(value[0], width, what)  # type: ignore[index]
        fm.range.high = _encode(value[1], width, what)  # type: ignore[index]
    else:
        raise _client_error(f"{what}: match kind {kind!r} is not supported")


def _decode_field(mf: MatchFieldInfo, fm: p4rt.FieldMatch) -> MatchValue:
    kind = fm.WhichOneof("field_match_type")
    if kind == "exact":
        return decode_int(fm.exact.value)
    if kind == "optional":
        return decode_int(fm.optional.value)
    if kind == "lpm":
        return decode_int(fm.lpm.value), fm.lpm.prefix_len
    if kind == "ternary":
        return decode_int(fm.ternary.value), decode_int(fm.ternary.mask)
    if kind == "range":
        return decode_int(fm.range.low), decode_int(fm.range.high)
    raise P4RuntimeError("INTERNAL", f"field '{mf.name}': unsupported match {kind!r} in a read")


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
            raise _client_error("set_pipeline needs a P4Info (argument or p4info_path)")
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

    def table_entry(self, table: str, match: Mapping[str, MatchValue], action: str | None = None,
                    params: Mapping[str, int] | None = None, priority: int = 0,
                    into: p4rt.TableEntry | None = None) -> p4rt.TableEntry:
        """Build a TableEntry (in ``into`` if given) from names and ints.

        Checks names and widths only; the switch checks the rest.
        """
        index = self._p4info_index()
        entry = into if into is not None else p4rt.TableEntry()
        try:
            info = index.table(table)
            entry.table_id, entry.priority = info.id, priority
            for name, value in match.items():
                _add_field_match(entry, info, info.match_field(name), value)
            if action is not None:
                self._set_action(entry, index, info, action, params or {})
        except P4InfoLookupError as e:
            raise _client_error(str(e)) from None
        return entry

    @staticmethod
    def _set_action(entry: p4rt.TableEntry, index: P4InfoIndex, table: TableInfo, action: str,
                    params: Mapping[str, int]) -> None:
        info = index.action(action)
        if info.id not in table.action_scopes:
            raise _client_error(f"action '{info.name}' is not an action of table '{table.name}'")
        entry.action.action.action_id = info.id
        for name, value in params.items():
            param = info.param(name)
            entry.action.action.params.add(param_id=param.id, value=_encode(
                value, param.bitwidth, f"action '{info.name}' param '{param.name}'"))

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
        request = self._write_request()
        for op in ops:
            update = request.updates.add(type=_UPDATE_TYPES[op.kind])
            self.table_entry(op.table, op.match, op.action, op.params, op.priority,
                             into=update.entity.table_entry)
        self._send(request)

    def read_entries(self, table: str | None = None) -> list[TableEntryView]:
        """All entries of one table, or of every table."""
        index = self._p4info_index()
        try:
            table_id = index.table(table).id if table is not None else 0
        except P4InfoLookupError as e:
            raise _client_error(str(e)) from None
        found = self.read([p4rt.Entity(table_entry=p4rt.TableEntry(table_id=table_id))])
        return [self._view(index, e.table_entry) for e in found if e.HasField("table_entry")]

    @staticmethod
    def _view(index: P4InfoIndex, entry: p4rt.TableEntry) -> TableEntryView:
        info = index.table(entry.table_id)
        match = {}
        for fm in entry.match:
            mf = info.match_field(fm.field_id)
            match[mf.name] = _decode_field(mf, fm)
        action, params = None, {}
        if entry.action.HasField("action"):
            action_info = index.action(entry.action.action.action_id)
            action = action_info.name
            params = {action_info.param(p.param_id).name: decode_int(p.value)
                      for p in entry.action.action.params}
        return TableEntryView(info.name, match, action, params, entry.priority,
                              entry.is_default_action)

    # ---- multicast

    @staticmethod
    def _group_entity(group_id: int, replicas: Iterable[tuple[int, int]] = ()) -> p4rt.Entity:
        # Ports go in the deprecated uint32 `egress_port`: every PI/BMv2 accepts it (the bytes
        # `port` needs PI from 2023 on, PI#598), and PI rejects port 0 given as bytes.
        group = p4rt.MulticastGroupEntry(multicast_group_id=group_id)
        for port, instance in replicas:
            group.replicas.add(egress_port=port, instance=instance)
        return p4rt.Entity(packet_replication_engine_entry=p4rt.PacketReplicationEngineEntry(
            multicast_group_entry=group))

    def set_multicast_group(self, group_id: int, replicas: Sequence[tuple[int, int]]) -> None:
        """Create group ``group_id`` with these (port, instance) replicas, or replace its replicas."""
        entity = self._group_entity(group_id, replicas)
        try:
            self.write([p4rt.Update(type=p4rt.Update.INSERT, entity=entity)])
        except P4RuntimeError as e:
            if not (e.errors and e.errors[0].code == "ALREADY_EXISTS"):
                raise
            self.write([p4rt.Update(type=p4rt.Update.MODIFY, entity=entity)])

    def delete_multicast_group(self, group_id: int) -> None:
        """Delete a multicast group."""
        self.write([p4rt.Update(type=p4rt.Update.DELETE, entity=self._group_entity(group_id))])

    def read_multicast_groups(self) -> dict[int, list[tuple[int, int]]]:
        """All multicast groups: id -> [(port, instance)] (either port encoding is understood)."""
        groups: dict[int, list[tuple[int, int]]] = {}
        for entity in self.read([self._group_entity(0)]):
            group = entity.packet_replication_engine_entry.multicast_group_entry
            groups[group.multicast_group_id] = [
                (decode_int(r.port) if r.WhichOneof("port_kind") == "port" else r.egress_port,
                 r.instance)
                for r in group.replicas]
        return groups

    # ---- counters

    def _counter_id(self, name: str) -> int:
        try:
            return self._p4info_index().counter(name).id
        except P4InfoLookupError as e:
            raise _client_error(str(e)) from None

    def read_counter(self, name: str, index: int) -> tuple[int, int]:
        """(packets, bytes) of one counter cell."""
        entity = p4rt.Entity(counter_entry=p4rt.CounterEntry(
            counter_id=self._counter_id(name), index=p4rt.Index(index=index)))
        for found in self.read([entity]):
            data = found.counter_entry.data
            return data.packet_count, data.byte_count
        raise P4RuntimeError("NOT_FOUND", f"counter '{name}' index {index}: empty read response")

    def read_counters(self, name: str) -> dict[int, tuple[int, int]]:
        """index -> (packets, bytes) for every cell of one counter."""
        entity = p4rt.Entity(counter_entry=p4rt.CounterEntry(counter_id=self._counter_id(name)))
        return {e.counter_entry.index.index: (e.counter_entry.data.packet_count,
                                              e.counter_entry.data.byte_count)
                for e in self.read([entity])}
