"""How a model's parameters live across the ranks: the one interface every front door calls.

A front door (the Trainer strategy, the Fabric strategy, a plain PyTorch loop) picks its mode once,
at construction (:func:`autosp.modes.make_mode`), and then only calls it: to build the mesh the
mode needs, to give a model built on the meta device its values, to set up the module and its
optimizers, to save and load checkpoints and to hand the module back when a run ends. Where the
door's framework has its own way for replicas (Lightning's ``DDPStrategy``), the door hands it
over as ``ddp=``: :class:`~autosp.modes.replicated.Replicated` runs it, while
:class:`~autosp.modes.sharded.mode.Sharded` does its own.

Checkpoints take one path whichever the door (:meth:`Mode.save`, :meth:`Mode.load`,
:meth:`Mode.load_model_state`, :meth:`Mode.load_optimizer_states`): a directory is a torch
distributed checkpoint, read into the module and the optimizers on any layout; a file is one
``torch.save``-d dict whose model keys are mapped to the module's own (a Trainer checkpoint in
a Fabric loop and the other way round, :func:`autosp.checkpoint.current_names`).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from autosp.checkpoint import current_names, is_distributed_checkpoint, load_distributed, optimizer_param_names
from autosp.modes.sharded.materialize import has_meta_tensors, materialize_meta

if TYPE_CHECKING:
    from autosp.layout import SPLayout

__all__ = ["Mode"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Mode:
    """What a front door asks of the way parameters are held (the base: a replica on every rank).

    Args:
        info: where progress messages go (the Lightning strategies pass their rank-zero logger;
            default: this module's ``logging`` logger at INFO).
    """

    #: ``"replicated"``, or the sharded mode's ``"full"`` / ``"hybrid"``
    name = "replicated"

    def __init__(self, info: Optional[Callable[[str], None]] = None) -> None:
        self.info = info or log.info

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ------------------------------------------------------------------ arguments and processes
    def refuse_ddp_arguments(self, given: Mapping[str, Any], fsdp: Any) -> None:
        """Raise a ``ValueError`` naming the DDP wrapper's arguments set in ``given`` that this
        mode would ignore (a replica takes them all)."""

    def build_mesh(self, layout: "SPLayout", devices_per_node: int, device_type: str, timeout: Optional[timedelta]) -> None:
        """Build what the mode holds parameters on (a collective: every rank, after the ``dp x sp`` mesh)."""

    def ddp_only(self, make: Callable[[], T]) -> Optional[T]:
        """``make()`` where the module is a DDP replica (its hooks, its ``no_sync``), else ``None``."""
        return make()

    # ------------------------------------------------------------------ the module
    def init_context(self, empty_init: Optional[bool], ddp: Callable[[], AbstractContextManager], precision: Callable[[], AbstractContextManager]) -> AbstractContextManager:
        """The context modules are built in (the door's own, ``ddp()``, for replicas)."""
        return ddp()

    def check_pretrained(self, root: nn.Module) -> None:
        """Refuse before anything moves if ``pretrained`` names parts the mode cannot fill."""

    def model_to_device(self, model: nn.Module, root: nn.Module, device: torch.device, precision: str, shard: bool, strict: bool, ddp: Callable[[], None]) -> None:
        """Give ``model`` storage on ``device``: tensors left on the meta device get their values
        from the model's own initialisers, then the door moves the rest (``ddp()``)."""
        if has_meta_tensors(model):
            n = materialize_meta(model, device)
            self.info(f"AutoSP: initialised {n} tensors of the model built on the meta device on {device}")
        ddp()

    def setup_module(self, module: nn.Module, precision: str, ddp: Callable[[nn.Module], nn.Module]) -> nn.Module:
        """The module as the step runs it (the door's DDP wrapper for replicas)."""
        return ddp(module)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list, setup_module: Callable[[nn.Module], nn.Module], ddp: Callable[[], tuple]) -> tuple[nn.Module, list]:
        """``(module, optimizers)`` set up together, for optimizers built before the module was."""
        out = ddp()
        return out[0], out[1]

    def holds_shards(self, module: Optional[nn.Module]) -> bool:
        """Whether ``module``'s parameters are this mode's shards now."""
        return False

    def leave(self, module: Optional[nn.Module]) -> None:
        """Hand the module back as the user gave it, when a run ends (a collective where sharded)."""

    def reduce_gradients(self, module: nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
        """After ``backward`` in a loop without a DDP wrapper: every rank's gradients averaged
        over ``group`` (default: the world), as DDP averages them. A collective."""
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)  # (a sum: gloo has no average)
        flat /= dist.get_world_size(group)
        for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(reduced.view_as(g))

    # ------------------------------------------------------------------ checkpoints
    def optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer, ddp: Callable[[torch.optim.Optimizer], dict]) -> dict[str, Any]:
        """The state of ``optimizer`` as a checkpoint holds it."""
        return ddp(optimizer)

    def save(
        self, checkpoint: dict[str, Any], path: Any, module: Optional[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
        rank: Optional[int] = None, barrier: Optional[Callable[[str], None]] = None,
        write_file: Optional[Callable[[dict[str, Any]], None]] = None, storage_options: Any = None,
    ) -> None:
        """One file (``write_file``, the door's; default: ``torch.save`` by rank 0), with the
        optimizers' parameter names added so that a sharded run can place their state. ``rank``
        and ``barrier`` default to :mod:`torch.distributed`'s. A collective: every rank calls it."""
        rank, barrier = rank_and_barrier(rank, barrier)
        write_file = write_file or partial(_write_file, path, rank, barrier)
        if rank == 0 and module is not None and "optimizer_states" in checkpoint:
            names = optimizer_param_names(module, optimizers)
            checkpoint = {**checkpoint, "autosp": {**checkpoint.get("autosp", {}), "optimizer_param_names": names}}
        write_file(checkpoint)

    def load(
        self, path: Any, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], strict: bool,
        weights_only: Optional[bool], read_file: Callable[[Any], dict[str, Any]],
    ) -> tuple[dict[str, Any], bool]:
        """``(checkpoint, restored)``: a distributed checkpoint (a directory) read here into
        ``module`` and ``optimizers`` on any layout (``restored``; the rest of it returned, with
        empty ``optimizer_states`` where there are optimizers); a file as ``read_file`` reads it,
        for :meth:`load_model_state` and :meth:`load_optimizer_states`."""
        if not is_distributed_checkpoint(path):
            return read_file(path), False
        meta = load_distributed(path, module, optimizers, strict=strict, weights_only=weights_only)
        if optimizers:
            meta["optimizer_states"] = []  # restored above (Lightning checks the key is there)
        return meta, True

    def restore(self, path: Any, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Everything of a checkpoint read into ``module`` and ``optimizers`` (:meth:`load`, then
        :meth:`load_model_state` and :meth:`load_optimizer_states` for a file); the rest of it
        returned. A collective: every rank calls it."""
        read_file = partial(torch.load, map_location="cpu", **({} if weights_only is None else {"weights_only": weights_only}))
        checkpoint, restored = self.load(path, module, optimizers, strict, weights_only, read_file)
        if not restored:
            self.load_model_state(module, checkpoint["state_dict"], strict, str(path))
            self.load_optimizer_states(module, optimizers, checkpoint, str(path))
        return checkpoint

    def load_model_state(self, module: nn.Module, state_dict: Mapping[str, Any], strict: bool, where: str) -> None:
        """Whole tensors of a single-file checkpoint into ``module``, keys mapped to its own."""
        name = current_names(state_dict, module.state_dict())
        self._load_whole(module, {name(k): v for k, v in state_dict.items()}, strict, where)

    def _load_whole(self, module: nn.Module, state_dict: dict[str, Any], strict: bool, where: str) -> None:
        module.load_state_dict(state_dict, strict=strict)

    def load_optimizer_states(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], checkpoint: Mapping[str, Any], where: str) -> None:
        """The optimizer states of a single-file checkpoint (kept by position) into ``optimizers``."""
        for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", [])):
            optimizer.load_state_dict(state)


def rank_and_barrier(rank: Optional[int], barrier: Optional[Callable[[str], None]]) -> tuple[int, Callable[[str], None]]:
    initialized = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    if barrier is None:
        barrier = (lambda name: dist.barrier()) if initialized else (lambda name: None)
    return rank, barrier


def _write_file(path: Any, rank: int, barrier: Callable[[str], None], checkpoint: dict[str, Any]) -> None:
    """``torch.save`` by rank 0 (replicas hold the same values), the others waiting for it."""
    if rank == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(checkpoint, path)
    barrier("autosp_save_file")
