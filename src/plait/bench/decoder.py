"""A Llama-style decoder, tensor-parallel over ``tp`` ranks, for decode benchmarks and tests.

Each layer: RMSNorm, attention with rotary embeddings and a static KV cache, RMSNorm,
SwiGLU MLP, both with residual connections. Tensor parallelism as Megatron-LM splits it:
the QKV and gate/up projections are column-parallel (each rank holds ``heads / tp`` heads
and ``ffn / tp`` MLP columns), ``o_proj`` and ``down`` are row-parallel, and each of the
two is followed by one allreduce of the ``[batch, hidden]`` partial sums: two allreduces
per layer. Embedding, norms and the LM head are replicated. With ``tp = 1`` and no
reduction it is the single-process model, from the very same weights.

Weights are generated from a seed (float32, one full matrix at a time, then sliced to
this rank's shard and cast), so every rank and the single-process reference build the
same model without any file. The KV cache has ``max_seq`` positions and the decode step
attends over all of them with a mask: every step has the same shapes, which lets
``torch.compile`` compile one graph for all positions (the position is a tensor).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Reduce = Callable[[Tensor], Tensor]
"""Sums a row-parallel layer's partial output over the TP group (may work in place)."""


def no_reduce(t: Tensor) -> Tensor:
    return t


@dataclass(frozen=True)
class DecoderConfig:
    hidden: int = 1024
    layers: int = 4
    heads: int = 16
    ffn: int = 2816
    vocab: int = 8192
    max_seq: int = 64
    seed: int = 0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check(self, tp: int) -> None:
        if self.hidden % self.heads or self.head_dim % 2:
            raise ValueError(f"hidden {self.hidden} must split into {self.heads} heads of "
                             "an even size")
        if self.heads % tp or self.ffn % tp:
            raise ValueError(f"{self.heads} heads and ffn {self.ffn} must divide by tp={tp}")


