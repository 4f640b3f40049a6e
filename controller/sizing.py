"""How many slots a job gets when its create names none: enough to keep its links busy (docs/controller.md,
"How many slots").

A worker keeps at most one packet per slot in flight, so a job's window is ``slots * k * 4`` bytes (k values
of 4 bytes per packet). To fill a link of R Mbit/s over a round trip of T, the window must hold
``R * 1e6 / 8 * T`` bytes. :func:`choose_slots` turns that into slots; the service stores how they were chosen
with the job (``slots_chosen_by``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from netagg import wire

#: A job whose hosts have no known link rate (no ``link_mbit``) gets this many slots.
DEFAULT_SLOTS = 64
#: Never fewer slots than this when the controller chooses (a window too small to ride out one lost packet).
MIN_CHOSEN_SLOTS = 16
#: Never more than this when the controller chooses: a wide job of 1024 slots holds 4096 cells, a whole switch.
MAX_CHOSEN_SLOTS = 1024
#: What the packet's 16-bit ``slot`` field can index.
SLOT_FIELD_LIMIT = 1 << 16
#: ``slots_chosen_by`` of a job whose create named its slots.
ASKED = "asked"


@dataclass(frozen=True)
class SlotChoice:
    """The slots chosen and why (``slots_chosen_by``: ``link R Mbit/s x T ms``, ``default ...`` or ``asked``)."""

    slots: int
    chosen_by: str


def choose_slots(rates_mbit: Iterable[float | None], width: int, target_rtt_ms: float, min_slots: int = 1,
                 capacity_cells: int | None = None) -> SlotChoice:
    """The slots of a job whose create names none, from its hosts' link rates.

    ``rates_mbit``: the ``link_mbit`` of each host of the job (its workers, and its PS in ps/fallback
    modes; None where unknown). With R the smallest known rate, k the job's ``width`` and T
    ``target_rtt_ms``: ``ceil(R * 1e6 / 8 * T / 1000 / (k * 4))`` slots (the window that fills the slowest
    link for one round trip), at least ``min_slots`` (``slots.min_per_job``) and :data:`MIN_CHOSEN_SLOTS`,
    then at most :data:`MAX_CHOSEN_SLOTS`, what the 16-bit slot field indexes, and what ``capacity_cells``
    (``slots.capacity``) holds in slots of width k. No host with a rate: :data:`DEFAULT_SLOTS`, within
    the same caps. E.g. 400 Mbit/s, 5 ms, width 256: 250 000 bytes in flight, 245 slots (980 cells).
    """
    if width not in wire.WIDTH_CODES:
        raise ValueError(f"width must be one of {sorted(wire.WIDTH_CODES)}, got {width!r}")
    if not target_rtt_ms > 0:
        raise ValueError(f"target_rtt_ms must be > 0, got {target_rtt_ms!r}")
    known = [r for r in rates_mbit if r is not None]
    cap = min(MAX_CHOSEN_SLOTS, SLOT_FIELD_LIMIT)
    if capacity_cells is not None:
        cap = min(cap, max(1, capacity_cells // wire.cells_of(width)))
    if not known:
        slots = min(DEFAULT_SLOTS, cap)
        return SlotChoice(slots, "default (no link_mbit for the job's hosts)"
                          + (f", capped at {slots}" if slots < DEFAULT_SLOTS else ""))
    rate = min(known)
    window_bytes = rate * 1e6 / 8 * target_rtt_ms / 1000
    raw = math.ceil(window_bytes / (width * 4) - 1e-9)  # 1e-9: no extra slot from float rounding
    floor = max(MIN_CHOSEN_SLOTS, min_slots)
    slots = min(max(raw, floor), cap)
    why = f"link {rate:g} Mbit/s x {target_rtt_ms:g} ms"
    if slots > raw:
        why += f" (needs {raw}; at least {floor})"
    elif slots < raw:
        why += f" (needs {raw}; at most {cap})"
    return SlotChoice(slots, why)
