"""examples/elastic_ddp.py runs to the end: after a SIGKILLed rank the survivors shrink,
carry on, and their losses equal a 3-rank run from the state they resumed from (about
10 s here: in the default tier)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_elastic_ddp_example() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "elastic_ddp.py"),
                           "--steps", "12", "--kill-at", "5"], env=env, capture_output=True,
                          text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "equal a 3-rank run from that state: yes" in out, out
    assert "resumed at step 5" in out or "resumed at step 4" in out, out
