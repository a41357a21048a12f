"""The modes: how a model's parameters live across the ranks, behind one interface
(:class:`~autosp.modes.base.Mode`) the front doors call without asking which.

* :class:`Replicated` (``fsdp=False``) - a replica on every rank, under the door's DDP;
* :class:`Sharded` (``fsdp=True`` / ``"hybrid"``) - parameters, gradients and optimizer state as
  DTensor shards (:mod:`autosp.modes.sharded`).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

from autosp.modes.base import Mode
from autosp.modes.replicated import Replicated
from autosp.modes.sharded.config import FSDPConfig
from autosp.modes.sharded.mode import Sharded

__all__ = ["Mode", "Replicated", "Sharded", "FSDPConfig", "make_mode"]


def make_mode(config: Optional[FSDPConfig], pretrained: Optional[Mapping[str, str]] = None, info: Optional[Callable[[str], None]] = None) -> Mode:
    """The mode of checked arguments (:func:`autosp.arguments.check_arguments`'s ``FSDPConfig``,
    ``None`` for replicas)."""
    return Replicated(info) if config is None else Sharded(config, pretrained, info)
