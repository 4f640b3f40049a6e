"""Each job's fair share of a switch's memory: weighted max-min over the jobs that can move (docs/controller.md,
"Fair shares that move").

A job claims the cells its path needs (``slots_wanted``, sized to its links' rate x round trip, or asked); no job is
given more than it claims, none less than the configured minimum, and what is left is split in proportion to the
jobs' weights (its tenant's weight, shared among the tenant's jobs). A job that cannot move keeps what it holds.
Everything is counted in cells and handed out in whole slots of each job's width.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    """One job's claim on the switch's cells."""

    job_id: int
    #: Cells it asks for (its slots wanted x cells per slot), the most it is given.
    want: int
    #: Cells per slot: shares are whole numbers of them.
    unit: int
    #: Cells it is never cut below (the configured minimum slots per job, at most ``want``).
    minimum: int
    #: Its weight in the split (its tenant's weight / the tenant's jobs).
    weight: float
    #: Cells it holds now; a job that cannot move keeps exactly these.
    held: int
    movable: bool = True


def fair_cells(capacity: int, claims: list[Claim]) -> dict[int, int]:
    """Cells per job id (see the module docstring). When the minimums alone do not fit, the shares are the minimums
    (the caller admits no newcomer then)."""
    shares = {c.job_id: c.held for c in claims if not c.movable}
    movable = [c for c in claims if c.movable]
    room = capacity - sum(shares.values())
    if not movable:
        return shares
    if sum(c.minimum for c in movable) >= room:
        return {**shares, **{c.job_id: c.minimum for c in movable}}

    def given(c: Claim, level: float) -> float:
        return min(max(c.weight * level, c.minimum), c.want)

    low, high = 0.0, max(c.want / c.weight for c in movable) if all(c.weight > 0 for c in movable) else float(room)
    for _ in range(100):  # the largest water level whose shares fit the room
        mid = (low + high) / 2
        if sum(given(c, mid) for c in movable) <= room:
            low = mid
        else:
            high = mid
    for c in movable:
        shares[c.job_id] = max(int(given(c, low)) // c.unit * c.unit, min(c.minimum, c.want))
    # Rounding down left whole slots over: one more slot each, fullest claims last, while they fit.
    left = room - sum(shares[c.job_id] for c in movable)
    for c in sorted(movable, key=lambda c: (shares[c.job_id] / c.weight if c.weight else 0.0, c.job_id)):
        if c.unit <= left and shares[c.job_id] + c.unit <= c.want:
            shares[c.job_id] += c.unit
            left -= c.unit
    return shares
