"""plait.config: the one reader of PLAIT_* variables (pure, no processes), and that the
settings reach a communicator at init."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import pytest

from plait.config import DEFAULT_TIMEOUT_S, Config, parse_size, to_seconds


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
