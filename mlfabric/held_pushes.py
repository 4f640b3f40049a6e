"""Single pushes the PS holds for its next switch group, instead of applying them at once.

In gang rounds with the PS in every switch group (``ps_members``), the members compute each new model themselves
from the group's sum. A slow worker's own push, applied on its own between two groups, is a version they did not
compute: they wait for it through the switch or pull it (measured in the dynamic cluster: three such pushes in a
row held the pair of fast workers 1-1.4 s per group). So the PS holds such a push for up to ``max_wait`` seconds:
when the next switch group is planned, the push becomes one of its parts and the PS's own contribution to the
group's sum (the sum of the held gradients, where it sent zeros before); the members' sum then holds it, and they
compute the model after it too. A push no group took in time, or whose group failed, is applied on its own, as
before. Its pusher waits either way: it is answered once its update is applied (or dropped), as for any push.

:class:`HeldPushes` keeps the entries and their states; its lock is taken last (the grant service calls
:meth:`take` under its own lock, the PS under ``_cond``), and nothing else is called while it is held.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

#: An entry's states: waiting for a group, part of a planned group, or back to the pusher (apply it alone).
HELD, TAKEN, FREE = "held", "taken", "free"


@dataclass
class HeldPush:
    """One held push: its part (update id, rank, version), its gradient, its state and its group."""

    part: tuple[str, int, int]
    grad: np.ndarray
    state: str = HELD
    group: int | None = None


class HeldPushes:
    """The pushes held for the next switch group (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, HeldPush] = OrderedDict()

    def hold(self, part: tuple[str, int, int], grad: np.ndarray) -> HeldPush | None:
        """Hold this push; None if a push of the same update, or another of the same rank, is held already (its
        pusher applies it alone): at most one model-sized gradient per rank waits here."""
        with self._lock:
            if part[0] in self._entries or any(e.part[1] == part[1] for e in self._entries.values()):
                return None
            entry = self._entries[part[0]] = HeldPush(part, grad)
            return entry

    def release(self, entry: HeldPush) -> bool:
        """The pusher stops waiting for a group: True (the entry is gone, apply it alone) unless a planned group
        holds it (then its outcome comes with the group, or the entry becomes free again if the group fails)."""
        with self._lock:
            if entry.state == TAKEN:
                return False
            self._entries.pop(entry.part[0], None)
            entry.state = FREE
            return True

    def take(self, fits: Callable[[tuple[str, int, int]], bool], group: int) -> list[tuple[str, int, int]]:
        """The parts of the held pushes that ``fits(part)`` accepts, for switch group ``group`` (now TAKEN)."""
        with self._lock:
            taken = [e for e in self._entries.values() if e.state == HELD and fits(e.part)]
            for entry in taken:
                entry.state, entry.group = TAKEN, group
            return [entry.part for entry in taken]

    def contribution(self, update_ids: list[str], values: int) -> np.ndarray | None:
        """The sum of these taken pushes' gradients (float32 of ``values``); None if there are none."""
        with self._lock:
            grads = [self._entries[i].grad for i in update_ids if i in self._entries]
        if not grads:
            return None
        total = np.zeros(values, np.float32)
        for grad in grads:
            total += grad
        return total

    def done(self, update_ids: list[str]) -> None:
        """These taken pushes were applied (or dropped) with their group: their pushers find the outcome."""
        with self._lock:
            for update_id in update_ids:
                self._entries.pop(update_id, None)

    def free(self, update_ids: list[str]) -> None:
        """Their group failed: each pusher applies its push alone."""
        with self._lock:
            for update_id in update_ids:
                entry = self._entries.pop(update_id, None)
                if entry is not None:
                    entry.state = FREE

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
