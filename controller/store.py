"""The controller's durable state: jobs in SQLite (WAL), written before the switch is touched.

A job row goes through ``installing`` -> ``active`` -> ``deleting`` -> (row removed).
Its slot range stays taken until the row is gone, so a crash at any moment can
neither lose a job nor hand its slots to another one; the daemon's reconcile
finishes whatever the crash interrupted.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from netagg import wire

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id        INTEGER PRIMARY KEY,
    tenant        TEXT NOT NULL,
    name          TEXT NOT NULL,
    mode          TEXT NOT NULL CHECK (mode IN ('allreduce', 'ps', 'fallback')),
    state         TEXT NOT NULL CHECK (state IN ('installing', 'active', 'deleting')),
    slot_base     INTEGER NOT NULL,
    slot_count    INTEGER NOT NULL,
    slots_wanted  INTEGER NOT NULL,
    generation    INTEGER NOT NULL UNIQUE,
    workers       TEXT NOT NULL,
    ps            TEXT,
    lease_seconds REAL NOT NULL,
    lease_expires REAL NOT NULL,
    created       REAL NOT NULL,
    counter_base  TEXT NOT NULL DEFAULT '{}',
    note          TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS moves (
    job_id      INTEGER PRIMARY KEY,
    generation  INTEGER NOT NULL UNIQUE,
    slot_base   INTEGER NOT NULL,
    slot_count  INTEGER NOT NULL,
    reason      TEXT NOT NULL,
    created     REAL NOT NULL,
    switch_at   INTEGER,
    answered    INTEGER NOT NULL DEFAULT -1
);
INSERT OR IGNORE INTO meta (key, value) VALUES ('next_generation', 1);
"""

#: Columns added after the first schema (name, declaration); ``JobStore`` adds any that a database lacks.
MIGRATIONS = (
    ("update_mode", "TEXT NOT NULL DEFAULT 'sync'"),
    ("delay_bound", "INTEGER"),
    ("schedule", "TEXT NOT NULL DEFAULT 'fifo'"),
    ("replicas", "TEXT NOT NULL DEFAULT '[]'"),
    ("secret", "TEXT NOT NULL DEFAULT ''"),
    ("switch_aggregation", "INTEGER NOT NULL DEFAULT 0"),
    ("senders", "INTEGER NOT NULL DEFAULT 0"),
    ("distribution", "INTEGER"),
    ("distribution_of", "INTEGER"),
    ("threads", "INTEGER NOT NULL DEFAULT 1"),
    ("ps_members", "INTEGER NOT NULL DEFAULT 0"),
    ("segments", "TEXT NOT NULL DEFAULT '{}'"),
    # Wide packets (docs/protocol.md): values per packet; the jobs of a database from before it were narrow.
    ("width", f"INTEGER NOT NULL DEFAULT {wire.K}"),
    # How the job's slots were chosen (controller/sizing.py); the jobs of a database from before it asked.
    ("slots_chosen_by", "TEXT NOT NULL DEFAULT 'asked'"),
    # The job's deadline allreduce (WorkerConfig.deadline_ms); the jobs of a database from before it are exact.
    ("deadline_ms", "REAL NOT NULL DEFAULT 0"),
    # A distribution job's receivers that left its multicast group (their links could not take the versions).
    ("left_receivers", "TEXT NOT NULL DEFAULT '[]'"),
)


@dataclass(frozen=True)
class WorkerEndpoint:
    """One worker of a job: rank, host name (from the config), address and UDP port."""

    rank: int
    host: str
    ip: str
    udp_port: int


@dataclass(frozen=True)
class PsEndpoint:
    """The job's parameter server."""

    host: str
    ip: str
    udp_port: int


