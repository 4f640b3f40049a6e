"""A real gRPC P4Runtime server over a ``ForwardingState``: the software target's only control API.

It answers like PI's server in front of BMv2 (p4lang/PI proto/server/pi_server.cpp and
proto/frontend/src/device_mgr.cpp), so that the controller has one code path for both:

* arbitration: the live StreamChannel client with the highest election id is primary
  (OK "Is primary"), every other one is backup (ALREADY_EXISTS "Is backup"); when the
  primary changes - a higher id arrives, the primary downgrades or disconnects - every
  client is told. (Like PI, and unlike the letter of the spec, a backup becomes primary
  when the primary disconnects; it need not re-arbitrate with a higher id.)
* Write: failed updates give UNKNOWN with a google.rpc.Status in the details holding one
  p4.v1.Error per update (OK for those that succeeded); only CONTINUE_ON_ERROR.
* Read: registers are UNIMPLEMENTED (p4lang/PI#376), multicast replicas come back in the
  form they were written in (see ``p4rt_codec._replica_port``).
* Before a pipeline is set, Write, Read and GetForwardingPipelineConfig give FAILED_PRECONDITION.

Deliberate differences from PI: only the primary may Write or set the pipeline (PI also
accepts requests without election id while no client is connected); the P4Info must
describe exactly the pipeline the target was built for; a full table is RESOURCE_EXHAUSTED
(BMv2 says UNKNOWN); roles other than the default one are UNIMPLEMENTED.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, status_pb2
from p4.v1 import p4runtime_pb2 as p4rt
from p4.v1 import p4runtime_pb2_grpc

from netagg.p4info import p4info_differences
from netagg.softswitch.forwarding_state import ForwardingState, StateError

__all__ = [
    "P4RUNTIME_API_VERSION",
    "Arbitration",
    "P4RuntimeDevice",
    "P4RuntimeServicer",
    "ServerHandle",
    "serve",
]

log = logging.getLogger(__name__)

P4RUNTIME_API_VERSION = "1.3.0"
#: p4.v1.Error.space of the errors this target reports.
ERROR_SPACE = "netagg-softswitch"
#: gRPC trailing-metadata key carrying a serialized google.rpc.Status.
STATUS_DETAILS_KEY = "grpc-status-details-bin"
_MAX_MESSAGE_BYTES = 64 << 20
_U64 = (1 << 64) - 1
_Code = grpc.StatusCode
_Set = p4rt.SetForwardingPipelineConfigRequest
_Get = p4rt.GetForwardingPipelineConfigRequest
_Request = (p4rt.WriteRequest | p4rt.ReadRequest | p4rt.SetForwardingPipelineConfigRequest
            | p4rt.GetForwardingPipelineConfigRequest)


def _election_id(uint128: p4rt.Uint128) -> int:
    return (uint128.high << 64) | uint128.low


def _fmt_election_id(value: int) -> str:
    return f"(high={value >> 64}, low={value & _U64})"


# --------------------------------------------------------------------------- arbitration


@dataclass(eq=False)
class _Stream:
    """One StreamChannel: what to send it, and its election id once it has arbitrated."""

    id: int
    outbox: queue.Queue[p4rt.StreamMessageResponse | StateError | None] = field(
        default_factory=queue.Queue)
    election_id: int | None = None


class Arbitration:
    """Primary/backup election among one device's StreamChannel clients (PI's rules)."""

    def __init__(self, device_id: int, max_streams: int = 8) -> None:
        self.device_id = device_id
        self.max_streams = max_streams
        self._lock = threading.Lock()
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count(1)

    def open(self) -> _Stream:
        """Register a new StreamChannel; RESOURCE_EXHAUSTED beyond ``max_streams``."""
        with self._lock:
            if len(self._streams) >= self.max_streams:
                raise StateError(_Code.RESOURCE_EXHAUSTED,
                                 f"too many StreamChannel connections (at most {self.max_streams})")
            stream = _Stream(next(self._ids))
            self._streams[stream.id] = stream
            return stream

    def arbitrate(self, stream: _Stream, update: p4rt.MasterArbitrationUpdate) -> None:
        """Handle a MasterArbitrationUpdate; a StateError must end the stream with its code."""
        first = stream.election_id is None
        if update.device_id != self.device_id:
            code = _Code.NOT_FOUND if first else _Code.FAILED_PRECONDITION
            raise StateError(code, f"unknown device id {update.device_id}: this P4Runtime server "
                             f"serves device {self.device_id}")
        if update.role.name or update.role.id:
            raise StateError(_Code.UNIMPLEMENTED, "only the default role is supported "
                             f"(got role {update.role.name or update.role.id!r})")
        election_id = _election_id(update.election_id)
        with self._lock:
            if any(s.election_id == election_id for s in self._streams.values() if s is not stream):
                raise StateError(_Code.INVALID_ARGUMENT, f"election id {_fmt_election_id(election_id)}"
                                 " is already used by another controller")
            was_primary = self._primary() is stream
            stream.election_id = election_id
            if was_primary != (self._primary() is stream):
                self._notify(self._arbitrated())
            else:
                self._notify([stream])

    def close(self, stream: _Stream) -> None:
        """Forget a stream (idempotent); if it was primary, tell the others who is now."""
        with self._lock:
            was_primary = self._primary() is stream
            if self._streams.pop(stream.id, None) is not None and was_primary:
                self._notify(self._arbitrated())

    def check_primary(self, election_id: p4rt.Uint128) -> None:
        """PERMISSION_DENIED unless ``election_id`` is the current primary's."""
        wanted = _election_id(election_id)
        with self._lock:
            primary = self._primary()
        if primary is None:
            raise StateError(_Code.PERMISSION_DENIED, f"not primary: no controller is primary for "
                             f"device {self.device_id} (open a StreamChannel and arbitrate first)")
        if primary.election_id != wanted:
            raise StateError(_Code.PERMISSION_DENIED, f"not primary: election id "
                             f"{_fmt_election_id(wanted)} is not the primary's "
                             f"{_fmt_election_id(primary.election_id or 0)}")

    def _arbitrated(self) -> list[_Stream]:
        return [s for s in self._streams.values() if s.election_id is not None]

    def _primary(self) -> _Stream | None:
        return max(self._arbitrated(), key=lambda s: s.election_id or 0, default=None)

    def _notify(self, streams: list[_Stream]) -> None:
        primary = self._primary()
        if primary is None:
            return
        for stream in streams:
            ok = stream is primary
            update = p4rt.MasterArbitrationUpdate(
                device_id=self.device_id,
                election_id=p4rt.Uint128(high=(primary.election_id or 0) >> 64,
                                         low=(primary.election_id or 0) & _U64),
                status=status_pb2.Status(code=code_pb2.OK if ok else code_pb2.ALREADY_EXISTS,
                                         message="Is primary" if ok else "Is backup"))
            stream.outbox.put(p4rt.StreamMessageResponse(arbitration=update))


