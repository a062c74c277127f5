"""plait's configuration: one declaration per setting, and the one reader of ``PLAIT_*``.

Every setting is a field of :class:`Config` declared with :func:`setting` (default,
documentation, parser, check, whether ranks must agree on it); its name and type come from
the field itself, and ``SETTINGS``, ``describe()``, ``agreement()`` and ``plait config`` are
all generated from those declarations.

A user builds ``Config(timeout=5.0, algo="allreduce:ring")`` with any subset of fields; the
fields given are *set*, the others read their defaults but stay *unset*.
``Config.resolve(explicit, env)`` fills every unset field from ``PLAIT_<NAME>`` or else the
default, and validates. Nothing else in plait reads ``os.environ`` for settings, and plait
never writes it.
"""

from __future__ import annotations

import datetime
import logging
import numbers
import os
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin, get_type_hints

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SETTINGS",
    "Config",
    "Setting",
    "apply_log_level",
    "disagreement",
    "parse_size",
    "resolve",
    "setting",
    "to_seconds",
]

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


# ------------------------------------------------------------------ declaring a setting

Source = Literal["explicit", "env", "default"]


class _Unset:
    """The dataclass default of every field: tells "not given" from "given the default"."""

    def __repr__(self) -> str:
        return "<unset>"


# Typed Any so that ``timeout: float = setting(...)`` type-checks with this as its default.
_UNSET: Any = _Unset()
_META = "plait.setting"


@dataclass(frozen=True)
class Setting:
    """One setting. Declared once, as a :class:`Config` field via :func:`setting`; ``name``
    and ``type`` are filled in from that field (see ``SETTINGS``)."""

    default: Any
    doc: str
    # Ranks of one communicator must have equal values (exchanged and compared at init).
    agree: bool
    # Text of PLAIT_<NAME> (or a str given to Config) -> value; None: by the declared type.
    parse: Callable[[str], Any] | None = None
    # Raises ValueError(message) when a value of the declared type is not allowed.
    check: Callable[[Any], object] | None = None
    # A non-str value given to Config -> value; None: must already be of the declared type.
    coerce: Callable[[Any], Any] | None = None
    # The value is not printed by describe() / ``plait config``.
    sensitive: bool = False
    name: str = ""
    type: Any = object

    @property
    def env(self) -> str:
        """The environment variable, ``PLAIT_<NAME IN CAPITALS>``."""
        return "PLAIT_" + self.name.upper()

    def from_env(self, raw: str) -> Any:
        """The value of ``PLAIT_<NAME>=raw``; errors name the variable."""
        try:
            value = self._parse(raw)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{self.env}={raw!r}: {exc}") from None
        self.validate(value)
        return value

    def from_user(self, value: object) -> Any:
        """The value of ``Config(<name>=value)``; errors name ``Config(<name>=...)``.
        A str is parsed as the variable's text would be (``"64K"``, ``"debug"``)."""
        try:
            if isinstance(value, str):
                out = self._parse(value)
            elif self.coerce is not None:
                out = self.coerce(value)
            else:
                out = _of_type(value, self.type)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{self.where(value, explicit=True)}: {exc}") from None
        self.validate(out, explicit=True)
        return out

    def validate(self, value: Any, *, explicit: bool = False) -> None:
        """Raise ``ValueError("PLAIT_<NAME>=<value>: <why>")`` (``Config(<name>=<value>)``
        when ``explicit``) if ``value`` is not allowed."""
        if self.check is None:
            return
        try:
            self.check(value)
        except ValueError as exc:
            raise ValueError(f"{self.where(value, explicit=explicit)}: {exc}") from None

    def where(self, value: object, *, explicit: bool) -> str:
        """How an error names this setting and its offending value."""
        return f"Config({self.name}={value!r})" if explicit else f"{self.env}={value!r}"

    def _parse(self, raw: str) -> Any:
        if self.parse is not None:
            return self.parse(raw)
        base = _base_type(self.type)
        if base is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if base is int:
            return int(raw)
        if base is float:
            return float(raw)
        return raw.strip()


