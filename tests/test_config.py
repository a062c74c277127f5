"""plait.config: the one reader of PLAIT_* variables (pure, no processes), and that the
settings reach a communicator at init."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import pickle
from collections.abc import Iterator
from typing import Any

import pytest

from plait.config import (
    DEFAULT_TIMEOUT_S,
    SETTINGS,
    Config,
    apply_log_level,
    disagreement,
    parse_size,
    resolve,
    to_seconds,
)


def test_defaults() -> None:
    cfg = Config.from_env({})
    assert cfg == Config()
    assert cfg.timeout == DEFAULT_TIMEOUT_S == 600.0
    assert cfg.transport == "auto"
    assert cfg.host_id is None
    assert cfg.shm_slot_size == 64 << 10
    assert cfg.shm_chunk_size == 256 << 10
    assert cfg.shm_ring_chunks == 8
    assert cfg.tcp_chunk_size == 1 << 20


def test_reads_every_variable() -> None:
    env = {"PLAIT_TIMEOUT": "2.5", "PLAIT_TRANSPORT": "tcp", "PLAIT_HOST_ID": "hostA",
           "PLAIT_ALGO": "allreduce:ring", "PLAIT_SHM_SLOT_SIZE": "1K",
           "PLAIT_SHM_CHUNK_SIZE": "4KiB", "PLAIT_SHM_RING_CHUNKS": "4",
           "PLAIT_TCP_CHUNK_SIZE": "1M", "PLAIT_SPIN_US": "0", "PLAIT_DEBUG": "check",
           "UNRELATED": "x", "PLAIT_SOCKET_IFNAME": "lo"}
    cfg = Config.from_env(env)
    assert cfg.timeout == 2.5 and cfg.transport == "tcp" and cfg.host_id == "hostA"
    assert cfg.algo == "allreduce:ring"
    assert (cfg.shm_slot_size, cfg.shm_chunk_size, cfg.shm_ring_chunks, cfg.tcp_chunk_size) \
        == (1024, 4096, 4, 1 << 20)
    assert cfg.spin_us == 0.0 and cfg.debug == "check" and cfg.socket_ifname == "lo"


def test_empty_values_mean_default() -> None:
    assert Config.from_env({"PLAIT_TRANSPORT": "", "PLAIT_TIMEOUT": ""}) == Config()


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().timeout = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(("var", "value", "match"), [
    ("PLAIT_TRANSPORT", "udp", "PLAIT_TRANSPORT"),
    ("PLAIT_SHM_SLOT_SIZE", "100", "PLAIT_SHM_SLOT_SIZE"),  # not a multiple of 64
    ("PLAIT_SHM_CHUNK_SIZE", "32", "PLAIT_SHM_CHUNK_SIZE"),  # below 64
    ("PLAIT_TCP_CHUNK_SIZE", "lots", "PLAIT_TCP_CHUNK_SIZE"),
    ("PLAIT_SHM_RING_CHUNKS", "1", "PLAIT_SHM_RING_CHUNKS"),
    ("PLAIT_SHM_RING_CHUNKS", "four", "PLAIT_SHM_RING_CHUNKS"),
    ("PLAIT_TIMEOUT", "-1", "PLAIT_TIMEOUT"),
    ("PLAIT_TIMEOUT", "soon", "PLAIT_TIMEOUT"),
    ("PLAIT_DEBUG", "verbose", "PLAIT_DEBUG"),
])
def test_invalid_values_name_the_variable(var: str, value: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Config.from_env({var: value})


@pytest.mark.parametrize(("text", "value"), [
    ("4096", 4096), ("64K", 65536), ("64k", 65536), ("64KB", 65536), ("64KiB", 65536),
    ("1M", 1 << 20), ("2MiB", 2 << 20), ("1G", 1 << 30), (" 8 K ", 8192), ("1.5K", 1536),
])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "K", "12X", "-4K", "1KK"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_to_seconds() -> None:
    assert to_seconds(None, 7.0) == 7.0
    assert to_seconds(3, 7.0) == 3.0
    assert to_seconds(0.25, 7.0) == 0.25
    assert to_seconds(datetime.timedelta(minutes=2), 7.0) == 120.0
    for bad in (0, -1, datetime.timedelta(0)):
        with pytest.raises(ValueError):
            to_seconds(bad, 7.0)
    for bad in ("10", True, [1]):
        with pytest.raises(TypeError):
            to_seconds(bad, 7.0)  # type: ignore[arg-type]


def test_describe_documents_every_setting() -> None:
    rows = Config().describe()
    names = [f.name for f in dataclasses.fields(Config)]
    assert [r[0] for r in rows] == ["PLAIT_" + n.upper() for n in names]
    for var, _value, doc in rows:
        assert doc, f"{var} has no documentation"


def test_cli_prints_settings(capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.cli.main import main

    monkeypatch.setenv("PLAIT_SHM_SLOT_SIZE", "2K")
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "PLAIT_SHM_SLOT_SIZE" in out and "2048" in out and "PLAIT_TRANSPORT" in out


def test_algo_grammar_errors_name_the_problem() -> None:
    from plait.tuning.selector import parse

    assert parse("allreduce:0-64K:direct,64K-:ring;broadcast:chain")["allreduce"][1].lo == 65536
    with pytest.raises(ValueError, match="nosuch"):
        parse("allreduce:nosuch")
    with pytest.raises(ValueError, match="frobnicate"):
        parse("frobnicate:ring")


# ---------------------------------------------------------- Config as an object


@pytest.mark.parametrize(("field", "explicit", "env", "from_env", "default"), [
    ("timeout", 5.0, "2.5", 2.5, DEFAULT_TIMEOUT_S),  # float, via to_seconds
    ("nsocks", 2, "8", 8, 4),  # int
    ("shm_slot_size", 128, "2K", 2048, 64 << 10),  # size with a suffix
    ("transport", "tcp", "tcp", "tcp", "auto"),  # str with a fixed set of values
    ("host_id", "given", "fromenv", "fromenv", None),  # optional str
    ("log_level", "INFO", "debug", "DEBUG", ""),  # normalised level name
])
def test_explicit_wins_over_env_wins_over_default(field: str, explicit: Any, env: str,
                                                  from_env: Any, default: Any) -> None:
    var = SETTINGS[field].env
    assert getattr(Config.resolve(Config(**{field: explicit}), {var: env}), field) == explicit
    assert getattr(Config.resolve(None, {var: env}), field) == from_env
    assert getattr(Config.resolve(Config(), {var: env}), field) == from_env
    assert getattr(Config.resolve(Config(), {}), field) == default
    assert getattr(resolve(None, {var: ""}), field) == default  # empty means absent


def test_explicit_default_value_still_wins() -> None:
    """Giving a field its default is not the same as leaving it unset."""
    env = {"PLAIT_TRANSPORT": "tcp", "PLAIT_ALGO": "allreduce:ring", "PLAIT_HOST_ID": "h"}
    cfg = Config.resolve(Config(transport="auto", algo="", host_id=None), env)
    assert (cfg.transport, cfg.algo, cfg.host_id) == ("auto", "", None)


def test_unset_fields_read_their_defaults() -> None:
    cfg = Config(timeout=5, algo="allreduce:ring")
    assert cfg.timeout == 5.0 and isinstance(cfg.timeout, float)
    assert cfg.nsocks == 4 and cfg.transport == "auto" and cfg.host_id is None
    assert cfg.is_set("timeout") and cfg.is_set("algo") and not cfg.is_set("nsocks")
    assert (cfg.source("timeout"), cfg.source("nsocks")) == ("explicit", None)
    assert not cfg.resolved and not Config().resolved
    assert repr(cfg) == "Config(timeout=5.0, algo='allreduce:ring')"
    with pytest.raises(TypeError):
        Config(5.0)  # type: ignore[misc]  # keyword-only: the order of fields is no API


def test_resolved_config_records_where_values_came_from() -> None:
    cfg = Config.resolve(Config(algo="allreduce:ring"), {"PLAIT_NSOCKS": "2"})
    assert cfg.resolved and all(cfg.is_set(name) for name in SETTINGS)
    assert (cfg.source("algo"), cfg.source("nsocks"), cfg.source("timeout")) \
        == ("explicit", "env", "default")
    # A resolved configuration is complete: resolving it again ignores the environment.
    assert Config.resolve(cfg, {"PLAIT_NSOCKS": "16", "PLAIT_TIMEOUT": "1"}) == cfg
    with pytest.raises(KeyError):
        cfg.source("nosuch")


def test_from_env_means_resolve_without_explicit() -> None:
    env = {"PLAIT_TIMEOUT": "3", "PLAIT_SHM_CHUNK_SIZE": "4K", "PLAIT_DEBUG": "check"}
    assert Config.from_env(env) == Config.resolve(None, env) == Config.resolve(Config(), env)


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_NSOCKS", "3")
    assert Config.from_env().nsocks == 3 == Config.resolve().nsocks


def test_explicit_values_are_converted_like_the_variables() -> None:
    cfg = Config(shm_slot_size="1K", timeout=datetime.timedelta(seconds=90), spin_us=5,
                 log_level=logging.WARNING, algo=" allreduce:ring ")
    assert cfg.shm_slot_size == 1024 and cfg.timeout == 90.0
    assert cfg.spin_us == 5.0 and isinstance(cfg.spin_us, float)
    assert cfg.log_level == "30" and cfg.algo == "allreduce:ring"


@pytest.mark.parametrize(("field", "value", "match"), [
    ("transport", "udp", "expected auto or tcp"),
    ("shm_slot_size", 100, "multiple of 64"),
    ("tcp_chunk_size", "lots", "float"),
    ("shm_ring_chunks", 1, "at least 2"),
    ("nsocks", 65, "expected 1 to 64"),
    ("nsocks", 2.5, "expected int"),
    ("nsocks", True, "expected int"),
    ("timeout", -1, "positive"),
    ("timeout", "soon", "float"),
    ("timeout", None, "not None"),
    ("debug", "verbose", "expected 'check' or nothing"),
    ("log_level", "loud", "DEBUG, INFO"),
    ("cma_min_size", -1, "negative"),
    ("host_id", 3, "expected str"),
])
def test_invalid_explicit_values_name_the_field(field: str, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=rf"Config\({field}=.*{match}"):
        Config(**{field: value})
    with pytest.raises(ValueError, match=rf"Config\({field}=.*{match}"):
        Config().derive(**{field: value})


def test_unknown_field_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        Config(nosuch=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="nosuch"):
        Config().derive(nosuch=1)


def test_invalid_log_level_fails_at_resolve() -> None:
    with pytest.raises(ValueError, match="PLAIT_LOG_LEVEL"):
        Config.from_env({"PLAIT_LOG_LEVEL": "chatty"})
    for text, value in (("debug", "DEBUG"), ("Warning", "WARNING"), ("15", "15"), ("", "")):
        assert Config.from_env({"PLAIT_LOG_LEVEL": text}).log_level == value


def test_derive() -> None:
    parent = Config.resolve(None, {"PLAIT_NSOCKS": "2", "PLAIT_ALGO": "allreduce:ring"})
    child = parent.derive(algo="allreduce:direct", shm_slot_size="2K")
    assert child.algo == "allreduce:direct" and child.shm_slot_size == 2048
    assert child.nsocks == 2 and child.timeout == parent.timeout
    assert child.resolved and child.source("algo") == "explicit"
    assert child.source("nsocks") == "env"
    assert parent.algo == "allreduce:ring"  # the parent is untouched
    assert parent.derive() == parent
    # Deriving from a partial configuration keeps the rest unset for resolve to fill in.
    partial = Config(timeout=3.0).derive(nsocks=8)
    assert (partial.is_set("timeout"), partial.is_set("nsocks"), partial.is_set("algo")) \
        == (True, True, False)
    assert Config.resolve(partial, {"PLAIT_ALGO": "broadcast:chain"}).algo == "broadcast:chain"


def test_agreement() -> None:
    agree = Config.from_env({}).agreement()
    must = {"transport", "algo", "shm_slot_size", "shm_chunk_size", "shm_ring_chunks",
            "cma_min_size", "tcp_chunk_size", "nsocks", "debug"}
    need_not = {"timeout", "host_id", "log_level", "flight_recorder_entries",
                "flight_recorder_dir", "secret", "secret_file", "socket_ifname", "spin_us",
                "topo_file"}
    assert must <= set(agree) and not need_not & set(agree)
    assert set(agree) == {name for name, s in SETTINGS.items() if s.agree}
    assert all(isinstance(v, str) for v in agree.values())
    assert agree["transport"] == "auto" and agree["shm_slot_size"] == str(64 << 10)
    # Settings that need not agree do not change it.
    other = Config.from_env({"PLAIT_TIMEOUT": "1", "PLAIT_HOST_ID": "b", "PLAIT_SPIN_US": "0"})
    assert other.agreement() == agree


def test_disagreement_names_the_first_differing_setting() -> None:
    mine = Config.from_env({}).agreement()
    assert disagreement(mine, dict(mine)) is None
    theirs = Config.from_env({"PLAIT_NSOCKS": "2", "PLAIT_ALGO": "allreduce:ring"}).agreement()
    assert disagreement(mine, theirs) == "algo"  # declared before nsocks
    assert disagreement(theirs, mine) == "algo"
    assert disagreement(mine, {k: v for k, v in mine.items() if k != "debug"}) == "debug"
    assert disagreement(mine, {**mine, "newer": "1"}) == "newer"


def test_settings_are_declared_once_per_field() -> None:
    names = [f.name for f in dataclasses.fields(Config)]
    assert list(SETTINGS) == names
    for name, s in SETTINGS.items():
        assert s.name == name and s.env == "PLAIT_" + name.upper() and s.doc
        assert getattr(Config(), name) == s.default
    assert SETTINGS["host_id"].type == (str | None) and SETTINGS["nsocks"].type is int


def test_describe_hides_the_secret() -> None:
    rows = {var: value for var, value, _ in Config(secret="hunter2").describe()}
    assert "hunter2" not in rows["PLAIT_SECRET"] and "hunter2" not in repr(Config(secret="x2"))
    assert Config(secret="hunter2").secret == "hunter2"


def test_pickles_with_its_sources() -> None:
    cfg = Config.resolve(Config(algo="allreduce:ring"), {"PLAIT_NSOCKS": "2"})
    back = pickle.loads(pickle.dumps(cfg))
    assert back == cfg and back.source("nsocks") == "env" and back.source("algo") == "explicit"
    assert hash(back) == hash(cfg)


@pytest.fixture
def plait_logger(monkeypatch: pytest.MonkeyPatch) -> Iterator[logging.Logger]:
    """The ``plait`` logger with no handler that its records reach (pytest puts its own on
    the root during each test, so: not propagating), restored afterwards."""
    logger = logging.getLogger("plait")
    saved = (logger.level, list(logger.handlers))
    monkeypatch.setattr(logger, "propagate", False)
    logger.handlers.clear()
    logger.setLevel(logging.NOTSET)
    yield logger
    logger.handlers[:] = saved[1]
    logger.setLevel(saved[0])


def _without_pytest_handlers(logger: logging.Logger) -> None:
    """pytest 9.2 and later attach their capture handlers to every non-propagating logger
    when a test's call phase starts (after fixtures ran): take them off, so the checks see
    only what plait added (pytest's own removal at the end is then a no-op)."""
    for h in list(logger.handlers):
        if type(h).__module__.startswith("_pytest"):
            logger.removeHandler(h)


def test_log_level_applied(plait_logger: logging.Logger) -> None:
    _without_pytest_handlers(plait_logger)
    assert apply_log_level(Config.from_env({"PLAIT_LOG_LEVEL": "debug"})) == logging.DEBUG
    assert plait_logger.level == logging.DEBUG
    assert len(plait_logger.handlers) == 1
    assert isinstance(plait_logger.handlers[0], logging.StreamHandler)
    # Applied again (every init): the level changes, no second handler.
    assert apply_log_level(Config(log_level="25")) == 25
    assert plait_logger.level == 25 and len(plait_logger.handlers) == 1


def test_empty_log_level_leaves_logging_alone(plait_logger: logging.Logger) -> None:
    _without_pytest_handlers(plait_logger)
    plait_logger.setLevel(logging.ERROR)
    assert apply_log_level(Config.from_env({})) is None
    assert plait_logger.level == logging.ERROR and not plait_logger.handlers


def test_log_level_adds_no_handler_when_the_application_has_one(
        plait_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    _without_pytest_handlers(plait_logger)
    monkeypatch.setattr(plait_logger, "propagate", True)
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    apply_log_level(Config(log_level="INFO"))
    assert plait_logger.level == logging.INFO and not plait_logger.handlers


# ---------------------------------------------------------- settings reach the library


def case_settings_seen(comm: Any) -> dict[str, Any]:
    import os

    return {"env": {k: v for k, v in os.environ.items() if k.startswith("PLAIT_")},
            "timeout": comm.timeout if hasattr(comm, "timeout") else None}


def test_pool_settings_reach_ranks(pools: Any) -> None:
    results = pools.get(2, "tcp", timeout=17.0).run(case_settings_seen)
    for r in results:
        assert r["env"]["PLAIT_TRANSPORT"] == "tcp"
        assert r["env"]["PLAIT_SHM_SLOT_SIZE"] == "1K"
        if r["timeout"] is not None:
            assert r["timeout"] == 17.0


def case_invalid_setting_fails_init(info: Any) -> str:
    import os

    import torch.distributed as dist

    import plait

    saved = dict(os.environ)
    os.environ["PLAIT_TRANSPORT"] = "carrier-pigeon"
    try:
        with pytest.raises(ValueError, match="PLAIT_TRANSPORT") as exc:
            plait.init(0, 1, store=dist.HashStore())
        return str(exc.value)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_invalid_setting_fails_init(pools: Any) -> None:
    pools.get(1, "shm", init="none").run(case_invalid_setting_fails_init)


def case_algo_override_excludes_everything(comm: Any) -> None:
    """PLAIT_ALGO=allreduce:direct over TCP: no algorithm can run, and the error says so
    (before any communication: the barrier after it still pairs up)."""
    import numpy as np

    with pytest.raises(ValueError, match="PLAIT_ALGO"):
        comm.allreduce(np.ones(4, dtype=np.float32))
    comm.barrier()
    buf = np.ones(4, dtype=np.float32)
    comm.broadcast(buf, 0)  # other operations are unaffected


def test_algo_override_that_excludes_everything(pools: Any) -> None:
    pools.get(2, "tcp", env={"PLAIT_ALGO": "allreduce:direct"}).run(
        case_algo_override_excludes_everything)