# --------------------------------------------------------------------------- device


class P4RuntimeDevice:
    """One P4Runtime device: its ForwardingState, expected P4Info, pipeline config and arbitration."""

    def __init__(self, state: ForwardingState, device_id: int = 1, max_streams: int = 8) -> None:
        self.state = state
        self.device_id = device_id
        self.expected_p4info = state.index.p4info
        self.arbitration = Arbitration(device_id, max_streams)
        self._config: p4rt.ForwardingPipelineConfig | None = None
        self._saved: p4rt.ForwardingPipelineConfig | None = None
        self._config_lock = threading.Lock()

    @property
    def pipeline_config(self) -> p4rt.ForwardingPipelineConfig | None:
        """The committed config (its p4_device_config is stored but unused), or None."""
        return self._config

    def check_device(self, request: _Request) -> None:
        """NOT_FOUND for another device id or a role other than the default one (spec order)."""
        if request.device_id != self.device_id:
            raise StateError(_Code.NOT_FOUND, f"unknown device id {request.device_id}: this "
                             f"P4Runtime server serves device {self.device_id}")
        role = getattr(request, "role", "") or getattr(request, "role_id", 0)
        if role:
            raise StateError(_Code.NOT_FOUND, f"unknown role {role!r}: only the default role "
                             f"is supported")

    def check_configured(self) -> None:
        if self._config is None:
            raise StateError(_Code.FAILED_PRECONDITION,
                             "No forwarding pipeline config set for this device")

    def set_pipeline(self, action: int, config: p4rt.ForwardingPipelineConfig) -> None:
        """SetForwardingPipelineConfig's action (caller checked device id and primary)."""
        if action == _Set.COMMIT:
            self._commit_saved(config)
            return
        if action not in (_Set.VERIFY, _Set.VERIFY_AND_SAVE, _Set.VERIFY_AND_COMMIT,
                          _Set.RECONCILE_AND_COMMIT):
            raise StateError(_Code.INVALID_ARGUMENT, f"invalid SetForwardingPipelineConfig "
                             f"action {action}")
        self._verify(config)
        with self._config_lock:
            if action == _Set.VERIFY_AND_SAVE:
                self._saved = _copy_config(config)
            elif action == _Set.VERIFY_AND_COMMIT:
                self._commit(config, keep_state=False)
            elif action == _Set.RECONCILE_AND_COMMIT:
                # The P4Info is identical to the running one (verified), so all state is kept.
                self._commit(config, keep_state=self._config is not None)

    def _commit_saved(self, config: p4rt.ForwardingPipelineConfig) -> None:
        if config.ByteSize():
            raise StateError(_Code.INVALID_ARGUMENT, "COMMIT takes no config: it commits the one "
                             "saved by VERIFY_AND_SAVE")
        with self._config_lock:
            if self._saved is None:
                raise StateError(_Code.NOT_FOUND, "no saved config to COMMIT (send "
                                 "VERIFY_AND_SAVE first)")
            # Saved configs share the running P4Info, so the state carries over.
            self._commit(self._saved, keep_state=True)
            self._saved = None

    def _verify(self, config: p4rt.ForwardingPipelineConfig) -> None:
        if not config.HasField("p4info"):
            raise StateError(_Code.INVALID_ARGUMENT, "the ForwardingPipelineConfig has no p4info")
        diffs = p4info_differences(self.expected_p4info, config.p4info)
        if diffs:
            shown = "; ".join(diffs[:10]) + (f"; and {len(diffs) - 10} more" if len(diffs) > 10 else "")
            raise StateError(_Code.INVALID_ARGUMENT, f"the P4Info does not describe this target's "
                             f"pipeline ({len(diffs)} difference(s)): {shown}")

    def _commit(self, config: p4rt.ForwardingPipelineConfig, *, keep_state: bool) -> None:
        with self.state.lock:
            if not keep_state:
                self.state.reset()
            self.state.configured = True
        self._config = _copy_config(config)

    def get_pipeline(self, response_type: int) -> p4rt.ForwardingPipelineConfig:
        """GetForwardingPipelineConfig's answer for ``response_type``."""
        self.check_configured()
        current = self._config
        assert current is not None
        if response_type not in (_Get.ALL, _Get.COOKIE_ONLY, _Get.P4INFO_AND_COOKIE,
                                 _Get.DEVICE_CONFIG_AND_COOKIE):
            raise StateError(_Code.INVALID_ARGUMENT, f"invalid response_type {response_type}")
        out = p4rt.ForwardingPipelineConfig()
        if response_type in (_Get.ALL, _Get.P4INFO_AND_COOKIE):
            out.p4info.CopyFrom(current.p4info)
        if response_type in (_Get.ALL, _Get.DEVICE_CONFIG_AND_COOKIE):
            out.p4_device_config = current.p4_device_config
        if current.HasField("cookie"):
            out.cookie.CopyFrom(current.cookie)
        return out

    def write(self, updates: Iterator[p4rt.Update] | list[p4rt.Update]) -> list[StateError | None]:
        """Apply updates in order under the state lock; one result (None = OK) per update."""
        results: list[StateError | None] = []
        with self.state.lock:
            for update in updates:
                try:
                    self.state.apply_update(update)
                    results.append(None)
                except StateError as e:
                    results.append(e)
                except Exception as e:
                    log.exception("internal error applying a P4Runtime update")
                    results.append(StateError(_Code.INTERNAL, f"internal error: {type(e).__name__}: {e}"))
        return results

    def read(self, entities: list[p4rt.Entity]) -> p4rt.ReadResponse:
        """One ReadResponse with everything the entities select (as PI); the first failure raises."""
        response = p4rt.ReadResponse()
        with self.state.lock:
            for entity in entities:
                self.state.read(entity, response.entities)
        return response


