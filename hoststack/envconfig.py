"""A :class:`WorkerConfig` from environment variables, in the manner of PS-lite.

=====================  ==========================================================
``DMLC_ROLE``          ``worker`` (default) or ``server``
``DMLC_PS_ROOT_URI``   the parameter server's host (ps and fallback modes)
``DMLC_PS_ROOT_PORT``  the parameter server's port (UDP and TCP)
``DMLC_NUM_WORKER``    number of workers of the job (1..32)
``NETAGG_JOB_ID``      the job id the controller assigned (1..65535)
``NETAGG_RANK``        this worker's rank (workers; a server uses 0)
``NETAGG_SLOTS``       the job's slot count (optional in fallback mode)
``NETAGG_AGGREGATOR``  ``host:port`` of the switch's aggregator (default in fallback: the PS)
``NETAGG_BIND``        ``host:port`` this worker sends from, as registered in the switch
                       (a server defaults to the PS endpoint)
``NETAGG_THREADS``     sender/receiver threads per worker (default 1; the same on every worker of the job)
``NETAGG_WIDTH``       values per packet, the job's width: 64 (default) or 256, as ``netagg job config`` says
``NETAGG_MODE``        ``allreduce`` (default), ``ps`` or ``fallback``
``NETAGG_JOB_SECRET``  the job's secret from ``netagg job config`` (optional; the PS refuses
                       requests without it when it has one)
``NETAGG_FAILOVER_AFTER`` seconds without a result before the workers move the job's
                       exchanges to the PS (default 5; 0: never; needs a PS)
``NETAGG_DEADLINE_MS`` the job's deadline allreduce: its gradient allreduces (the DDP hook's) close
                       their rounds this many ms after they began (default 0: exact; the same on
                       every worker of the job; mode allreduce)
=====================  ==========================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from netagg.jobconfig import MODES, ConfigError, Endpoint, WorkerConfig

ROLES = ("worker", "server")


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = env.get(name)
    if text is None or text.strip() == "":
        if default is None:
            raise ConfigError(f"{name}: not set")
        return default
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {text!r}") from None


def _float(env: Mapping[str, str], name: str, unit: str) -> float | None:
    """``name``'s number (None when unset or empty); ConfigError naming it and ``unit`` otherwise."""
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{name}: expected {unit}, got {text!r}") from None


def _endpoint(env: Mapping[str, str], name: str) -> Endpoint | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        return Endpoint.parse(text)
    except ValueError as err:
        raise ConfigError(f"{name}: {err}") from None


def config_from_env(environ: Mapping[str, str] | None = None, role: str | None = None) -> WorkerConfig:
    """Build the config from ``environ`` (default ``os.environ``); ConfigError names the variable."""
    env = os.environ if environ is None else environ
    role = role or env.get("DMLC_ROLE", "worker").strip() or "worker"
    if role not in ROLES:
        raise ConfigError(f"DMLC_ROLE: {role!r} is not one of {', '.join(ROLES)} (netagg has no scheduler)")
    mode = env.get("NETAGG_MODE", "allreduce").strip() or "allreduce"
    if mode not in MODES:
        raise ConfigError(f"NETAGG_MODE: {mode!r} is not one of {', '.join(MODES)}")
    ps = None
    if env.get("DMLC_PS_ROOT_URI", "").strip():
        port = _int(env, "DMLC_PS_ROOT_PORT")
        if not 0 < port < 65536:
            raise ConfigError(f"DMLC_PS_ROOT_PORT: {port} not in 1..65535")
        ps = Endpoint(env["DMLC_PS_ROOT_URI"].strip(), port)
    elif mode in ("ps", "fallback") or role == "server":
        raise ConfigError(f"DMLC_PS_ROOT_URI: not set (mode {mode} needs the parameter server)")
    aggregator = _endpoint(env, "NETAGG_AGGREGATOR")
    if aggregator is None:
        if mode != "fallback":
            raise ConfigError(f"NETAGG_AGGREGATOR: not set (mode {mode} sends to the switch)")
        aggregator = ps
    bind = _endpoint(env, "NETAGG_BIND")
    if bind is None:
        if role != "server":
            raise ConfigError("NETAGG_BIND: not set (the worker's source address registered in the switch)")
        bind = ps
    values = {
        "job_id": _int(env, "NETAGG_JOB_ID"),
        "num_workers": _int(env, "DMLC_NUM_WORKER"),
        "rank": _int(env, "NETAGG_RANK", 0 if role == "server" else None),
        "slot_count": _int(env, "NETAGG_SLOTS", 0 if mode == "fallback" else None),
    }
    threads = env.get("NETAGG_THREADS", "").strip()
    if threads:
        values["threads"] = _int(env, "NETAGG_THREADS")
    if env.get("NETAGG_WIDTH", "").strip():
        values["width"] = _int(env, "NETAGG_WIDTH")
    for key, name, unit in (("failover_after", "NETAGG_FAILOVER_AFTER", "seconds"),
                            ("deadline_ms", "NETAGG_DEADLINE_MS", "milliseconds")):
        if (number := _float(env, name, unit)) is not None:
            values[key] = number
    try:
        return WorkerConfig(mode=mode, aggregator=aggregator, bind=bind, ps=ps,
                            secret=env.get("NETAGG_JOB_SECRET", "").strip(), **values)
    except ConfigError as err:
        names = {"job_id": "NETAGG_JOB_ID", "num_workers": "DMLC_NUM_WORKER", "rank": "NETAGG_RANK",
                 "slot_count": "NETAGG_SLOTS", "mode": "NETAGG_MODE", "ps": "DMLC_PS_ROOT_URI",
                 "secret": "NETAGG_JOB_SECRET", "failover_after": "NETAGG_FAILOVER_AFTER",
                 "threads": "NETAGG_THREADS", "width": "NETAGG_WIDTH", "deadline_ms": "NETAGG_DEADLINE_MS"}
        field_name = str(err).split(":", 1)[0]
        raise ConfigError(f"{names.get(field_name, field_name)}: {str(err).split(':', 1)[-1].strip()}") from None
