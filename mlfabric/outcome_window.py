"""The MLfabric PS's duplicate-push window: the outcomes of each rank's most recent steps.

Update ids are ``rank:step`` (:func:`update_step`). :class:`OutcomeWindow` keeps the outcomes of
each rank's last ``size`` steps to answer a repeated push (``duplicate: true``), and tells a step
too old to be told from a new one (expired: the push is refused, never applied twice).
"""

from __future__ import annotations

import heapq
from typing import Any


def update_step(update_id: str, rank: int) -> int:
    """The step of update id ``rank:step``; ValueError if the id is not that rank's."""
    prefix, sep, step = update_id.partition(":")
    if not sep or prefix != str(rank) or not (step.isascii() and step.isdigit()):
        raise ValueError(f"update id {update_id!r}: expected '{rank}:<step>' (the sender's rank, a step >= 0)")
    return int(step)


class OutcomeWindow:
    """The outcomes of each rank's ``size`` most recent steps, for answering a repeated push.

    A rank's window is the steps ``newest - size + 1 .. newest`` (``newest``: the highest step of
    that rank ever recorded); outcomes of older steps are forgotten, and such a step is
    :meth:`expired`: a push of it cannot be told from a new one and must be refused.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("the outcome window must hold at least 1 step per rank")
        self.size = size
        self.newest: dict[int, int] = {}
        self._outcomes: dict[int, dict[int, dict[str, Any]]] = {}
        self._steps: dict[int, list[int]] = {}  # a min-heap of each rank's kept steps

    def __len__(self) -> int:
        return sum(len(o) for o in self._outcomes.values())

    def get(self, rank: int, step: int) -> dict[str, Any] | None:
        return self._outcomes.get(rank, {}).get(step)

    def expired(self, rank: int, step: int) -> bool:
        return step <= self.newest.get(rank, -1) - self.size

    def put(self, rank: int, step: int, outcome: dict[str, Any]) -> None:
        """Record a step's outcome (ignored if it is already outside the window) and forget what falls out."""
        if self.expired(rank, step):
            return
        outcomes = self._outcomes.setdefault(rank, {})
        steps = self._steps.setdefault(rank, [])
        if step not in outcomes:
            heapq.heappush(steps, step)
        outcomes[step] = outcome
        self.newest[rank] = newest = max(step, self.newest.get(rank, step))
        while steps and steps[0] <= newest - self.size:
            del outcomes[heapq.heappop(steps)]

    def to_json(self) -> dict[str, Any]:
        """The window as JSON (for a state transfer)."""
        return {str(rank): {"newest": newest, "outcomes": {str(s): o for s, o in self._outcomes.get(rank, {}).items()}}
                for rank, newest in self.newest.items()}

    @classmethod
    def from_json(cls, size: int, data: dict[str, Any]) -> OutcomeWindow:
        """A window of ``size`` steps per rank filled from :meth:`to_json`'s output; ValueError if malformed."""
        window = cls(size)
        try:
            for rank_text, entry in data.items():
                rank = int(rank_text)
                window.newest[rank] = int(entry["newest"])
                for step_text, outcome in entry["outcomes"].items():
                    if not isinstance(outcome, dict):
                        raise ValueError(f"outcome of {rank}:{step_text} is not an object")
                    window.put(rank, int(step_text), outcome)
        except (AttributeError, KeyError, TypeError) as err:
            raise ValueError(f"outcome window: {type(err).__name__}: {err}") from None
        return window
