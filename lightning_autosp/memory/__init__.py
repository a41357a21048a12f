"""Activation memory: what each compiled graph saves for backward (:mod:`.accounting`) and the
:class:`ActivationMemoryMonitor` callback that logs it (:mod:`.monitor`)."""

from lightning_autosp.passes.accounting import OP_KINDS, op_kind
from lightning_autosp.memory.monitor import ActivationMemoryMonitor

__all__ = ["ActivationMemoryMonitor", "OP_KINDS", "op_kind"]
