"""The sharded mode (``fsdp=True`` / ``"hybrid"``) as the mode object the front doors call.

:class:`Sharded` ties the pieces of this package to a mesh, in the order a training loop needs
them: build on meta (:mod:`.materialize`) or read pretrained weights (:mod:`.pretrained`), shard
(:mod:`.params`), train, save/load (:mod:`autosp.checkpoint`: DCP directories), unshard. It knows
nothing of Lightning: the Trainer strategy, the Fabric strategy and a plain PyTorch loop call the
same methods.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Generator, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from autosp.checkpoint import check_fits, current_names, named_optimizer_state, save_distributed
from autosp.errors import AutoSPError
from autosp.modes.base import Mode, rank_and_barrier
from autosp.modes.sharded.config import DDP_ONLY_ARGUMENTS, FSDPConfig, ShardingPolicy, shard_mesh
from autosp.modes.sharded.materialize import has_meta_tensors, materialize_meta, materialize_sharded, move_real_tensors
from autosp.modes.sharded.params import broadcast_module, is_sharded, shard_module, unshard_module
from autosp.modes.sharded.pretrained import load_pretrained, load_whole

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from autosp.layout import SPLayout

__all__ = ["Sharded"]


class Sharded(Mode):
    """Parameters, gradients and optimizer state sharded as DTensors over :attr:`mesh`.

    Args:
        config: the mode and its dtypes (``FSDPConfig.from_arguments``).
        pretrained: weights to start from per attribute of the root module (``""``: the root).
        info: where progress messages go (default: this package's ``logging`` logger at INFO).
    """

    def __init__(self, config: FSDPConfig, pretrained: Optional[Mapping[str, str]] = None, info: Optional[Callable[[str], None]] = None):
        super().__init__(info)
        self.config = config
        self.name = config.mode
        self.pretrained = dict(pretrained or {})
        self.mesh: Optional["DeviceMesh"] = None

    def __repr__(self) -> str:
        return f"Sharded({self.config.mode!r})"

    # ------------------------------------------------------------------ arguments and processes
    def refuse_ddp_arguments(self, given: Mapping[str, Any], fsdp: Any) -> None:
        ddp_only = [name for name in DDP_ONLY_ARGUMENTS if given.get(name) is not None]
        ddp_only += sorted(name for name in given if name not in DDP_ONLY_ARGUMENTS)
        if ddp_only:
            raise ValueError(
                f"AutoSPStrategy(fsdp={fsdp!r}) does not use PyTorch's DistributedDataParallel, so its arguments "
                f"{ddp_only} would do nothing: the sharded mode reduce-scatters gradients inside the compiled step. "
                "Remove them, or pass fsdp=False to train DDP replicas."
            )

    def build_mesh(self, layout: "SPLayout", devices_per_node: int, device_type: str, timeout: Optional[timedelta]) -> None:
        self.mesh = shard_mesh(self.config, layout.world_size, devices_per_node, device_type, timeout)

    def ddp_only(self, make: Callable[[], Any]) -> None:
        return None  # no DDP wrapper: gradients are reduce-scattered inside the compiled step

    def reduce_gradients(self, module: nn.Module, group: Optional[Any] = None) -> None:
        """Nothing: the compiled step reduce-scattered each gradient into its shard already."""

    def policy(self, precision: str) -> ShardingPolicy:
        assert self.mesh is not None, "build_mesh first"
        return self.config.policy(self.mesh, precision)

    # ------------------------------------------------------------------ the module
    def init_context(self, empty_init: Optional[bool], ddp: Callable[[], AbstractContextManager], precision: Callable[[], AbstractContextManager]) -> AbstractContextManager:
        """Modules built here go to the ``meta`` device (no memory until :meth:`model_to_device`),
        unless ``empty_init=False``."""
        return ddp() if empty_init is False else _on_meta(precision)

    def check_pretrained(self, root: nn.Module) -> None:
        self._pretrained_parts(root)

    def _pretrained_parts(self, root: nn.Module) -> dict[str, nn.Module]:
        """The submodules ``pretrained`` names; each must still be on the meta device."""
        parts = {}
        for attr in self.pretrained:
            part = root if attr == "" else getattr(root, attr, None)
            if not isinstance(part, nn.Module) or not has_meta_tensors(part):
                raise AutoSPError(
                    f"AutoSPStrategy(pretrained={{{attr!r}: ...}}): the module's `{attr}` must be a module built on "
                    "the meta device: build it in configure_model (or under the strategy's init context), so that "
                    "AutoSP can build it without memory, then read each rank's shard of the weights."
                )
            parts[attr] = part
        return parts

    def model_to_device(self, model: nn.Module, root: nn.Module, device: torch.device, precision: str, shard: bool, strict: bool, ddp: Callable[[], None]) -> None:
        """A model built on the meta device gets its values shard by shard when ``shard`` (each
        rank its shards and one unit at a time, from ``pretrained`` weights or the model's own
        initialisers), else whole on every rank (evaluation); any other model is moved whole."""
        parts = self._pretrained_parts(root)
        if not has_meta_tensors(model):
            return move_real_tensors(model, device)
        if not shard:
            n = materialize_meta(model, device)
            self.info(f"AutoSP: initialised {n} tensors of the model built on the meta device on {device}")
            for attr, part in parts.items():
                load_whole(part, self.pretrained[attr], strict=strict)
            return ddp()
        move_real_tensors(model, device)
        policy = self.policy(precision)
        for attr, part in parts.items():
            n = load_pretrained(part, self.pretrained[attr], policy, device, strict=strict)
            self.info(f"AutoSP: read {n} tensors of `{attr}` from {self.pretrained[attr]}, each rank its shards")
        report = materialize_sharded(model, device, policy)
        if report.units:
            self.info(
                f"AutoSP: initialised the model built on the meta device on {device} in {report.units} unit(s) of at "
                f"most {report.largest_unit_bytes / 2**20:.1f} MiB (model {report.model_bytes / 2**20:.1f} MiB), "
                "each sharded before the next"
            )

    def setup_module(self, module: nn.Module, precision: str, ddp: Callable[[nn.Module], nn.Module]) -> nn.Module:
        """Rank 0's initial values everywhere (as DDP does): its buffers broadcast, every parameter a
        DTensor shard of its values."""
        broadcast_module(module, parameters=False)
        policy = self.policy(precision)
        n = shard_module(module, policy)
        dtypes = f", gathered in {policy.param_dtype}, reduced in {policy.reduce_dtype}" if policy.param_dtype else ""
        self.info(
            f"AutoSP: {sum(1 for _ in module.parameters())} parameters sharded as DTensors over {self.mesh} "
            f"(fsdp={self.config.mode!r}{dtypes}; {n} in setup)"
        )
        return module

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list, setup_module: Callable[[nn.Module], nn.Module], ddp: Callable[[], tuple]) -> tuple[nn.Module, list]:
        """Optimizers built over the parameters before sharding (on the meta device, even) are
        pointed at the DTensor parameters that replace them, by name."""
        names = {id(p): n for n, p in module.named_parameters()}
        for optimizer in optimizers:
            foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
            if optimizer.state or foreign:
                raise AutoSPError(
                    f"AutoSPStrategy(fsdp={self.config.mode!r}): fabric.setup got an optimizer that "
                    + ("already has state" if optimizer.state else f"holds {len(foreign)} tensor(s) that are not the model's parameters")
                    + "; its parameters are replaced by DTensor shards here. Build it over `model.parameters()` "
                    "before its first step, or after `fabric.setup_module(model)` and pass it to `fabric.setup_optimizers`."
                )
        module = setup_module(module)
        sharded = dict(module.named_parameters())
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        return module, optimizers

    def holds_shards(self, module: Optional[nn.Module]) -> bool:
        return module is not None and is_sharded(module)

    def leave(self, module: Optional[nn.Module]) -> None:
        """Full parameters and the module's own classes back, on every rank (a collective)."""
        if self.holds_shards(module):
            unshard_module(module)

    # ------------------------------------------------------------------ checkpoints
    def optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer, ddp: Callable[[torch.optim.Optimizer], dict]) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name, its tensors DTensors."""
        if not self.holds_shards(module):
            return ddp(optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(module, optimizer)

    def save(
        self, checkpoint: dict[str, Any], path: Any, module: Optional[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
        rank: Optional[int] = None, barrier: Optional[Callable[[str], None]] = None,
        write_file: Optional[Callable[[dict[str, Any]], None]] = None, storage_options: Any = None,
    ) -> None:
        """A torch distributed checkpoint directory while the module is sharded: no rank gathers
        the model (:func:`autosp.checkpoint.save_distributed`); one file otherwise."""
        if not self.holds_shards(module):
            return super().save(checkpoint, path, module, optimizers, rank, barrier, write_file, storage_options)
        if storage_options is not None:
            raise TypeError("AutoSPStrategy(fsdp=...) writes distributed checkpoints itself: storage_options is not supported.")
        rank, barrier = rank_and_barrier(rank, barrier)
        save_distributed(checkpoint, path, rank=rank, barrier=barrier)

    def _load_whole(self, module: nn.Module, state_dict: dict[str, Any], strict: bool, where: str) -> None:
        if not self.holds_shards(module):
            return super()._load_whole(module, state_dict, strict, where)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        check_fits(state_dict, module.state_dict(), strict, where)
        set_model_state_dict(module, state_dict, options=StateDictOptions(full_state_dict=True, strict=strict))

    def load_optimizer_states(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], checkpoint: Mapping[str, Any], where: str) -> None:
        """Whole optimizer states kept by position (a single-file checkpoint, with the parameter
        names AutoSP adds) into the sharded optimizers."""
        if not self.holds_shards(module):
            return super().load_optimizer_states(module, optimizers, checkpoint, where)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = (checkpoint.get("autosp") or {}).get("optimizer_param_names")
        if names is None:
            raise AutoSPError(
                f"{where} holds optimizer state by position only (it was not written by AutoSPStrategy), and a sharded "
                "run needs it by parameter name. Resume it with fsdp=False, or load its weights into the module "
                "before fit and start the optimizer afresh."
            )
        name = current_names([n for group in names for n in group], dict(module.named_parameters()))
        for i, (optimizer, state) in enumerate(zip(optimizers, checkpoint.get("optimizer_states", []))):
            named = named_optimizer_state(state, [name(n) for n in names[i]], where)
            set_optimizer_state_dict(module, optimizer, named, options=StateDictOptions(full_state_dict=True))


@contextmanager
def _on_meta(precision: Callable[[], AbstractContextManager]) -> Generator[None, None, None]:
    with ExitStack() as stack:
        stack.enter_context(torch.device("meta"))
        stack.enter_context(precision())
        yield
