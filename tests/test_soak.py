"""Soak (slow tier): 10,000 mixed collectives with random sizes and roots on 4 ranks, each
verified, resident memory flat. ``python benchmarks/soak.py`` runs the same case."""

from __future__ import annotations

from typing import Any

import pytest

from plait.testing.soak import case_soak

RSS_GROWTH_LIMIT = 32 << 20
"""Allowed growth of a rank's resident memory after warm-up (allocator noise, caches)."""


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_soak_10000_mixed_collectives(pools: Any, transport: str) -> None:
    results = pools.get(4, transport).run(case_soak, 10_000, deadline=1800)
    for r, res in enumerate(results):
        first, last = res["rss"][0][1], res["rss"][-1][1]
        assert last - first < RSS_GROWTH_LIMIT, f"rank {r}: resident memory {res['rss']}"
        assert sum(res["kinds"].values()) == 10_000
