"""An emulated multi-host cluster (network namespaces, rails, tbf shaping, ECMP) for tests.

``Cluster`` builds it and launches ranks on it; ``plait testbed`` is its command line.
See docs/TESTBED.md.
"""

from __future__ import annotations

from plait.testbed.cluster import Cluster, LaunchResult, RankResult, TestbedError

__all__ = ["Cluster", "LaunchResult", "RankResult", "TestbedError"]
