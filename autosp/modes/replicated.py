"""The replicated mode (``fsdp=False``): a whole replica of the model on every rank, kept in
step by the door's DDP (gradients all-reduced), checkpoints written as one file by rank 0."""

from __future__ import annotations

from autosp.modes.base import Mode

__all__ = ["Replicated"]


class Replicated(Mode):
    """Every step as :class:`~autosp.modes.base.Mode` takes it: the door's DDP does the rest."""
