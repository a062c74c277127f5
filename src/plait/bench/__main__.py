"""``python -m plait.bench``: the same as ``plait bench`` (handy under torchrun and mpirun)."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