def setting(default: Any, doc: str, *, agree: bool,
            parse: Callable[[str], Any] | None = None,
            check: Callable[[Any], object] | None = None,
            coerce: Callable[[Any], Any] | None = None,
            sensitive: bool = False) -> Any:
    """Declare a :class:`Config` field as a setting (see :class:`Setting` for the arguments)."""
    spec = Setting(default=default, doc=doc, agree=agree, parse=parse, check=check,
                   coerce=coerce, sensitive=sensitive)
    return field(default=_UNSET, metadata={_META: spec})


def _base_type(tp: Any) -> Any:
    """``int`` for ``int``, ``str`` for ``str | None``."""
    if get_origin(tp) in (Union, types.UnionType):
        return next(a for a in get_args(tp) if a is not type(None))
    return tp


def _of_type(value: object, tp: Any) -> Any:
    """``value`` as the declared type ``tp`` (integers widen to float), else TypeError."""
    base = _base_type(tp)
    if value is None:
        if base is not tp:  # Optional
            return None
    elif isinstance(value, bool) or base is bool:  # bool is an int, but never means one
        if isinstance(value, bool) and base is bool:
            return value
    elif base is int and isinstance(value, numbers.Integral):
        return int(value)
    elif base is float and isinstance(value, numbers.Real):
        return float(value)
    elif isinstance(value, base):
        return value
    raise TypeError(f"expected {getattr(base, '__name__', base)}, not {type(value).__name__}")


# ------------------------------------------------------------------ parsers and checks


def _parse_timeout(raw: str) -> float:
    return to_seconds(float(raw), DEFAULT_TIMEOUT_S)


def _coerce_timeout(value: object) -> float:
    if value is None:  # None would silently mean the default while counting as set
        raise TypeError("timeout must be seconds or a datetime.timedelta, not None")
    return to_seconds(value, DEFAULT_TIMEOUT_S)  # type: ignore[arg-type]


def _check_transport(value: str) -> None:
    if value not in ("auto", "tcp"):
        raise ValueError("expected auto or tcp")


def _check_chunk(value: int) -> None:
    if value < 64 or value % 64:
        raise ValueError("must be a multiple of 64, at least 64")


def _check_non_negative(value: int) -> None:
    if value < 0:
        raise ValueError("must not be negative")


def _check_ring_chunks(value: int) -> None:
    if value < 2:
        raise ValueError("at least 2")


def _check_nsocks(value: int) -> None:
    if not 1 <= value <= 64:
        raise ValueError("expected 1 to 64")


def _check_debug(value: str) -> None:
    if value not in ("", "check"):
        raise ValueError("expected 'check' or nothing")


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _parse_log_level(raw: str) -> str:
    """``debug`` -> ``DEBUG``, ``" 10 "`` -> ``10``, ``""`` -> ``""`` (leave logging alone)."""
    text = raw.strip()
    if text.upper() in _LEVELS:
        return text.upper()
    if text.isdigit():
        return str(int(text))
    if text == "":
        return text
    raise ValueError(f"expected {', '.join(_LEVELS)} or a number")


def _coerce_log_level(value: object) -> str:
    # logging.DEBUG and friends are ints; accept them as well as their names.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    raise TypeError(f"expected a level name or a non-negative int, not {value!r}")


def _check_log_level(value: str) -> None:
    _parse_log_level(value)


# ------------------------------------------------------------------ the configuration


