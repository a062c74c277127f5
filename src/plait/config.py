"""The one reader of plait's configuration (``PLAIT_*`` environment variables).

Nothing else in plait reads ``os.environ`` for settings, and plait never writes it.
``Config.from_env()`` returns a frozen, typed snapshot; ``plait config`` prints it with
each variable's documentation.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

DEFAULT_TIMEOUT_S = 600.0

_UNITS = {"": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """Parse ``64K``, ``1M``, ``4096`` or ``2GiB`` into a byte count."""
    t = text.strip().upper().replace(" ", "")
    num = t.rstrip("KMGIB")
    unit = t[len(num):]
    if not num or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r}: expected a number with an optional K, M or G")
    value = float(num) * _UNITS[unit]
    if value < 0:
        raise ValueError(f"invalid size {text!r}: negative")
    return int(value)


def to_seconds(timeout: float | int | datetime.timedelta | None, default: float) -> float:
    """Normalise a timeout given as seconds or a ``timedelta``; ``None`` gives ``default``."""
    if timeout is None:
        return default
    if isinstance(timeout, datetime.timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise TypeError(f"timeout must be seconds or a datetime.timedelta, not {type(timeout)}")
    if value <= 0:
        raise ValueError(f"timeout must be positive, got {value}")
    return value


@dataclass(frozen=True)
class Config:
    """plait's settings. Each field is read from ``PLAIT_<FIELD NAME IN CAPITALS>``."""

    timeout: float = DEFAULT_TIMEOUT_S
    """Default deadline of every operation, in seconds."""
    transport: str = "auto"
    """``auto``: shared memory within a host, TCP between hosts; ``tcp``: TCP for every pair."""
    host_id: str | None = None
    """Overrides the host identity (ranks with equal ids use shared memory)."""
    algo: str = ""
    """Algorithm overrides, e.g. ``allreduce:0-64K:direct,64K-:ring;broadcast:chain``."""
    shm_slot_size: int = 64 << 10
    """Bytes per rank in the shared-memory slot used by direct (small-message) algorithms."""
    shm_chunk_size: int = 256 << 10
    """Bytes per chunk of a shared-memory pair ring."""
    shm_ring_chunks: int = 8
    """Chunks per shared-memory pair ring."""
    cma_min_size: int = 256 << 10
    """Shared-memory messages of at least this many bytes are read straight from the
    sender's memory (process_vm_readv: one copy instead of two); 0 turns this off."""
    tcp_chunk_size: int = 1 << 20
    """Largest TCP frame payload; large messages are cut into frames of this size."""
    spin_us: float = -1.0
    """Microseconds to spin before blocking; negative picks by cores and local ranks."""
    socket_ifname: str = ""
    """Comma-separated network interfaces for TCP (as NCCL_SOCKET_IFNAME)."""
    topo_file: str = ""
    """Topology file (JSON or TOML): hosts, rails, switches, link classes (docs/TOPOLOGY.md)."""
    nsocks: int = 4
    """TCP sockets per peer connection; large messages are striped over them dynamically."""
    secret: str = ""
    """Per-job secret for connection authentication (else generated and shared by the store)."""
    secret_file: str = ""
    """A file holding the per-job secret."""
    debug: str = ""
    """``check``: compare op, dtype, count, root and reduce op across ranks before collectives."""
    log_level: str = ""
    """Log level of the ``plait`` logger (DEBUG shows every algorithm decision)."""
    flight_recorder_entries: int = 1024
    """Collectives kept per communicator by the flight recorder (rounded up to a power of 2)."""
    flight_recorder_dir: str = ""
    """Directory where a rank writes its flight record (JSON) on a timeout or a failure."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get("PLAIT_" + f.name.upper())
            if raw is None or raw == "":
                continue
            default = f.default
            try:
                if f.name == "timeout":
                    values[f.name] = to_seconds(float(raw), DEFAULT_TIMEOUT_S)
                elif f.name.endswith("_size"):
                    values[f.name] = parse_size(raw)
                elif isinstance(default, bool):
                    values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
                elif isinstance(default, int):
                    values[f.name] = int(raw)
                elif isinstance(default, float):
                    values[f.name] = float(raw)
                else:
                    values[f.name] = raw.strip()
            except ValueError as exc:
                raise ValueError(f"PLAIT_{f.name.upper()}={raw!r}: {exc}") from None
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.transport not in ("auto", "tcp"):
            raise ValueError(f"PLAIT_TRANSPORT={self.transport!r}: expected auto or tcp")
        for name in ("shm_slot_size", "shm_chunk_size", "tcp_chunk_size"):
            v = getattr(self, name)
            if v < 64 or v % 64:
                raise ValueError(f"PLAIT_{name.upper()}={v}: must be a multiple of 64, at least 64")
        if not 1 <= self.nsocks <= 64:
            raise ValueError(f"PLAIT_NSOCKS={self.nsocks}: expected 1 to 64")
        if self.shm_ring_chunks < 2:
            raise ValueError(f"PLAIT_SHM_RING_CHUNKS={self.shm_ring_chunks}: at least 2")
        if self.debug not in ("", "check"):
            raise ValueError(f"PLAIT_DEBUG={self.debug!r}: expected 'check' or nothing")

    def describe(self) -> list[tuple[str, str, str]]:
        """(variable, value, documentation) for every setting."""
        import inspect

        src = inspect.getsource(type(self))
        docs: dict[str, str] = {}
        lines = src.splitlines()
        for i, line in enumerate(lines[:-1]):
            s = line.strip()
            if ":" in s and "=" in s and not s.startswith(("def", "@", '"')):
                name = s.split(":")[0].strip()
                nxt = lines[i + 1].strip()
                if nxt.startswith('"""'):
                    docs[name] = nxt.strip('"')
        return [("PLAIT_" + f.name.upper(), repr(getattr(self, f.name)), docs.get(f.name, ""))
                for f in fields(self)]