def _copy_config(config: p4rt.ForwardingPipelineConfig) -> p4rt.ForwardingPipelineConfig:
    copy = p4rt.ForwardingPipelineConfig()
    copy.CopyFrom(config)
    return copy


# --------------------------------------------------------------------------- gRPC service


class _WriteFailed(StateError):
    """Some updates of a Write failed: UNKNOWN plus one p4.v1.Error per update in the details."""

    def __init__(self, results: list[StateError | None]) -> None:
        failed = [(i, e) for i, e in enumerate(results) if e is not None]
        shown = "; ".join(f"update #{i}: {e.code.name}: {e.message}" for i, e in failed[:5])
        more = f"; and {len(failed) - 5} more" if len(failed) > 5 else ""
        super().__init__(_Code.UNKNOWN,
                         f"{len(failed)} of {len(results)} update(s) failed: {shown}{more}")
        status = status_pb2.Status(code=code_pb2.UNKNOWN, message=self.message)
        for result in results:
            error = p4rt.Error()
            if result is not None:
                error.canonical_code = result.code.value[0]
                error.message = result.message
                error.space = ERROR_SPACE
            packed = any_pb2.Any()
            packed.Pack(error)
            status.details.append(packed)
        self.details = status.SerializeToString()


_R = TypeVar("_R")