@dataclass(frozen=True, kw_only=True, repr=False)
class Config:
    """plait's settings. Each field is read from ``PLAIT_<FIELD NAME IN CAPITALS>``.

    ``Config(**some_fields)`` sets those fields (validated at once); every other field reads
    its default but stays unset, so :meth:`resolve` fills it from the environment. Equality
    compares values only.
    """

    timeout: float = setting(
        DEFAULT_TIMEOUT_S, "Default deadline of every operation, in seconds.", agree=False,
        parse=_parse_timeout, coerce=_coerce_timeout)
    transport: str = setting(
        "auto", "``auto``: shared memory within a host, TCP between hosts; ``tcp``: TCP for "
        "every pair.", agree=True, check=_check_transport)
    host_id: str | None = setting(
        None, "Overrides the host identity (ranks with equal ids use shared memory).",
        agree=False)
    algo: str = setting(
        "", "Algorithm overrides, e.g. ``allreduce:0-64K:direct,64K-:ring;broadcast:chain``.",
        agree=True)
    shm_slot_size: int = setting(
        64 << 10, "Bytes per rank in the shared-memory slot of the compiled engine's direct "
        "and slices algorithms; larger data moves through it in pieces of this size.",
        agree=True, parse=parse_size, check=_check_chunk)
    shm_chunk_size: int = setting(
        256 << 10, "Bytes per chunk of a shared-memory pair ring.", agree=True,
        parse=parse_size, check=_check_chunk)
    shm_ring_chunks: int = setting(
        8, "Chunks per shared-memory pair ring.", agree=True, check=_check_ring_chunks)
    cma_min_size: int = setting(
        256 << 10, "Shared-memory messages of at least this many bytes are read straight from "
        "the sender's memory (process_vm_readv: one copy instead of two); 0 turns this off, "
        "also for the engine's inplace algorithm (which then runs through the slots).",
        agree=True, parse=parse_size, check=_check_non_negative)
    tcp_chunk_size: int = setting(
        1 << 20, "Largest TCP frame payload; large messages are cut into frames of this size.",
        agree=True, parse=parse_size, check=_check_chunk)
    spin_us: float = setting(
        -1.0, "Microseconds to spin before blocking; negative picks by cores and local ranks.",
        agree=False)
    socket_ifname: str = setting(
        "", "Comma-separated network interfaces for TCP (as NCCL_SOCKET_IFNAME).", agree=False)
    topo_file: str = setting(
        "", "Topology file (JSON or TOML): hosts, rails, switches, link classes "
        "(docs/TOPOLOGY.md).", agree=False)
    nsocks: int = setting(
        4, "TCP sockets per peer connection; large messages are striped over them "
        "dynamically.", agree=True, check=_check_nsocks)
    secret: str = setting(
        "", "Per-job secret for connection authentication (else generated and shared by the "
        "store).", agree=False, sensitive=True)
    secret_file: str = setting("", "A file holding the per-job secret.", agree=False)
    debug: str = setting(
        "", "``check``: compare op, dtype, count, root and reduce op across ranks before "
        "collectives.", agree=True, check=_check_debug)
    log_level: str = setting(
        "", "Level of the ``plait`` logger: DEBUG, INFO, WARNING, ERROR, CRITICAL or a number "
        "(DEBUG shows every algorithm decision); empty leaves logging alone.", agree=False,
        parse=_parse_log_level, coerce=_coerce_log_level, check=_check_log_level)
    flight_recorder_entries: int = setting(
        1024, "Collectives kept per communicator by the flight recorder (rounded up to a "
        "power of 2).", agree=False)
    flight_recorder_dir: str = setting(
        "", "Directory where a rank writes its flight record (JSON) on a timeout or a "
        "failure.", agree=False)

    def __post_init__(self) -> None:
        sources: dict[str, Source] = {}
        for s in SETTINGS.values():
            value = getattr(self, s.name)
            if value is _UNSET:
                object.__setattr__(self, s.name, s.default)  # frozen: the one write
            else:
                object.__setattr__(self, s.name, s.from_user(value))
                sources[s.name] = "explicit"
        object.__setattr__(self, "_sources", sources)

    # ------------------------------------------------------------ building

    @classmethod
    def resolve(cls, explicit: Config | None = None,
                env: Mapping[str, str] | None = None) -> Config:
        """Every field: set in ``explicit``, else ``PLAIT_<NAME>`` (empty = absent), else the
        default. The result is resolved (every field set) and validated."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        sources: dict[str, Source] = {}
        for s in SETTINGS.values():
            given = None if explicit is None else explicit.source(s.name)
            raw = env.get(s.env)
            if explicit is not None and given is not None:
                values[s.name], sources[s.name] = getattr(explicit, s.name), given
            elif raw is not None and raw != "":
                values[s.name], sources[s.name] = s.from_env(raw), "env"
            else:
                values[s.name], sources[s.name] = s.default, "default"
        return cls._build(values, sources)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        """``Config.resolve(None, env)``: every setting from ``PLAIT_*`` or its default."""
        return cls.resolve(None, env)

    def derive(self, **overrides: Any) -> Config:
        """A child's configuration (split, sub-communicators): this one with ``overrides``
        set, validated. Resolved if this one is."""
        unknown = sorted(set(overrides) - set(SETTINGS))
        if unknown:
            raise TypeError(f"Config.derive() got unknown settings: {', '.join(unknown)}")
        values = {s.name: getattr(self, s.name) for s in SETTINGS.values()}
        sources = dict(self._sources)
        for name, value in overrides.items():
            values[name] = SETTINGS[name].from_user(value)
            sources[name] = "explicit"
        return self._build(values, sources)

    @classmethod
    def _build(cls, values: Mapping[str, Any], sources: Mapping[str, Source]) -> Config:
        """A Config of already parsed and validated ``values``, recording their ``sources``
        (a field without one stays unset)."""
        cfg = cls()
        for name, value in values.items():
            object.__setattr__(cfg, name, value)  # frozen: written once, before it is shared
        object.__setattr__(cfg, "_sources", dict(sources))
        return cfg

    # ------------------------------------------------------------ inspecting

    def is_set(self, name: str) -> bool:
        """Whether ``name`` was given (or resolved), so :meth:`resolve` keeps its value."""
        return name in self._sources

    def source(self, name: str) -> Source | None:
        """Where the value of ``name`` came from; None while it is unset."""
        if name not in SETTINGS:
            raise KeyError(name)
        return self._sources.get(name)

    @property
    def resolved(self) -> bool:
        """Every field is set (the result of :meth:`resolve`, :meth:`from_env`)."""
        return len(self._sources) == len(SETTINGS)

    def validate(self) -> None:
        """Check every value; errors name ``Config(<field>=...)`` for values a user gave,
        ``PLAIT_<NAME>`` otherwise."""
        for s in SETTINGS.values():
            s.validate(getattr(self, s.name), explicit=self._sources.get(s.name) == "explicit")

    def agreement(self) -> dict[str, str]:
        """The settings every rank of a communicator must agree on, as text, in declaration
        order: exchange at init and compare with :func:`disagreement`."""
        return {s.name: _as_text(getattr(self, s.name)) for s in SETTINGS.values() if s.agree}

    def describe(self) -> list[tuple[str, str, str]]:
        """(variable, value, documentation) for every setting."""
        return [(s.env, _shown(s, getattr(self, s.name)), s.doc) for s in SETTINGS.values()]

    def __repr__(self) -> str:
        shown = ", ".join(f"{s.name}={_shown(s, getattr(self, s.name))}"
                          for s in SETTINGS.values() if s.name in self._sources)
        return f"Config({shown})"

    if TYPE_CHECKING:
        # Not a dataclass field (fields are exactly the settings): field name -> where its
        # value came from, for the fields that are set. Written by __post_init__ / _build.
        _sources: Mapping[str, Source]


def _shown(s: Setting, value: Any) -> str:
    if s.sensitive and value:
        return "'<hidden>'"
    return repr(value)


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def _settings() -> dict[str, Setting]:
    hints = get_type_hints(Config)
    return {f.name: replace(f.metadata[_META], name=f.name, type=hints[f.name])
            for f in fields(Config) if _META in f.metadata}


SETTINGS: Mapping[str, Setting] = types.MappingProxyType(_settings())
"""Every setting, by field name, in declaration order."""

resolve = Config.resolve


def disagreement(mine: Mapping[str, str], theirs: Mapping[str, str]) -> str | None:
    """The first setting (in ``mine``'s order) whose value differs between two
    :meth:`Config.agreement` results, a setting only one of them has included; else None."""
    for name, value in mine.items():
        if name not in theirs or theirs[name] != value:
            return name
    return next((name for name in theirs if name not in mine), None)


# ------------------------------------------------------------------ logging

_HANDLER_NAME = "plait.stderr"


def apply_log_level(cfg: Config) -> int | None:
    """Set the ``plait`` logger's level from ``cfg.log_level`` and return it; empty leaves
    logging alone (None). When no handler would show the records (none on ``plait`` or its
    ancestors), add a stderr handler, so that e.g. DEBUG decisions become visible."""
    text = _parse_log_level(cfg.log_level)
    if not text:
        return None
    level = int(text) if text.isdigit() else logging.getLevelName(text)
    logger = logging.getLogger("plait")
    logger.setLevel(level)
    # hasHandlers() looks at ancestors too: with the application's own logging set up
    # (e.g. basicConfig on the root), records already reach a handler; another would
    # print every line twice.
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(process)d %(name)s %(levelname)s: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    return level
