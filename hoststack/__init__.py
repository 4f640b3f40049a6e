"""The worker side of netagg: quantization, fragmentation, UDP transport and a PS-lite style API.

See docs/hoststack.md. ``KVWorker`` and ``KVServer`` are the entry points.
"""

from netagg.hoststack.envconfig import config_from_env
from netagg.hoststack.kv import KVWorker
from netagg.hoststack.psproto import PsError
from netagg.hoststack.server import SGD, KVServer, sum_store
from netagg.hoststack.transport import Transport, TransportError, TransportTimeout

__all__ = [
    "SGD",
    "KVServer",
    "KVWorker",
    "PsError",
    "Transport",
    "TransportError",
    "TransportTimeout",
    "config_from_env",
    "sum_store",
]