class _Weights:
    """Deterministic float32 weights: matrix ``i`` from its own generator."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.count = 0

    def normal(self, *shape: int, std: float, mean: float = 0.0) -> Tensor:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.count)
        self.count += 1
        return torch.randn(*shape, generator=g) * std + mean


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding (half-split form) of ``x`` [..., head_dim] at one position."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Layer(nn.Module):
    def __init__(self, cfg: DecoderConfig, w: _Weights, rank: int, tp: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        h, hd, f = cfg.hidden, cfg.head_dim, cfg.ffn
        nl = cfg.heads // tp  # heads on this rank
        cols = slice(rank * nl * hd, (rank + 1) * nl * hd)
        fcols = slice(rank * (f // tp), (rank + 1) * (f // tp))
        s_in, s_ffn = 1 / math.sqrt(h), 1 / math.sqrt(f)
        self.attn_norm = nn.Buffer(w.normal(h, std=0.1, mean=1.0).to(dtype))
        qkv = [w.normal(h, h, std=s_in)[cols] for _ in range(3)]  # column-parallel
        self.wqkv = nn.Buffer(torch.cat(qkv).to(dtype))
        self.wo = nn.Buffer(w.normal(h, h, std=s_in)[:, cols].to(dtype))  # row-parallel
        self.mlp_norm = nn.Buffer(w.normal(h, std=0.1, mean=1.0).to(dtype))
        gate_up = [w.normal(f, h, std=s_in)[fcols] for _ in range(2)]
        self.wgu = nn.Buffer(torch.cat(gate_up).to(dtype))
        self.wdown = nn.Buffer(w.normal(h, f, std=s_ffn)[:, fcols].to(dtype))
        self.nl, self.hd, self.eps = nl, hd, cfg.eps
        self.scale = 1 / math.sqrt(hd)
        self.k_cache = nn.Buffer(torch.zeros(0, dtype=dtype), persistent=False)
        self.v_cache = nn.Buffer(torch.zeros(0, dtype=dtype), persistent=False)

    def reset(self, batch: int, max_seq: int) -> None:
        shape = (batch, self.nl, max_seq, self.hd)
        self.k_cache = torch.zeros(shape, dtype=self.wo.dtype)
        self.v_cache = torch.zeros(shape, dtype=self.wo.dtype)

    def forward(self, x: Tensor, pos: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                reduce: Reduce) -> Tensor:
        b = x.shape[0]
        h = rms_norm(x, self.attn_norm, self.eps)
        q, k, v = F.linear(h, self.wqkv).view(b, 3, self.nl, self.hd).unbind(1)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        at = pos.view(1)
        self.k_cache.index_copy_(2, at, k.unsqueeze(2))
        self.v_cache.index_copy_(2, at, v.unsqueeze(2))
        scores = (q.unsqueeze(2) @ self.k_cache.transpose(-1, -2)).squeeze(2) * self.scale
        scores = scores.float().masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(x.dtype)
        o = (p.unsqueeze(2) @ self.v_cache).squeeze(2).reshape(b, self.nl * self.hd)
        x = x + reduce(F.linear(o, self.wo))
        h = rms_norm(x, self.mlp_norm, self.eps)
        gate, up = F.linear(h, self.wgu).chunk(2, dim=-1)
        return x + reduce(F.linear(F.silu(gate) * up, self.wdown))


class Decoder(nn.Module):
    """Rank ``rank``'s shard of the decoder; ``tp = 1`` is the whole model."""

    def __init__(self, cfg: DecoderConfig, *, rank: int = 0, tp: int = 1,
                 dtype: torch.dtype = torch.float32, reduce: Reduce = no_reduce) -> None:
        super().__init__()
        cfg.check(tp)
        self.cfg = cfg
        self.reduce = reduce
        w = _Weights(cfg.seed)
        self.embed = nn.Buffer(w.normal(cfg.vocab, cfg.hidden, std=1.0).to(dtype))
        self.layers = nn.ModuleList(Layer(cfg, w, rank, tp, dtype) for _ in range(cfg.layers))
        self.norm = nn.Buffer(w.normal(cfg.hidden, std=0.1, mean=1.0).to(dtype))
        self.lm_head = nn.Buffer(
            w.normal(cfg.vocab, cfg.hidden, std=1 / math.sqrt(cfg.hidden)).to(dtype))
        half = cfg.head_dim // 2
        freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
        angles = torch.arange(cfg.max_seq, dtype=torch.float64)[:, None] * freq[None, :]
        self.cos = nn.Buffer(angles.cos().to(dtype))
        self.sin = nn.Buffer(angles.sin().to(dtype))
        self.positions = nn.Buffer(torch.arange(cfg.max_seq))

    def reset(self, batch: int) -> None:
        """Empty KV caches for ``batch`` sequences."""
        for layer in self.layers:
            layer.reset(batch, self.cfg.max_seq)  # type: ignore[operator]

    def forward(self, tokens: Tensor, pos: Tensor) -> Tensor:
        """One decode step: ``tokens`` [batch] at position ``pos`` (a 0-d int64 tensor)
        -> float32 logits [batch, vocab]."""
        x = F.embedding(tokens, self.embed)
        at = pos.view(1)  # index_select, not self.cos[pos]: no data-dependent scalar
        cos, sin = self.cos.index_select(0, at), self.sin.index_select(0, at)
        mask = self.positions <= pos
        for layer in self.layers:
            x = layer(x, pos, cos, sin, mask, self.reduce)
        return F.linear(rms_norm(x, self.norm, self.cfg.eps), self.lm_head).float()


def teacher_tokens(cfg: DecoderConfig, batch: int, steps: int) -> Tensor:
    """Fixed input tokens [steps, batch] (the same on every rank and run)."""
    g = torch.Generator().manual_seed(cfg.seed + 7)
    return torch.randint(0, cfg.vocab, (steps, batch), generator=g)


def rel_error(a: Tensor, ref: Tensor) -> float:
    """Largest norm-wise relative error ||a - ref|| / ||ref|| over steps and sequences
    (the last dimension is the logits)."""
    diff = torch.linalg.vector_norm((a.double() - ref.double()), dim=-1)
    return float((diff / torch.linalg.vector_norm(ref.double(), dim=-1)).max())
