"""Installing a job on every switch of its tree, all or nothing (docs/hierarchy.md).

:func:`install_tree_job` writes each switch's share (``topology.tree_state``, merged with what the switch
holds already) over that switch's own P4Runtime session, the root first, so that a leaf's partials never
go up to a segment that is not there yet. If any switch refuses (or cannot be reached), the switches
already written are put back as they were, and the error is raised: a job is on all of its switches or on
none. :func:`remove_tree_job` takes it off again, leaves first.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from netagg.controller.errors import P4RuntimeError
from netagg.controller.p4runtime_client import P4RuntimeClient
from netagg.controller.switch_programmer import DesiredState, reconcile_state

log = logging.getLogger(__name__)


def merged(base: DesiredState, extra: DesiredState) -> DesiredState:
    """``base`` plus ``extra``'s entries and groups (``extra`` wins on the same key)."""
    state = DesiredState(dict(base.entries), dict(base.groups))
    state.entries.update(extra.entries)
    state.groups.update(extra.groups)
    return state


def without(base: DesiredState, extra: DesiredState) -> DesiredState:
    """``base`` less ``extra``'s entries and groups."""
    return DesiredState({k: e for k, e in base.entries.items() if k not in extra.entries},
                        {g: r for g, r in base.groups.items() if g not in extra.groups})


def _apply_in_order(clients: Mapping[str, P4RuntimeClient], held: Mapping[str, DesiredState],
                    wanted: Mapping[str, DesiredState], order: Sequence[str]) -> None:
    """Reconcile each switch of ``order`` from ``held`` to ``wanted``; on a failure, those done go back."""
    done: list[str] = []
    try:
        for switch in order:
            reconcile_state(clients[switch], wanted[switch])
            done.append(switch)
    except (P4RuntimeError, OSError) as err:
        for switch in reversed(done):
            try:
                reconcile_state(clients[switch], held[switch])
            except (P4RuntimeError, OSError) as undo:
                log.warning("could not put switch %s back after %s: %s", switch, err, undo)
        raise


def install_tree_job(clients: Mapping[str, P4RuntimeClient], held: Mapping[str, DesiredState],
                     job: Mapping[str, DesiredState], order: Sequence[str]) -> dict[str, DesiredState]:
    """Add ``job``'s share to each switch of ``order`` (the tree's switches, root first); returns what each
    switch holds now. On any failure, every switch is as it was and the error is raised."""
    wanted = {switch: merged(held[switch], job[switch]) for switch in order}
    _apply_in_order(clients, held, wanted, order)
    return {**held, **wanted}


def remove_tree_job(clients: Mapping[str, P4RuntimeClient], held: Mapping[str, DesiredState],
                    job: Mapping[str, DesiredState], order: Sequence[str]) -> dict[str, DesiredState]:
    """Take ``job``'s share off each switch, leaves first (the reverse of ``order``); returns what each holds."""
    wanted = {switch: without(held[switch], job[switch]) for switch in order}
    _apply_in_order(clients, held, wanted, list(reversed(order)))
    return {**held, **wanted}