@dataclass
class JobRecord:
    """A job as the database holds it.

    Switch memory is counted in cells (docs/protocol.md, "Wide packets"): ``slot_base`` is the job's first
    cell, ``slot_count`` the number of its own slots, each ``cells`` cells wide; it holds the cells
    ``slot_base .. slot_base + cell_count - 1``.
    """

    job_id: int
    tenant: str
    name: str
    mode: str
    state: str
    slot_base: int
    slot_count: int
    slots_wanted: int
    generation: int
    workers: list[WorkerEndpoint]
    ps: PsEndpoint | None
    lease_seconds: float
    lease_expires: float
    created: float
    counter_base: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    #: MLfabric options (docs/mlfabric.md): sync/async, delay bound, update order, PS replicas.
    update_mode: str = "sync"
    delay_bound: int | None = None
    schedule: str = "fifo"
    replicas: list[PsEndpoint] = field(default_factory=list)
    #: The job's shared secret for its servers (netagg/jobsecret.py); "" for jobs made before secrets.
    secret: str = field(default="", repr=False)
    #: MLfabric: the scheduler's groups are summed in the job's switch slots (subset rounds).
    switch_aggregation: bool = False
    #: A one-way job: its last ``senders`` ranks only send (not in its group), the others only receive
    #: (not in the workers table): a PS distributing the model (docs/mlfabric.md). 0: every rank does both.
    senders: int = 0
    #: MLfabric model distribution (docs/mlfabric.md): the id of the one-way job the controller made with
    #: this one (its PS chain sends every version through it), and on that job the id of the job it serves.
    #: The two are created, renewed and deleted together; None where there is no such link.
    distribution: int | None = None
    distribution_of: int | None = None
    #: Processes per worker over its share of the slots (WorkerConfig.threads); 1 unless mode allreduce.
    threads: int = 1
    #: MLfabric switch aggregation: the last ``ps_members`` ranks are the PS chain's endpoints on the switch,
    #: members of every switch group (WorkerConfig.ps_members). 0: the workers are every rank.
    ps_members: int = 0
    #: Under a topology (docs/hierarchy.md): the job's slots on each switch of its tree, root first
    #: (switch -> (slot base, slot count): its first cell there and its own slots, like ``slot_base`` and
    #: ``slot_count``); written with the row, in its transaction. Its counter baselines
    #: are then per switch too (switch -> counter -> value). Empty on a controller of one switch.
    segments: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Values per packet (``wire.WIDTHS``: 64 or 256), the same on every switch of its tree and in every
    #: worker's config; a fallback job keeps it too (the PS aggregates either width).
    width: int = wire.K
    #: How ``slots_wanted`` was chosen: ``asked`` (the create named it), or by the controller from the links
    #: of the job's hosts (``link R Mbit/s x T ms``) or without a known rate (``default ...``): sizing.py.
    slots_chosen_by: str = "asked"
    #: Deadline allreduce (WorkerConfig.deadline_ms): ms after which its ranks' gradient allreduces close their
    #: rounds; 0: exact.
    deadline_ms: float = 0.0
    #: A distribution job's receiver ranks that left its multicast group (docs/mlfabric.md, "Receivers whose link
    #: cannot take the versions"): the switch copies no version to them until they join again.
    left_receivers: list[int] = field(default_factory=list)

    @property
    def uses_switch(self) -> bool:
        return self.mode != "fallback"

    @property
    def cells(self) -> int:
        """Cells per slot (``wire.cells_of(width)``)."""
        return wire.cells_of(self.width)

    @property
    def cell_count(self) -> int:
        """Cells the job holds on each of its switches (0 in fallback mode)."""
        return self.slot_count * self.cells

    def to_dict(self) -> dict:
        """The job as plain data, without its secret (views, logs, the API)."""
        data = asdict(self)
        data.pop("secret")
        return data


