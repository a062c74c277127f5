"""The shared-memory tests against an AddressSanitizer + UndefinedBehaviorSanitizer build
of the compiled engine (slow tier: `python -m pytest -m slow tests/test_sanitizers.py`).

The extension is rebuilt with ``PLAIT_SANITIZE=address,undefined`` (setup.py) into a
temporary tree next to a copy of the Python sources, and the engine and collective tests
run on real rank processes with that tree first on the path and the ASan runtime
preloaded (Python itself is not instrumented); any report fails the run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _runtime(name: str) -> str | None:
    cc = os.environ.get("CC", "gcc")
    try:
        out = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return out if os.path.isabs(out) and os.path.exists(out) else None


def test_engine_under_asan_and_ubsan(tmp_path: Path) -> None:
    asan = _runtime("libasan.so")
    if asan is None:
        pytest.skip("no AddressSanitizer runtime for the C compiler")
    lib = tmp_path / "lib"
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(lib),
         "--build-temp", str(tmp_path / "tmp")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PLAIT_SANITIZE": "address,undefined"})
    assert build.returncode == 0, build.stderr[-4000:]
    shutil.copytree(ROOT / "src" / "plait", lib / "plait", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(lib), "LD_PRELOAD": asan,
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
    where = subprocess.run(
        [sys.executable, "-c", "import plait.transport._engine as e; print(e.__file__)"],
        env=env, capture_output=True, text=True, timeout=120, check=True)
    assert where.stdout.strip().startswith(str(lib)), where.stdout
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         "tests/test_engine.py", "tests/test_reduce_ops.py", "tests/test_collectives.py",
         "-k", "not slow"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, tail
    assert "ERROR: AddressSanitizer" not in tail and "runtime error:" not in tail, tail
