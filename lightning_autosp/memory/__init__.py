"""Activation memory as users see it: the :class:`ActivationMemoryMonitor` callback
(:mod:`.monitor`) that logs what each compiled graph saves for backward (recorded by
:mod:`lightning_autosp.passes.accounting`, which SAC and the backend share) and the same for
eager forwards (:mod:`.eager`)."""

from lightning_autosp.passes.accounting import OP_KINDS, op_kind
from lightning_autosp.memory.monitor import ActivationMemoryMonitor

__all__ = ["ActivationMemoryMonitor", "OP_KINDS", "op_kind"]