def _row_to_job(row: sqlite3.Row) -> JobRecord:
    ps = json.loads(row["ps"]) if row["ps"] else None
    return JobRecord(
        job_id=row["job_id"], tenant=row["tenant"], name=row["name"], mode=row["mode"], state=row["state"],
        slot_base=row["slot_base"], slot_count=row["slot_count"], slots_wanted=row["slots_wanted"],
        generation=row["generation"],
        workers=[WorkerEndpoint(**w) for w in json.loads(row["workers"])],
        ps=PsEndpoint(**ps) if ps else None,
        lease_seconds=row["lease_seconds"], lease_expires=row["lease_expires"], created=row["created"],
        counter_base=json.loads(row["counter_base"]), note=row["note"],
        update_mode=row["update_mode"], delay_bound=row["delay_bound"], schedule=row["schedule"],
        replicas=[PsEndpoint(**r) for r in json.loads(row["replicas"])], secret=row["secret"],
        switch_aggregation=bool(row["switch_aggregation"]), senders=row["senders"],
        distribution=row["distribution"], distribution_of=row["distribution_of"], threads=row["threads"],
        ps_members=row["ps_members"],
        segments={switch: (base, count) for switch, (base, count) in json.loads(row["segments"]).items()},
        width=row["width"], slots_chosen_by=row["slots_chosen_by"], deadline_ms=row["deadline_ms"],
        left_receivers=[int(r) for r in json.loads(row["left_receivers"])],
    )


@dataclass
class MoveRecord:
    """A running job's move to a new slot range (controller/moves.py), from its start until every worker switched.

    ``generation`` is the job's after the move (a fresh one); ``slot_base``/``slot_count`` its new range.
    ``switch_at``: the exchange every worker switches at (None: not decided yet); ``answered``: the largest
    exchange a worker was told to run on the old range (the decision comes after it).
    """

    job_id: int
    generation: int
    slot_base: int
    slot_count: int
    reason: str
    created: float
    switch_at: int | None = None
    answered: int = -1


