"""The tensor-parallel decode benchmark's checks, on a tiny model: 2 real rank processes
(the benchmark's own launcher), teacher-forced tokens, logits against the single-process
model; with torch.compile, 0 graph breaks and compiled logits against eager.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from plait.bench.decoder import Decoder, DecoderConfig, rel_error, teacher_tokens
from plait.bench.tp_decode import TOLERANCE, RunOptions, decode, failures, launch

TINY = DecoderConfig(hidden=64, layers=2, heads=4, ffn=128, vocab=256, max_seq=8)


def test_missing_reduction_fails_the_check() -> None:
    """The tolerance separates TP's rounding noise from a real error: rank 0's shard
    without its allreduce is far outside it, in both dtypes."""
    tokens = teacher_tokens(TINY, 2, TINY.max_seq)
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        full = Decoder(TINY, dtype=dtype)
        shard = Decoder(TINY, rank=0, tp=2, dtype=dtype)
        err = rel_error(decode(shard, shard, tokens).logits, decode(full, full, tokens).logits)
        assert err > 10 * TOLERANCE[name], (name, err)


def test_tp2_matches_single_process(tmp_path: Path) -> None:
    opts = RunOptions(cfg=TINY, tp=2, batches=(1, 3), steps=TINY.max_seq, reps=1,
                      modes=("plait", "plait-op", "gloo"))
    result = launch(opts, str(tmp_path / "r.json"))
    assert failures(result) == []
    rows = {(r["dtype"], r["batch"], r["mode"]) for r in result["rows"]}
    assert rows == {(d, b, m) for d in ("bfloat16", "float32") for b in (1, 3)
                    for m in ("plait", "plait-op", "gloo")}
    for r in result["rows"]:
        assert 0 <= r["rel_err"] <= TOLERANCE[r["dtype"]], r
        assert 0 < r["coll_share"] < 1 and math.isfinite(r["tokens_per_s"]), r
    for ref in result["reference"]:
        if ref["dtype"] == "bfloat16":  # bfloat16 is measurably off float32, TP or not
            assert 1e-3 < ref["bf16_vs_fp32"] < TOLERANCE["bfloat16"], ref


def test_tp2_compiled_no_graph_breaks(tmp_path: Path) -> None:
    """torch.compile (inductor) with functional collectives and with
    torch.ops.plait.all_reduce_: 0 graph breaks, logits as eager's and the reference's."""
    opts = RunOptions(cfg=TINY, tp=2, batches=(2,), steps=TINY.max_seq, reps=1,
                      compile=True, modes=("plait-op",))
    result = launch(opts, str(tmp_path / "r.json"))
    assert failures(result) == []
    compiled = [r for r in result["rows"] if r["compiled"]]
    assert {(r["dtype"], r["mode"]) for r in compiled} == {
        (d, m) for d in ("bfloat16", "float32") for m in ("plait-funcol", "plait-op")}
    for r in compiled:
        assert r["graph_breaks"] == 0, r
        assert r["rel_err_vs_eager"] <= TOLERANCE[r["dtype"]], r
