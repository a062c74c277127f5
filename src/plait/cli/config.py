"""``plait config``: print every setting, its current value and what it does."""

from __future__ import annotations

import argparse

from ..config import Config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def run(args: argparse.Namespace) -> int:
    del args
    for var, value, doc in Config.from_env().describe():
        print(f"{var:24} {value:14} {doc}")
    return 0
