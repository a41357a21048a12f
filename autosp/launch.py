"""What a rank that Lightning's multiprocessing launcher started (``start_method`` ``"fork"``,
``"forkserver"`` or ``"spawn"``) checks or undoes before it trains.

- ``"fork"``: on torch >= 2.14 autograd cannot run in a process forked from one that had
  compiled a training step (:data:`~autosp._compat.FORK_AFTER_COMPILE_BREAKS_AUTOGRAD`);
  the rank says so and names the launchers that work, instead of torch's error in the first
  backward.
- ``"forkserver"`` / ``"spawn"``: torch's multiprocessing pickles the module's tensors into
  shared memory, so on the CPU every rank would update the same parameters - each optimizer step
  applied once per rank, silently. Lightning copies them for ``"spawn"`` only; the rank copies
  any parameter or buffer still shared, whatever the method.
"""

from __future__ import annotations

import itertools

from typing import Optional

import torch

from autosp._compat import FORK_AFTER_COMPILE_BREAKS_AUTOGRAD
from autosp.errors import AutoSPError


def autograd_runs_after_fork() -> bool:
    """Whether autograd can run in this process: ``False`` only in a process forked, on a torch
    with :data:`~autosp._compat.FORK_AFTER_COMPILE_BREAKS_AUTOGRAD`, from one that had
    started autograd's threads. A one-element backward on the CPU, which starts no thread."""
    if not FORK_AFTER_COMPILE_BREAKS_AUTOGRAD:
        return True
    try:
        torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError as err:
        if "fork-based multiprocessing" in str(err):
            return False
        raise
    return True


@torch.no_grad()
def unshare(module: torch.nn.Module) -> int:
    """Give every parameter and buffer of ``module`` that lives in shared memory a private copy
    (in place, keeping the tensor objects); return how many were copied."""
    copied = 0
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.is_shared():
            tensor.data = tensor.data.clone()
            copied += 1
    return copied


def prepare_rank(start_method: str, module: Optional[torch.nn.Module] = None) -> None:
    """Run in each rank before it builds groups: the checks above for ``start_method``."""
    if start_method == "fork" and not autograd_runs_after_fork():
        raise AutoSPError(
            "AutoSPStrategy(start_method='fork'): this process was forked from one that had already compiled a "
            f"training step (torch.compile ran there, e.g. in an earlier cell), and with torch {torch.__version__} "
            "autograd cannot run in a process forked after that. Use start_method='popen' (the default, for "
            "scripts) or 'spawn', or launch the forked run before compiling anything in the launching process "
            "(in a notebook: restart the kernel)."
        )
    if start_method in ("forkserver", "spawn") and module is not None:
        unshare(module)