def _failure(e: Exception) -> StateError:
    if isinstance(e, StateError):
        return e
    log.exception("internal error in the P4Runtime server")
    return StateError(_Code.INTERNAL, f"internal error: {type(e).__name__}: {e}")


def _answer(context: grpc.ServicerContext, handler: Callable[[], _R]) -> _R:
    """Run a unary handler; turn failures into a gRPC status with a precise message."""
    try:
        return handler()
    except Exception as e:
        failure = _failure(e)
    if isinstance(failure, _WriteFailed):
        context.set_trailing_metadata(((STATUS_DETAILS_KEY, failure.details),))
    context.abort(failure.code, failure.message)
    raise AssertionError("unreachable: context.abort raises")


class P4RuntimeServicer(p4runtime_pb2_grpc.P4RuntimeServicer):
    """p4.v1.P4Runtime over one ``P4RuntimeDevice``."""

    def __init__(self, device: P4RuntimeDevice) -> None:
        self.device = device

    def Write(self, request: p4rt.WriteRequest, context: grpc.ServicerContext) -> p4rt.WriteResponse:
        return _answer(context, lambda: self._write(request))

    def _write(self, request: p4rt.WriteRequest) -> p4rt.WriteResponse:
        device = self.device
        device.check_device(request)
        device.arbitration.check_primary(request.election_id)
        device.check_configured()
        if request.atomicity != p4rt.WriteRequest.CONTINUE_ON_ERROR:
            raise StateError(_Code.UNIMPLEMENTED, "only CONTINUE_ON_ERROR atomicity is supported "
                             "(as in PI/BMv2)")
        results = device.write(list(request.updates))
        if any(results):
            raise _WriteFailed(results)
        return p4rt.WriteResponse()

    def Read(self, request: p4rt.ReadRequest, context: grpc.ServicerContext,
             ) -> Iterator[p4rt.ReadResponse]:
        try:
            self.device.check_device(request)
            self.device.check_configured()
            response = self.device.read(list(request.entities))
        except Exception as e:
            failure = _failure(e)
        else:
            yield response
            return
        context.abort(failure.code, failure.message)

    def SetForwardingPipelineConfig(self, request: p4rt.SetForwardingPipelineConfigRequest,
                                    context: grpc.ServicerContext,
                                    ) -> p4rt.SetForwardingPipelineConfigResponse:
        def handle() -> p4rt.SetForwardingPipelineConfigResponse:
            self.device.check_device(request)
            self.device.arbitration.check_primary(request.election_id)
            self.device.set_pipeline(request.action, request.config)
            return p4rt.SetForwardingPipelineConfigResponse()
        return _answer(context, handle)

    def GetForwardingPipelineConfig(self, request: p4rt.GetForwardingPipelineConfigRequest,
                                    context: grpc.ServicerContext,
                                    ) -> p4rt.GetForwardingPipelineConfigResponse:
        def handle() -> p4rt.GetForwardingPipelineConfigResponse:
            self.device.check_device(request)
            config = self.device.get_pipeline(request.response_type)
            return p4rt.GetForwardingPipelineConfigResponse(config=config)
        return _answer(context, handle)

    def Capabilities(self, request: p4rt.CapabilitiesRequest, context: grpc.ServicerContext,
                     ) -> p4rt.CapabilitiesResponse:
        return p4rt.CapabilitiesResponse(p4runtime_api_version=P4RUNTIME_API_VERSION)

    def StreamChannel(self, request_iterator: Iterator[p4rt.StreamMessageRequest],
                      context: grpc.ServicerContext) -> Iterator[p4rt.StreamMessageResponse]:
        arbitration = self.device.arbitration
        try:
            stream = arbitration.open()
        except StateError as e:
            context.abort(e.code, e.message)

        def end() -> None:
            arbitration.close(stream)
            stream.outbox.put(None)

        context.add_callback(end)
        threading.Thread(target=self._pump, args=(stream, request_iterator, end), daemon=True,
                         name=f"p4rt-stream-{stream.id}").start()
        while True:
            item = stream.outbox.get()
            if item is None:
                return
            if isinstance(item, StateError):
                context.abort(item.code, item.message)
            yield item

    def _pump(self, stream: _Stream, requests: Iterator[p4rt.StreamMessageRequest],
              end: Callable[[], None]) -> None:
        """Consume one client's stream requests (runs in its own thread)."""
        try:
            for request in requests:
                kind = request.WhichOneof("update")
                if kind == "arbitration":
                    self.device.arbitration.arbitrate(stream, request.arbitration)
                elif kind == "packet" and stream.election_id is not None:
                    stream.outbox.put(p4rt.StreamMessageResponse(error=p4rt.StreamError(
                        canonical_code=code_pb2.UNIMPLEMENTED, space=ERROR_SPACE,
                        message="packet-out is not supported by this target",
                        packet_out=p4rt.PacketOutError(packet_out=request.packet))))
        except StateError as e:
            stream.outbox.put(e)
        except Exception as e:  # the client went away (cancelled, connection reset)
            log.debug("StreamChannel %d ended: %s", stream.id, e)
        finally:
            end()


