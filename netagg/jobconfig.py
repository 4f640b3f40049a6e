"""What one worker of a job needs to know: written by the controller, read by the host stack.

``netagg job config JOB --rank R`` writes this as YAML; ``hoststack`` loads it (or
builds it from ``DMLC_*``/``NETAGG_*`` environment variables).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from netagg import wire

MODES = ("allreduce", "ps", "fallback")


class ConfigError(ValueError):
    """A configuration file or value is wrong; the message names the file, key and problem."""


@dataclass(frozen=True)
class Endpoint:
    """An IPv4 address and UDP port."""

    host: str
    port: int

    def as_tuple(self) -> tuple[str, int]:
        return (self.host, self.port)


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

    def to_yaml(self) -> str:
        return yaml.safe_dump(asdict(self), sort_keys=False)

    def save(self, path: Path) -> None:
        Path(path).write_text(self.to_yaml())

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
            for key in ("aggregator", "bind", "ps"):
                if values.get(key) is not None:
                    values[key] = _endpoint(values[key], f"{source}: {key}")
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
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as err:
            raise ConfigError(f"{path}: cannot read: {err.strerror}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        return cls.from_dict(data, str(path))


def _endpoint(value: object, where: str) -> Endpoint:
    if not isinstance(value, dict) or set(value) != {"host", "port"}:
        raise ConfigError(f"{where}: expected {{host: ..., port: ...}}, got {value!r}")
    host, port = value["host"], value["port"]
    if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"{where}: host must be a string and port in 1..65535, got {value!r}")
    return Endpoint(host, port)