class JobStore:
    """Thread-safe access to the jobs database."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=10)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.executescript(SCHEMA)
        self._migrate()
        self._lock = threading.RLock()

    def _migrate(self) -> None:
        """Add the columns of :data:`MIGRATIONS` that an older database lacks (their defaults fill old rows)."""
        have = {row["name"] for row in self._conn.execute("PRAGMA table_info(jobs)")}
        for name, declaration in MIGRATIONS:
            if name not in have:
                self._conn.execute(f"ALTER TABLE jobs ADD COLUMN {name} {declaration}")

    def close(self) -> None:
        self._conn.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error), serialized across threads."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def next_generation(self, conn: sqlite3.Connection) -> int:
        value = conn.execute("SELECT value FROM meta WHERE key = 'next_generation'").fetchone()[0]
        conn.execute("UPDATE meta SET value = ? WHERE key = 'next_generation'", (value + 1,))
        return value

    def meta(self, key: str) -> int | None:
        """A number the controller keeps across restarts (e.g. the worker endpoint's port), None if unset."""
        with self._lock:
            row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else int(row[0])

    def set_meta(self, key: str, value: int) -> None:
        with self.transaction() as conn:
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def insert(self, conn: sqlite3.Connection, job: JobRecord) -> None:
        conn.execute(
            "INSERT INTO jobs (job_id, tenant, name, mode, state, slot_base, slot_count, slots_wanted, generation,"
            " workers, ps, lease_seconds, lease_expires, created, counter_base, note,"
            " update_mode, delay_bound, schedule, replicas, secret, switch_aggregation, senders, distribution,"
            " distribution_of, threads, ps_members, segments, width, slots_chosen_by, deadline_ms,"
            " left_receivers)"
            f" VALUES ({', '.join('?' * 32)})",
            (job.job_id, job.tenant, job.name, job.mode, job.state, job.slot_base, job.slot_count,
             job.slots_wanted, job.generation, json.dumps([asdict(w) for w in job.workers]),
             json.dumps(asdict(job.ps)) if job.ps else None, job.lease_seconds, job.lease_expires,
             job.created, json.dumps(job.counter_base), job.note, job.update_mode, job.delay_bound, job.schedule,
             json.dumps([asdict(r) for r in job.replicas]), job.secret, int(job.switch_aggregation), job.senders,
             job.distribution, job.distribution_of, job.threads, job.ps_members,
             json.dumps({switch: list(r) for switch, r in job.segments.items()}), job.width, job.slots_chosen_by,
             job.deadline_ms, json.dumps(sorted(job.left_receivers))),
        )

    def set_state(self, job_id: int, state: str, *more: int) -> None:
        """Set the state of ``job_id`` and of the ``more`` job ids, in one transaction."""
        with self.transaction() as conn:
            for one in (job_id, *more):
                conn.execute("UPDATE jobs SET state = ? WHERE job_id = ?", (state, one))

    def set_left_receivers(self, job_id: int, ranks: list[int]) -> None:
        with self.transaction() as conn:
            conn.execute("UPDATE jobs SET left_receivers = ? WHERE job_id = ?", (json.dumps(sorted(ranks)), job_id))

    def set_counter_base(self, job_id: int, base: dict[str, Any]) -> None:
        with self.transaction() as conn:
            conn.execute("UPDATE jobs SET counter_base = ? WHERE job_id = ?", (json.dumps(base), job_id))

    def renew(self, job_id: int, now: float | None = None) -> float:
        now = time.time() if now is None else now
        with self.transaction() as conn:
            row = conn.execute("SELECT lease_seconds FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            expires = now + row["lease_seconds"]
            conn.execute("UPDATE jobs SET lease_expires = ? WHERE job_id = ?", (expires, job_id))
        return expires

    def remove(self, job_id: int) -> None:
        with self.transaction() as conn:
            conn.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
            conn.execute("DELETE FROM moves WHERE job_id = ?", (job_id,))

    # -- moves (controller/moves.py) ---------------------------------------------
    def moves(self) -> list[MoveRecord]:
        with self._lock:
            rows = self._conn.execute("SELECT * FROM moves ORDER BY job_id").fetchall()
        return [MoveRecord(**dict(row)) for row in rows]

    def move(self, job_id: int) -> MoveRecord | None:
        with self._lock:
            row = self._conn.execute("SELECT * FROM moves WHERE job_id = ?", (job_id,)).fetchone()
        return MoveRecord(**dict(row)) if row else None

    def insert_move(self, conn: sqlite3.Connection, move: MoveRecord) -> None:
        conn.execute("INSERT INTO moves (job_id, generation, slot_base, slot_count, reason, created, switch_at,"
                     " answered) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                     (move.job_id, move.generation, move.slot_base, move.slot_count, move.reason, move.created,
                      move.switch_at, move.answered))

    def set_move_progress(self, job_id: int, answered: int, switch_at: int | None) -> None:
        with self.transaction() as conn:
            conn.execute("UPDATE moves SET answered = ?, switch_at = ? WHERE job_id = ?",
                         (answered, switch_at, job_id))

    def delete_move(self, job_id: int) -> None:
        with self.transaction() as conn:
            conn.execute("DELETE FROM moves WHERE job_id = ?", (job_id,))

    def commit_move(self, move: MoveRecord) -> None:
        """The job takes the move's range and generation, and the move is gone: one transaction."""
        with self.transaction() as conn:
            conn.execute("UPDATE jobs SET slot_base = ?, slot_count = ?, generation = ? WHERE job_id = ?",
                         (move.slot_base, move.slot_count, move.generation, move.job_id))
            conn.execute("DELETE FROM moves WHERE job_id = ?", (move.job_id,))

    def get(self, job_id: int) -> JobRecord | None:
        with self._lock:
            row = self._conn.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return _row_to_job(row) if row else None

    def all(self, conn: sqlite3.Connection | None = None) -> list[JobRecord]:
        with self._lock:
            rows = (conn or self._conn).execute("SELECT * FROM jobs ORDER BY job_id").fetchall()
        return [_row_to_job(r) for r in rows]

    def expired(self, now: float) -> list[JobRecord]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT * FROM jobs WHERE lease_expires < ? AND state != 'deleting'", (now,)).fetchall()
        return [_row_to_job(r) for r in rows]
