"""A job's shared secret: made by the controller, carried by every request to the job's servers.

The controller gives each job a random secret and writes it into every rank's worker
config (``WorkerConfig.secret``). The job's parameter servers (``KVServer``, the MLfabric
PS chain) and aggregation endpoints refuse a request whose ``secret`` field does not
match, so another tenant that can reach them cannot register as a worker, push, pull,
halt or join. A config without a secret (written before secrets existed, or by hand)
turns the check off. UDP data packets carry no secret: the switch's worker table
(source address and port per rank) is their admission check.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable

#: The request field that carries the secret.
FIELD = "secret"
#: The reason every server gives for a request without the right secret (never the secret itself).
REFUSAL = "wrong or missing job secret"


def new_secret() -> str:
    """A fresh random secret (URL-safe text, 256 bits)."""
    return secrets.token_urlsafe(32)


def matches(expected: str, header: dict) -> bool:
    """Whether ``header`` carries the job's secret (always true when the job has none); constant time."""
    if not expected:
        return True
    given = header.get(FIELD)
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


def require(expected: str, header: dict, count: Callable[[], None]) -> None:
    """Raise ValueError (:data:`REFUSAL`) unless ``header`` carries the job's secret; ``count`` the refusal first.

    Every server of a job calls this before looking at anything else in a request.
    """
    if not matches(expected, header):
        count()
        raise ValueError(REFUSAL)


def with_secret(header: dict, secret: str) -> dict:
    """``header`` with the secret added (unchanged when there is none)."""
    return {**header, FIELD: secret} if secret else header
