"""Builds plait's compiled shared-memory engine (everything else is in pyproject.toml)."""

from __future__ import annotations

import os
import platform
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ENGINE = "src/plait/transport/csrc"

# Warnings on; no -march=native: the vector kernels pick their instruction set at load
# time (reduce.c), so what is built here runs on any CPU of the architecture.
# -fno-strict-aliasing: the segment is read through several types (int64 words, int32
# doorbells, raw bytes). -ffp-contract=off: no fused multiply-add, so every build rounds
# the same way.
CFLAGS = ["-std=c11", "-O3", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
          "-fno-strict-aliasing", "-ffp-contract=off", "-D_GNU_SOURCE"]
if os.environ.get("PLAIT_SANITIZE"):
    # the slow tier's sanitizer build: PLAIT_SANITIZE=address,undefined pip install -e .
    CFLAGS += ["-O1", "-g", "-fno-omit-frame-pointer",
               f"-fsanitize={os.environ['PLAIT_SANITIZE']}"]


class BuildEngine(build_ext):
    """Names the missing piece when the engine cannot be compiled."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # setuptools raises several unrelated classes here
            sys.stderr.write(
                "\nplait: building the C shared-memory engine failed "
                f"({type(exc).__name__}: {exc}).\nplait needs a C11 compiler (gcc or clang) "
                "and the Python headers: on Debian/Ubuntu `apt-get install gcc python3-dev`, "
                "on Fedora `dnf install gcc python3-devel`; set CC to use another compiler.\n")
            raise


setup(
    ext_modules=[Extension(
        "plait.transport._engine",
        sources=[f"{ENGINE}/engine.c", f"{ENGINE}/reduce.c"],
        depends=[f"{ENGINE}/reduce.h"],
        extra_compile_args=CFLAGS,
        extra_link_args=([f"-fsanitize={os.environ['PLAIT_SANITIZE']}"]
                         if os.environ.get("PLAIT_SANITIZE") else []),
    )] if platform.system() == "Linux" else [],
    cmdclass={"build_ext": BuildEngine},
)
