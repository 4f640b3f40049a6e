"""The controller's control API: JSON lines over a unix socket, one request per line.

Request ``{"token": ..., "op": ..., "args": {...}}``; response ``{"ok": true,
"result": ...}`` or ``{"ok": false, "error": {"code": ..., "message": ...}}``.
Tokens map to tenants (or to the admin); the socket is never on a network.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from netagg.controller.admission import JobRequest
from netagg.controller.errors import P4RuntimeError, ServiceError
from netagg.controller.service import Caller, JobService
from netagg.jobconfig import ConfigError

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 20


class ApiError(Exception):
    """An error answer from the controller (or no answer at all: code ``unreachable``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _dispatch(service: JobService, caller: Caller, op: str, args: dict[str, Any]) -> Any:
    handlers: dict[str, Callable[[], Any]] = {
        "create": lambda: service.create_job(caller, JobRequest(**args)),
        "list": lambda: service.list_jobs(caller),
        "show": lambda: service.show_job(caller, int(args["job_id"])),
        "delete": lambda: service.delete_job(caller, int(args["job_id"])),
        "renew": lambda: service.renew_job(caller, int(args["job_id"])),
        "config": lambda: service.worker_config(
            caller, int(args["job_id"]), _optional_int(args.get("rank")),
            distribution=args.get("distribution", False), ps_node=_optional_int(args.get("ps_node"))).to_yaml(),
        "ping": lambda: {"tenant": caller.tenant, "admin": caller.is_admin},
    }
    if op not in handlers:
        raise ServiceError("invalid_argument", f"unknown operation {op!r}")
    return handlers[op]()


class _Handler(socketserver.StreamRequestHandler):
    server: ApiServer

    def handle(self) -> None:
        while True:
            line = self.rfile.readline(MAX_REQUEST_BYTES + 1)
            if not line:
                return
            response = self.server.answer(line)
            self.wfile.write(json.dumps(response).encode() + b"\n")
            self.wfile.flush()


class ApiServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """Serves the job service on a unix socket (mode 0660)."""

    daemon_threads = True

    def __init__(self, path: Path, service: JobService, tokens: dict[str, str], admin_token: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            path.unlink()
        super().__init__(str(path), _Handler)
        os.chmod(path, 0o660)
        self.path = path
        self.service = service
        self.tokens = tokens
        self.admin_token = admin_token
        self._thread: threading.Thread | None = None

    def caller_for(self, token: object) -> Caller:
        if isinstance(token, str) and token == self.admin_token:
            return Caller(None)
        if isinstance(token, str) and token in self.tokens:
            return Caller(self.tokens[token])
        raise ServiceError("permission_denied", "unknown token")

    def answer(self, line: bytes) -> dict:
        try:
            if len(line) > MAX_REQUEST_BYTES:
                raise ServiceError("invalid_argument", "request too large")
            request = json.loads(line)
            if not isinstance(request, dict) or not isinstance(request.get("args", {}), dict):
                raise ServiceError("invalid_argument", "request must be an object with an args object")
            caller = self.caller_for(request.get("token"))
            result = _dispatch(self.service, caller, str(request.get("op")), request.get("args", {}))
            return {"ok": True, "result": result}
        except ServiceError as err:
            return {"ok": False, "error": {"code": err.code, "message": str(err)}}
        except P4RuntimeError as err:
            return {"ok": False, "error": {"code": "switch_error", "message": str(err)}}
        except ConfigError as err:
            return {"ok": False, "error": {"code": "invalid_argument", "message": str(err)}}
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {"ok": False, "error": {"code": "invalid_argument", "message": "request is not JSON"}}
        except (KeyError, TypeError, ValueError) as err:
            return {"ok": False, "error": {"code": "invalid_argument", "message": f"bad arguments: {err}"}}
        except Exception as err:  # never let one request take the daemon down
            log.exception("request failed")
            return {"ok": False, "error": {"code": "internal", "message": f"internal error: {err}"}}

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="netagg-api", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self.path.exists():
            self.path.unlink()


class ApiClient:
    """Talks to a running controller."""

    def __init__(self, path: Path | str, token: str, timeout: float = 30.0) -> None:
        self.path = str(path)
        self.token = token
        self.timeout = timeout

    def call(self, op: str, **args: Any) -> Any:
        request = json.dumps({"token": self.token, "op": op, "args": args}).encode() + b"\n"
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout)
                sock.connect(self.path)
                sock.sendall(request)
                reply = sock.makefile("rb").readline()
        except (FileNotFoundError, ConnectionRefusedError):
            raise ApiError("unreachable", f"no controller listening on {self.path} "
                                          "(start one with `netagg controller run`)") from None
        except TimeoutError:
            raise ApiError("unreachable", f"the controller on {self.path} did not answer "
                                          f"within {self.timeout:.0f} s") from None
        except OSError as err:
            raise ApiError("unreachable", f"cannot reach the controller on {self.path}: {err.strerror}") from None
        if not reply:
            raise ApiError("unreachable", f"the controller on {self.path} closed the connection")
        response = json.loads(reply)
        if not response.get("ok"):
            error = response.get("error", {})
            raise ApiError(error.get("code", "internal"), error.get("message", "unknown error"))
        return response["result"]