# --------------------------------------------------------------------------- serve


class ServerHandle(NamedTuple):
    """A started server and the port it listens on."""

    server: grpc.Server
    port: int


StateSource = P4RuntimeDevice | ForwardingState | Callable[[], ForwardingState]


def _as_device(target: StateSource, device_id: int, max_streams: int) -> P4RuntimeDevice:
    if isinstance(target, P4RuntimeDevice):
        return target
    state = target if isinstance(target, ForwardingState) else target()
    if not isinstance(state, ForwardingState):
        raise TypeError(f"expected a ForwardingState, got {type(state).__name__}")
    return P4RuntimeDevice(state, device_id=device_id, max_streams=max_streams)


def serve(target: StateSource, address: str = "127.0.0.1:9559", max_workers: int = 4, *,
          device_id: int = 1, max_streams: int = 8) -> ServerHandle:
    """Start a P4Runtime server for ``target`` on ``address`` ("host:port", port 0 = any free one).

    ``target`` is a ``P4RuntimeDevice``, a ``ForwardingState`` or a factory of one. Each open
    StreamChannel holds a thread of its own, so the pool has ``max_workers + max_streams``.
    Stop it with ``handle.server.stop(grace)``.
    """
    device = _as_device(target, device_id, max_streams)
    executor = futures.ThreadPoolExecutor(max_workers=max_workers + device.arbitration.max_streams,
                                          thread_name_prefix="p4runtime")
    server = grpc.server(executor, options=[
        ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),  # a second server on a busy port must fail, not share it
    ])
    p4runtime_pb2_grpc.add_P4RuntimeServicer_to_server(P4RuntimeServicer(device), server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(f"P4Runtime server cannot listen on {address}: {e}") from e
    if port == 0:
        raise OSError(f"P4Runtime server cannot listen on {address}")
    server.start()
    log.info("P4Runtime server for device %d listening on %s (port %d)", device.device_id, address, port)
    return ServerHandle(server, port)
