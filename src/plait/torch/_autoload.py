"""Entry point of group ``torch.backends``: registers the ``plait`` backend on ``import torch``.

It must never raise: a failing hook would break every ``import torch`` in the environment.
"""

from __future__ import annotations


def autoload() -> None:
    try:
        from . import backend

        backend.register()
    except Exception:  # see the module docstring
        pass
