"""The sharded mode (``fsdp=True`` / ``"hybrid"``) as one component the strategies hold.

:class:`ShardedMode` ties the pieces of :mod:`autosp.sharded.fsdp` (DTensor parameters),
:mod:`autosp.sharded.meta_init` (meta-device models initialised shard by shard, pretrained
weights read per shard) and :mod:`autosp.checkpoint` (DCP directories) to a mesh, in
the order a training loop needs them: build on meta, materialize, shard, train, save/load,
unshard. It knows nothing of Lightning: the Trainer strategy, the Fabric strategy and a plain
PyTorch loop call the same methods.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Generator, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from autosp.checkpoint import check_fits, named_optimizer_state, save_distributed
from autosp.errors import AutoSPError
from autosp.sharded.fsdp import FSDPConfig, ShardingPolicy, broadcast_module, is_sharded, shard_module, unshard_module
from autosp.mesh import shard_mesh
from autosp.sharded.meta_init import has_meta_tensors, load_pretrained, load_whole, materialize_meta, materialize_sharded, move_real_tensors

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ShardedMode"]

log = logging.getLogger(__name__)


class ShardedMode:
    """Parameters, gradients and optimizer state sharded as DTensors over :attr:`mesh`.

    Args:
        config: the mode and its dtypes (``FSDPConfig.from_arguments``).
        pretrained: weights to start from per attribute of the root module (``""``: the root).
        info: where progress messages go (the Lightning strategies pass their rank-zero logger;
            default: this module's ``logging`` logger at INFO).
    """

    def __init__(self, config: FSDPConfig, pretrained: Optional[Mapping[str, str]] = None, info: Optional[Callable[[str], None]] = None):
        self.config = config
        self.pretrained = dict(pretrained or {})
        self.mesh: Optional["DeviceMesh"] = None
        self.info = info or log.info

    def setup_mesh(self, world_size: int, devices_per_node: int, device_type: str, timeout: Optional[timedelta]) -> None:
        self.mesh = shard_mesh(self.config, world_size, devices_per_node, device_type, timeout)

    def policy(self, precision: str) -> ShardingPolicy:
        assert self.mesh is not None, "setup_mesh first"
        return self.config.policy(self.mesh, precision)

    @contextmanager
    def init_context(self) -> Generator[None, None, None]:
        """Modules built here go to the ``meta`` device: no memory until :meth:`materialize`."""
        with torch.device("meta"):
            yield

    def pretrained_parts(self, root: nn.Module) -> dict[str, nn.Module]:
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

    def materialize(self, model: nn.Module, root: nn.Module, device: torch.device, precision: str, sharded: bool, strict: bool = True) -> None:
        """Give a model built on the meta device storage on ``device``: ``sharded`` shard by
        shard (each rank its shards and one unit at a time), from ``pretrained`` weights or the
        model's own initialisers; otherwise whole on every rank (evaluation)."""
        parts = self.pretrained_parts(root)
        if not sharded:
            n = materialize_meta(model, device)
            self.info(f"AutoSP: initialised {n} tensors of the model built on the meta device on {device}")
            for attr, part in parts.items():
                load_whole(part, self.pretrained[attr], strict=strict)
            return
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

    def shard(self, model: nn.Module, precision: str) -> nn.Module:
        """Rank 0's initial values everywhere (as DDP does), then every parameter a DTensor shard."""
        broadcast_module(model)
        policy = self.policy(precision)
        n = shard_module(model, policy)
        dtypes = f", gathered in {policy.param_dtype}, reduced in {policy.reduce_dtype}" if policy.param_dtype else ""
        self.info(
            f"AutoSP: {sum(1 for _ in model.parameters())} parameters sharded as DTensors over {self.mesh} "
            f"(fsdp={self.config.mode!r}{dtypes}; {n} in setup)"
        )
        return model

    @staticmethod
    def is_sharded(module: Optional[nn.Module]) -> bool:
        return module is not None and is_sharded(module)

    @staticmethod
    def unshard(module: nn.Module) -> None:
        """Full parameters and the module's own classes back, on every rank."""
        unshard_module(module)

    # ------------------------------------------------------------------ checkpoints
    @staticmethod
    def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name, its tensors DTensors."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(module, optimizer)

    @staticmethod
    def save(checkpoint: Mapping[str, Any], path: Any, rank: int, barrier: Callable[[str], None]) -> None:
        """A torch distributed checkpoint directory (:mod:`autosp.checkpoint`)."""
        save_distributed(checkpoint, path, rank=rank, barrier=barrier)

    @staticmethod
    def load_model_state(module: nn.Module, state_dict: Mapping[str, Any], strict: bool, where: str) -> None:
        """Whole tensors (a single-file checkpoint) into the sharded module."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        check_fits(state_dict, module.state_dict(), strict, where)
        set_model_state_dict(module, dict(state_dict), options=StateDictOptions(full_state_dict=True, strict=strict))

    @staticmethod
    def load_optimizer_states(
        module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], states: Sequence[Mapping[str, Any]],
        names: Optional[Sequence[Sequence[str]]], where: str,
    ) -> None:
        """Whole optimizer states kept by position (a single-file checkpoint, with the parameter
        ``names`` AutoSP adds) into the sharded optimizers."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if names is None:
            raise AutoSPError(
                f"{where} holds optimizer state by position only (it was not written by AutoSPStrategy), and a sharded "
                "run needs it by parameter name. Resume it with fsdp=False, or load its weights into the module "
                "before fit and start the optimizer afresh."
            )
        for i, (optimizer, state) in enumerate(zip(optimizers, states)):
            named = named_optimizer_state(state, names[i], where)
            set_optimizer_state_dict(module, optimizer, named, options=StateDictOptions(full_state_dict=True))
