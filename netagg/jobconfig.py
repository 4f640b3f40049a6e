"""What one worker of a job needs to know: written by the controller, read by the host stack.

``netagg job config JOB --rank R`` writes this as YAML; ``hoststack`` loads it (or
builds it from ``DMLC_*``/``NETAGG_*`` environment variables).
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from netagg import wire

MODES = ("allreduce", "ps", "fallback")
#: How the job's parameter server applies updates (netagg.mlfabric, docs/mlfabric.md).
UPDATE_MODES = ("sync", "async")
#: In async mode: updates in arrival order, or transfers granted by the MLfabric scheduler.
SCHEDULES = ("fifo", "mlfabric")


class ConfigError(ValueError):
    """A configuration file or value is wrong; the message names the file, key and problem."""


@dataclass(frozen=True)
class Endpoint:
    """An IPv4 address and UDP port."""

    host: str
    port: int

    def as_tuple(self) -> tuple[str, int]:
        return (self.host, self.port)

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """``HOST:PORT`` with a port in 1..65535; ValueError otherwise."""
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected host:port with a port in 1..65535, got {text!r}")
        return cls(host, int(port))


def endpoint_arg(text: str) -> Endpoint:
    """:meth:`Endpoint.parse` as an argparse ``type`` (its error becomes a usage error)."""
    try:
        return Endpoint.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


@dataclass(frozen=True)
class WorkerConfig:
    """A worker's view of its job."""

    job_id: int
    rank: int
    num_workers: int
    slot_count: int
    mode: str
    #: Where contributions go: the switch's aggregator address (or the PS in fallback mode).
    aggregator: Endpoint
    #: This worker's own UDP source address, as registered in the switch.
    bind: Endpoint
    #: The job's parameter server (ps and fallback modes).
    ps: Endpoint | None = None
    tenant: str = ""
    extra: dict = field(default_factory=dict)
    #: MLfabric: ``sync`` (one step per round of all workers) or ``async`` (bounded-delay updates).
    update_mode: str = "sync"
    #: async: the largest delay (PS version at apply minus the update's version) that is still applied.
    delay_bound: int | None = None
    #: async: ``fifo`` (arrival order) or ``mlfabric`` (the scheduler grants each transfer).
    schedule: str = "fifo"
    #: The PS's replicas in chain order (the primary forwards every applied update to the first).
    replicas: tuple[Endpoint, ...] = ()
    #: mlfabric: the updates the scheduler groups are summed in the job's switch slots (subset rounds
    #: among the group's members) instead of at an idle worker; the job's multicast group must be its
    #: workers (mode allreduce), who receive the sums.
    switch_aggregation: bool = False
    #: A one-way job (mode allreduce): its last ``senders`` ranks only send, the others only receive
    #: (0: every rank both). A model distribution job's senders are its PS chain (docs/mlfabric.md).
    senders: int = 0
    #: The job's shared secret (written by the controller; "" = none): every request to the job's
    #: parameter servers and aggregators carries it, and a request without it is refused.
    secret: str = ""
    #: Seconds without a result on the switch path after which the workers vote, at the job's PS, to
    #: move the job's exchanges to the PS (a switch that stays away); 0: never, ride through only. Needs
    #: ``ps`` and mode allreduce or ps (docs/protocol.md, "Failover to the PS").
    failover_after: float = 5.0
    #: Sender/receiver threads of each worker (mode allreduce): the job's slots split into as many ranges of
    #: whole 64-slot blocks, each with its own socket and thread (hoststack/threads.py). A job setting like
    #: ``slot_count``: every worker of the job must use the same value.
    threads: int = 1
    #: MLfabric switch aggregation: the job's last ``ps_members`` ranks are its PS chain (the primary, then the
    #: replicas), members of every switch group: the primary contributes zeros and receives the group's sum
    #: from the switch itself, so no worker pushes it (docs/mlfabric.md). The job's workers are the other ranks.
    ps_members: int = 0
    #: A job over a tree of switches (docs/hierarchy.md): the whole job's worker count and this worker's rank
    #: in it, while ``num_workers`` and ``rank`` are its leaf segment's (what the switch checks). 0 and -1:
    #: the same as ``num_workers`` and ``rank`` (a job on one switch). Every worker quantizes for the whole job.
    job_workers: int = 0
    job_rank: int = -1
    #: Values per packet (``wire.WIDTHS``): 64 (narrow) or 256 (wide), the job's one width, chosen by the
    #: controller when the job was made (docs/protocol.md, "Wide packets"). A job setting like ``slot_count``:
    #: every worker sends packets of it (the switch refuses another width as WRONG_WIDTH); a fallback job's PS
    #: aggregates either. ``NETAGG_WIDTH`` in the environment.
    width: int = wire.K
    #: Deadline allreduce (docs/hoststack.md, "Deadline allreduce"), opt-in for the whole job: its gradient
    #: allreduces (``KVWorker.job_deadline``: the DDP hook's buckets) close their rounds this many milliseconds
    #: after a rank began the call, and a late rank's values join its next call's sum (error feedback). 0: exact.
    #: A job setting like ``slot_count``: every rank must use the same value. ``NETAGG_DEADLINE_MS`` (env).
    deadline_ms: float = 0.0
    #: The job's generation on the switch (its slots' owner tag), rendered by the controller; a move gives the
    #: job a new one with its new slots.
    generation: int = 0
    #: The controller's endpoint for the job's workers (``controller.worker_address``): where a worker learns
    #: that the controller moves the job's slots, and agrees with the others on the exchange they switch at
    #: (hoststack/moves.py, docs/controller.md "Fair shares that move"). None: the job's slots never move.
    controller: Endpoint | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if not 1 <= self.num_workers <= wire.MAX_WORKERS:
            raise ConfigError(f"num_workers: {self.num_workers} not in 1..{wire.MAX_WORKERS}")
        if not 0 <= self.rank < self.num_workers:
            raise ConfigError(f"rank: {self.rank} not in 0..{self.num_workers - 1}")
        if not 0 < self.job_id < 2**16:
            raise ConfigError(f"job_id: {self.job_id} not in 1..65535")
        if self.slot_count < 1 and self.mode != "fallback":
            raise ConfigError(f"slot_count: {self.slot_count} must be >= 1 outside fallback mode")
        if self.mode in ("ps", "fallback") and self.ps is None:
            raise ConfigError(f"ps: mode {self.mode} needs the parameter server's endpoint")
        check_width(self.width)
        self._check_mlfabric()

    def _check_mlfabric(self) -> None:
        if self.update_mode not in UPDATE_MODES:
            raise ConfigError(f"update_mode: {self.update_mode!r} is not one of {', '.join(UPDATE_MODES)}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule: {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.delay_bound is not None:
            if not isinstance(self.delay_bound, int) or isinstance(self.delay_bound, bool) or self.delay_bound < 0:
                raise ConfigError(f"delay_bound: expected an integer >= 0, got {self.delay_bound!r}")
            if self.update_mode != "async":
                raise ConfigError("delay_bound: only an async job has a delay bound")
        if self.schedule != "fifo" and self.update_mode != "async":
            raise ConfigError(f"schedule: {self.schedule} needs update_mode async")
        if not isinstance(self.switch_aggregation, bool):
            raise ConfigError(f"switch_aggregation: expected true or false, got {self.switch_aggregation!r}")
        if self.switch_aggregation and (self.schedule != "mlfabric" or self.mode != "allreduce"):
            raise ConfigError("switch_aggregation: needs schedule mlfabric and mode allreduce (the sums go back "
                              "to the group's members)")
        if not isinstance(self.senders, int) or isinstance(self.senders, bool) or \
                not 0 <= self.senders < self.num_workers:
            raise ConfigError(f"senders: expected an integer in 0..{self.num_workers - 1}, got {self.senders!r}")
        if self.senders and self.mode != "allreduce":
            raise ConfigError("senders: a one-way job needs mode allreduce")
        if not isinstance(self.replicas, tuple) or not all(isinstance(r, Endpoint) for r in self.replicas):
            raise ConfigError(f"replicas: expected a tuple of endpoints, got {self.replicas!r}")
        if not isinstance(self.secret, str) or any(c.isspace() for c in self.secret) or len(self.secret) > 256:
            raise ConfigError("secret: expected a string of at most 256 characters without whitespace")
        if isinstance(self.failover_after, bool) or not isinstance(self.failover_after, int | float) \
                or not 0 <= self.failover_after < 86400:
            raise ConfigError(f"failover_after: expected seconds in [0, 86400), got {self.failover_after!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or not 1 <= self.threads <= 64:
            raise ConfigError(f"threads: expected an integer in 1..64, got {self.threads!r}")
        if self.threads > 1 and (self.mode != "allreduce" or self.senders or self.switch_aggregation):
            raise ConfigError("threads: more than one sender/receiver thread needs mode allreduce (not one-way, "
                              "not MLfabric's switch aggregation)")
        if (self.update_mode == "async" or self.replicas) and self.ps is None:
            raise ConfigError("ps: an async or replicated job needs the parameter server's endpoint")
        if isinstance(self.ps_members, bool) or not isinstance(self.ps_members, int) or \
                not 0 <= self.ps_members < self.num_workers:
            raise ConfigError(f"ps_members: expected an integer in 0..{self.num_workers - 1}, got {self.ps_members!r}")
        if self.ps_members and not self.switch_aggregation:
            raise ConfigError("ps_members: the PS is a member of the job's switch groups only with switch_aggregation")
        for key in ("job_workers", "job_rank"):
            if isinstance(getattr(self, key), bool) or not isinstance(getattr(self, key), int):
                raise ConfigError(f"{key}: expected an integer, got {getattr(self, key)!r}")
        if self.job_workers or self.job_rank != -1:
            if not self.num_workers <= self.job_workers <= wire.MAX_JOB_WORKERS:
                raise ConfigError(f"job_workers: {self.job_workers} not in {self.num_workers}..{wire.MAX_JOB_WORKERS} "
                                  "(the whole job's workers, at least its segment's num_workers)")
            if not 0 <= self.job_rank < self.job_workers:
                raise ConfigError(f"job_rank: {self.job_rank} not in 0..{self.job_workers - 1}")
            if self.mode != "allreduce" or self.update_mode != "sync" or self.senders or self.ps_members:
                raise ConfigError("job_workers: a job over a tree of switches is a plain allreduce job (mode "
                                  "allreduce, sync, every rank both sends and receives)")
        check_deadline_ms(self.deadline_ms)
        if self.deadline_ms and (self.mode not in ("allreduce", "fallback") or self.threads > 1 or self.senders
                                 or self.switch_aggregation or self.job_workers
                                 or (self.mode == "fallback" and not self.secret)):
            raise ConfigError("deadline_ms: a deadline allreduce needs a plain allreduce job on one switch (mode "
                              "allreduce), or one admitted at its PS (mode fallback, with the job's secret: every "
                              "rank registers there), threads 1, every rank both sending and receiving, not "
                              "MLfabric's switch aggregation")
        if self.ps_members and self.ps_members != 1 + len(self.replicas):
            raise ConfigError(f"ps_members: {self.ps_members}, but the job's PS chain has {1 + len(self.replicas)} "
                              "node(s) (the primary and its replicas)")

    @property
    def total_workers(self) -> int:
        """The whole job's workers (``job_workers`` over a tree of switches): what values are quantized for."""
        return self.job_workers or self.num_workers

    @property
    def global_rank(self) -> int:
        """This worker's rank in the whole job (``job_rank`` over a tree of switches)."""
        return self.job_rank if self.job_rank >= 0 else self.rank

    @property
    def training_workers(self) -> int:
        """The job's workers: its ranks but the PS chain's (``ps_members``)."""
        return self.num_workers - self.ps_members

    def __repr__(self) -> str:  # never print the secret into a log or a traceback
        fields = ", ".join(f"{name}={'<hidden>' if name == 'secret' and self.secret else repr(getattr(self, name))}"
                           for name in self.__dataclass_fields__)
        return f"WorkerConfig({fields})"

    def to_yaml(self) -> str:
        data = asdict(self)
        data["replicas"] = list(data["replicas"])
        return yaml.safe_dump(data, sort_keys=False)

    def save(self, path: Path) -> None:
        """Write the YAML, readable by the owner only (it holds the job's secret)."""
        write_private(path, self.to_yaml())

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> WorkerConfig:
        known = {f for f in cls.__dataclass_fields__}
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping at the top level")
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}")
        try:
            values = dict(data)
            for key in ("aggregator", "bind", "ps", "controller"):
                if values.get(key) is not None:
                    values[key] = _endpoint(values[key], f"{source}: {key}")
            if "replicas" in values:
                replicas = values["replicas"] or []
                if not isinstance(replicas, list | tuple):
                    raise ConfigError(f"{source}: replicas: expected a list of {{host, port}}, got {replicas!r}")
                values["replicas"] = tuple(_endpoint(r, f"{source}: replicas[{i}]") for i, r in enumerate(replicas))
            for key in ("job_id", "rank", "num_workers", "slot_count"):
                if not isinstance(values.get(key), int) or isinstance(values.get(key), bool):
                    raise ConfigError(f"{source}: {key}: expected an integer, got {values.get(key)!r}")
            return cls(**values)
        except ConfigError as err:
            message = str(err)
            raise ConfigError(message if message.startswith(source) else f"{source}: {message}") from None
        except TypeError as err:
            raise ConfigError(f"{source}: {err}") from None

    @classmethod
    def load(cls, path: Path | str) -> WorkerConfig:
        return cls.from_dict(read_yaml(path), str(path))


#: The largest deadline a job may set (ms): a minute; a collective late by more is a failure, not a straggler.
MAX_DEADLINE_MS = 60_000.0


def check_deadline_ms(value: object, key: str = "deadline_ms") -> float:
    """``value`` if it is a deadline in milliseconds (0: none, else in (0, MAX_DEADLINE_MS]); ConfigError naming
    ``key`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_DEADLINE_MS \
            or value != value:
        raise ConfigError(f"{key}: expected milliseconds in [0, {MAX_DEADLINE_MS:.0f}] (0: exact), got {value!r}")
    return float(value)


def check_width(width: object, key: str = "width") -> int:
    """``width`` if it is a width the protocol defines (``wire.WIDTHS``: 64 or 256); ConfigError naming ``key``
    otherwise."""
    if isinstance(width, bool) or not isinstance(width, int) or width not in wire.WIDTH_CODES:
        raise ConfigError(f"{key}: expected values per packet, one of "
                          f"{', '.join(str(k) for k in sorted(wire.WIDTH_CODES))}, got {width!r}")
    return width


def parse_width(text: str, key: str = "NETAGG_WIDTH") -> int:
    """A width from text (an environment variable): ``64`` or ``256``; ConfigError naming ``key`` otherwise."""
    try:
        value = int(text.strip())
    except ValueError:
        raise ConfigError(f"{key}: expected values per packet, one of "
                          f"{', '.join(str(k) for k in sorted(wire.WIDTH_CODES))}, got {text!r}") from None
    return check_width(value, key)


def resolve(endpoint: Endpoint) -> tuple[str, int]:
    """``(dotted IPv4, port)`` as ``recvfrom`` reports senders; raises ConfigError if unresolvable."""
    try:
        return (socket.gethostbyname(endpoint.host), endpoint.port)
    except OSError as err:
        raise ConfigError(f"cannot resolve {endpoint.host!r}: {err}") from None


def write_private(path: Path | str, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600 (a worker config holds the job's secret)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its old mode through O_CREAT
    with os.fdopen(fd, "w") as out:
        out.write(text)


def read_yaml(path: Path | str) -> object:
    """Parse a YAML file; a missing file or bad syntax is a ConfigError naming the file."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None


def _endpoint(value: object, where: str) -> Endpoint:
    if not isinstance(value, dict) or set(value) != {"host", "port"}:
        raise ConfigError(f"{where}: expected {{host: ..., port: ...}}, got {value!r}")
    host, port = value["host"], value["port"]
    if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"{where}: host must be a string and port in 1..65535, got {value!r}")
    return Endpoint(host, port)
