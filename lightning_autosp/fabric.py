"""``lightning_autosp.fabric.AutoSPStrategy``: AutoSP for Lightning Fabric loops (LitGPT's kind).

Fabric has no ``training_step`` to compile, so the loop marks what AutoSP compiles - the loss
computation, model forward and loss together, so that the logits never leave the graph whole::

    fabric = L.Fabric(strategy=AutoSPStrategy(sp_size=2), devices=4)   # or strategy="autosp"
    fabric.launch()
    with fabric.init_module(empty_init=True):      # fsdp=True: on the meta device
        model = GPT(config)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    loader = fabric.setup_dataloaders(loader)       # samples split over the DP axis only

    @fabric.strategy.compile_step
    def loss_fn(model, tokens):
        logits = model(tokens[:, :-1])
        return chunked_cross_entropy(logits, tokens[:, 1:])

    for tokens in loader:
        loss = loss_fn(model, tokens)               # the full-sequence loss, on every rank
        fabric.backward(loss)
        ...

Everything else is Fabric's DDP strategy - or, with ``fsdp=True``/``"hybrid"``, the sharded mode
(:mod:`autosp.modes.sharded`): parameters DTensors under their own names and shapes,
``fabric.clip_gradients`` over them, ``fabric.save``/``fabric.load`` as DCP directories in the
format the Trainer strategy writes (a replicated run: one file, likewise), so a run can move
between the two and between layouts.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Optional, Sequence, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.ddp import _DDPBackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_autosp._compat import FABRIC_SETUP_PASSES_SCHEDULER
from autosp.arguments import check_arguments
from autosp.backend import CompiledStep
from autosp.compile_prep import Prepared, prepare_for_compile
from autosp.errors import AutoSPError
from autosp.launch import prepare_rank
from autosp.mesh import SPGrid
from autosp.modes import make_mode
from autosp.modes.sharded.materialize import has_meta_tensors
from autosp.modes.sharded.values import whole
from autosp.steps import StepRunner

if TYPE_CHECKING:
    from lightning.fabric.strategies.registry import _StrategyRegistry
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["AutoSPStrategy"]


class AutoSPStrategy(SPGrid, DDPStrategy):
    """Sequence parallelism (DeepSpeed-Ulysses, applied by AutoSP's compiler pass) for Fabric.

    Takes the arguments of the Trainer's :class:`lightning_autosp.AutoSPStrategy` of the same
    names (``sp_size``, ``compile_backend``, ``sac``, ``sac_recompute``, ``sac_memory_budget``,
    ``seq_dim``, ``fsdp``, ``param_dtype``, ``reduce_dtype``, ``pretrained`` - keyed by attribute of
    the module given to ``fabric.setup``, ``""`` for the module itself -, ``chunked_loss``,
    ``tiled_attention``, ``strict``, ``activation_offload``, ``memory_budget``, ``tiled_mlp``,
    ``sp_layout``) and
    Fabric's DDP strategy's. Compile the loss computation with :meth:`compile_step`.
    """

    def __init__(
        self,
        sp_size: Optional[int] = None,
        compile_backend: str = "inductor",
        sac: Union[bool, str] = True,
        sac_recompute: Sequence[str] = ("linear", "norm"),
        sac_memory_budget: float = 1.0,
        seq_dim: int = 1,
        fsdp: Union[bool, str] = False,
        param_dtype: Optional[Union[str, torch.dtype]] = None,
        reduce_dtype: Optional[Union[str, torch.dtype]] = None,
        pretrained: Optional[dict[str, str]] = None,
        chunked_loss: Union[bool, int] = True,
        tiled_attention: Union[bool, int] = True,
        strict: bool = False,
        activation_offload: Union[bool, str] = "auto",
        memory_budget: Optional[Union[int, float, str]] = None,
        tiled_mlp: Union[bool, int] = True,
        sp_layout: Optional[tuple[int, int]] = None,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        self._step_config, config = check_arguments(
            sp_size, compile_backend, sac, sac_recompute, sac_memory_budget, seq_dim, fsdp, param_dtype, reduce_dtype,
            pretrained, chunked_loss, tiled_attention, strict, activation_offload, memory_budget,
            tiled_mlp, sp_layout,
        )
        self._mode = make_mode(config, pretrained, rank_zero_info)
        self._mode.refuse_ddp_arguments(kwargs, fsdp)
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision=precision, process_group_backend=process_group_backend,
            timeout=timeout, start_method=start_method, **kwargs,
        )
        self._sp_size_arg = sp_size
        self._backward_sync_control = self._mode.ddp_only(_BackwardSync)
        self._device_mesh: Optional["DeviceMesh"] = None
        self._runner: Optional[StepRunner] = None
        self._prepared: list[Prepared] = []  # what prepare_for_compile changed, undone at teardown

    @property
    def compiled_steps(self) -> Mapping[str, CompiledStep]:
        """What AutoSP compiled, per function given to :meth:`compile_step` (by its name)."""
        return StepRunner.empty_view() if self._runner is None else self._runner.compiled_steps

    @override
    def _configure_launcher(self) -> None:
        self._validated_layout()  # in the launching process, before any worker starts
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._validated_layout()
        prepare_rank(self._start_method)  # (Fabric's modules are built after the launch, in each rank)
        super().setup_environment()
        layout = self._build_grid(self.root_device.type, self._timeout, self._mode)
        self._runner = StepRunner(self._runner_config(), self.sp_size, self.sp_rank, self.sp_group, self.root_device)
        rank_zero_info(self._grid_summary(layout))

    # ------------------------------------------------------------------ the compiled step
    def compile_step(self, fn: Callable) -> Callable:
        """``fn`` (the model's forward *and* its loss; called as ``fn(model, batch, ...)``)
        compiled with AutoSP: the returned function checks the batch agrees over the SP group,
        marks its sequence dims dynamic, runs the rewritten graph and returns the full-sequence
        loss. Use it as a decorator or call it. Compiling only the model would return sharded
        logits all-gathered to every rank: pass the function that computes the loss."""
        if self._runner is None:
            raise RuntimeError("AutoSPStrategy.compile_step: call `fabric.launch()` first (the SP groups are built there).")
        if isinstance(fn, torch.nn.Module):
            raise AutoSPError(
                f"AutoSPStrategy.compile_step({type(fn).__name__}): pass the function that computes the loss from the "
                "model and the batch (`def loss_fn(model, batch): return loss(model(batch[...]), ...)`), not the model: "
                "a compiled model alone returns its logits, which AutoSP would all-gather to every rank whole."
            )
        name = getattr(fn, "__name__", "step")
        if name in self._runner.backends:
            name = f"{name}_{len(self._runner.backends)}"
        compiled = self._runner.compile_step(name, fn)
        warned: list[bool] = []

        def step(*args: Any, **kwargs: Any) -> Any:
            _refuse_compiled_modules(name, (*args, *kwargs.values()))
            out = compiled(*args, **kwargs)
            if not warned and _holds_sequence(out, self._runner.marked_length):
                warned.append(True)
                rank_zero_warn(
                    f"AutoSP: `{name}` returned a tensor as long as the sequence, all-gathered to every rank whole. "
                    "Compute the loss inside the compiled function and return it (and only small tensors) instead."
                )
            return out

        step.__wrapped__ = fn  # type: ignore[attr-defined]
        return step

    # ------------------------------------------------------------------ modules: the mode's
    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """With ``fsdp``, modules built under ``fabric.init_module()`` go to the ``meta`` device
        (no memory) unless ``empty_init=False``; ``fabric.setup`` initialises them shard by shard."""
        return self._mode.init_context(empty_init, ddp=partial(super().module_init_context, empty_init), precision=self.precision.module_init_context)

    @override
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Replicated: DDP (a model built on meta gets its values from its own initialisers
        first). Sharded: parameters become DTensor shards, read from ``pretrained`` or initialised
        one unit at a time."""
        self._prepared.append(prepare_for_compile(module))
        precision = getattr(self.precision, "precision", "32-true")
        self._mode.model_to_device(module, module, self.root_device, precision, shard=True, strict=True, ddp=_moved_by_fabric)
        return self._mode.setup_module(module, precision, ddp=super().setup_module)

    @override
    def setup_module_and_optimizers(self, module: torch.nn.Module, optimizers: list[Any], scheduler: Optional[Any] = None) -> tuple:
        """``fabric.setup(model, optimizer)``. Sharded, the optimizers were built over the
        parameters before sharding (on the meta device, even): they are pointed at the DTensor
        parameters that replace them, by name."""
        ddp = partial(super().setup_module_and_optimizers, module, optimizers, *_scheduler(scheduler))
        module, optimizers = self._mode.setup_module_and_optimizers(module, optimizers, self.setup_module, ddp)
        return (module, optimizers, *_scheduler(scheduler))

    @override
    def module_to_device(self, module: torch.nn.Module) -> None:
        if not has_meta_tensors(module):  # a meta module gets its storage in setup_module
            super().module_to_device(module)

    @override
    def clip_gradients_norm(self, module: torch.nn.Module, optimizer: Any, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """The total norm of the whole model's gradients (sharded: over every shard), as on one device."""
        return whole(super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite))

    # ------------------------------------------------------------------ checkpoints: the mode's
    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None, filter: Optional[dict] = None) -> None:
        """The Trainer strategy's format: sharded, a DCP directory (the module's state dict under
        ``"state_dict"``, each optimizer keyed by parameter name, the rest in ``meta.pt``);
        replicated, one file with ``"state_dict"``, ``"optimizer_states"`` and the optimizers'
        parameter names. ``state`` holds one module, its optimizers and anything else."""
        if storage_options is not None or filter is not None:
            raise TypeError("AutoSPStrategy.save_checkpoint writes checkpoints itself: storage_options and filter are not supported.")
        module, optimizers, rest = _split_state(state)
        checkpoint = {
            "state_dict": module.state_dict(),
            "optimizer_states": [self._mode.optimizer_state(module, o, ddp=lambda o: o.state_dict()) for o in optimizers.values()],
            **rest,
            "autosp": {"fabric_state": _keys(state, optimizers)},
        }
        self._mode.save(checkpoint, path, module, list(optimizers.values()), self.global_rank, self.barrier)

    @override
    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Reads what :meth:`save_checkpoint` (or the Trainer strategy) wrote into the module and
        optimizers of ``state``, on any layout, sharded or not; the other entries of ``state``
        are updated in place and what the checkpoint holds beyond them is returned."""
        if not isinstance(state, dict):
            raise TypeError("AutoSPStrategy.load_checkpoint: pass the state dict you saved ({'model': model, 'optimizer': optimizer, ...}).")
        module, optimizers, rest = _split_state(state)
        meta = self._mode.restore(path, module, list(optimizers.values()), strict, weights_only)
        for key in ("state_dict", "optimizer_states", "autosp"):
            meta.pop(key, None)
        for key in rest:
            if key in meta:
                state[key] = meta.pop(key)
        return meta

    @override
    def teardown(self) -> None:
        for prepared in self._prepared:
            prepared.undo()
        self._prepared = []
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: "_StrategyRegistry") -> None:
        strategy_registry.register("autosp", cls, description="AutoSP sequence parallelism (lightning-autosp)")


def _scheduler(scheduler: Any) -> tuple:
    """The scheduler as Fabric's ``setup_module_and_optimizers`` takes and returns it (Lightning >= 2.6)."""
    return (scheduler,) if FABRIC_SETUP_PASSES_SCHEDULER else ()


class _BackwardSync(_DDPBackwardSyncControl):
    """``fabric.no_backward_sync``: DDP's; the sharded mode reduce-scatters inside the step (no wrapper to block)."""

    @override
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled or not isinstance(module, DistributedDataParallel):
            return nullcontext()
        return module.no_sync()


def _moved_by_fabric() -> None:
    """A replica's move to the device: Fabric's own, before ``setup_module`` (:meth:`AutoSPStrategy.module_to_device`)."""


def _split_state(state: Mapping[str, Any]) -> tuple[torch.nn.Module, dict[str, Any], dict[str, Any]]:
    """(the one module, the optimizers by key, everything else) of a Fabric state dict."""
    modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    if len(modules) != 1:
        raise AutoSPError(
            f"AutoSPStrategy saves and loads one module with its optimizers; the state holds {len(modules)} "
            f"({sorted(modules)}). Save further modules' state dicts as entries of their own."
        )
    (module,) = modules.values()
    module = getattr(module, "_forward_module", module)  # a _FabricModule's
    module = module.module if isinstance(module, DistributedDataParallel) else module
    optimizers = {k: getattr(v, "optimizer", v) for k, v in state.items() if isinstance(getattr(v, "optimizer", v), torch.optim.Optimizer)}
    rest = {k: v for k, v in state.items() if k not in modules and k not in optimizers}
    return module, optimizers, rest


def _keys(state: Mapping[str, Any], optimizers: Mapping[str, Any]) -> dict[str, Any]:
    module_key = next(k for k, v in state.items() if isinstance(v, torch.nn.Module))
    return {"module": module_key, "optimizers": list(optimizers)}


def _refuse_compiled_modules(name: str, args: Sequence[Any]) -> None:
    """A model compiled by the user runs as a compiled region of its own, outside the graph
    AutoSP rewrites (Fabric re-applies a ``torch.compile`` after ``fabric.setup``)."""
    from torch._dynamo import OptimizedModule

    for a in args:
        while isinstance(a, torch.nn.Module) and not isinstance(a, OptimizedModule):  # through Fabric's and DDP's wrappers
            inner = getattr(a, "_forward_module", None) or (a.module if isinstance(a, DistributedDataParallel) else None)
            if inner is None:
                break
            a = inner
        if isinstance(a, OptimizedModule):
            raise AutoSPError(
                f"AutoSPStrategy.compile_step: `{name}` is given a model compiled with torch.compile (Fabric compiles it "
                "again after `fabric.setup`): it would run as a compiled region of its own, outside the graph AutoSP "
                "rewrites, unsplit. Give fabric.setup the model uncompiled: AutoSP compiles the whole step."
            )


def _holds_sequence(out: Any, length: Optional[int]) -> bool:
    """Whether ``out`` holds a tensor with a dim of the batch's sequence length."""
    if length is None:
        return False
    leaves = out if isinstance(out, (tuple, list)) else out.values() if isinstance(out, dict) else [out]
    return any(isinstance(t, torch.Tensor) and t.dim() > 1 and length in t.shape[1:] for t in leaves)


def _register() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    if "autosp" not in STRATEGY_REGISTRY:  # Fabric(strategy="autosp")
        AutoSPStrategy.register_strategies(STRATEGY_REGISTRY)


_register()
