"""The worker side of netagg: quantization, fragmentation, UDP transport and a PS-lite style API.

See docs/hoststack.md. ``KVWorker`` and ``KVServer`` are the entry points. Exports are
imported lazily, so ``python -m netagg.hoststack.server`` does not import itself twice.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "KVWorker": "kv",
    "PsError": "psproto",
    "KVServer": "server",
    "SGD": "server",
    "sum_store": "server",
    "Transport": "transport",
    "TransportError": "transport",
    "TransportTimeout": "transport",
    "config_from_env": "envconfig",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
