"""``AutoSPStrategy``: DeepSpeed-Ulysses sequence parallelism for unmodified Lightning modules.

A thin adapter from the Trainer's hooks to the framework-agnostic core (:mod:`autosp`): the
``dp x sp`` mesh (:mod:`autosp.mesh`), the compiled steps and their checks (:mod:`autosp.steps`)
and the mode that holds the parameters and writes checkpoints (:mod:`autosp.modes`), picked once
here and then only called. ``lightning_autosp.fabric.AutoSPStrategy`` is the same for Fabric.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Generator, Literal, Mapping, Optional, Sequence, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_autosp import module_hooks
from lightning_autosp._compat import load_checkpoint_kwargs
from autosp.arguments import check_arguments
from autosp.backend import CompiledStep
from autosp.compile_prep import Prepared, prepare_for_compile
from autosp.launch import prepare_rank
from autosp.mesh import SPGrid
from autosp.modes import make_mode
from autosp.passes.sac import SACConfig
from autosp.sampler import make_resumable
from autosp.steps import StepRunner

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

__all__ = ["AutoSPStrategy"]

_COMPILED_STEPS = ("training_step", "validation_step", "test_step", "predict_step")


class AutoSPStrategy(SPGrid, DDPStrategy):
    """Sequence parallelism (DeepSpeed-Ulysses, with a ring level where the heads or a node run
    out) applied by a compiler pass, on top of DDP.

    The world is a ``(dp, sp)`` grid: each SP group of ``sp_size`` contiguous ranks splits every
    sequence of its batch; SP groups are data-parallel replicas that see disjoint samples. In ``setup`` the module's ``training_step``, ``validation_step``,
    ``test_step`` and ``predict_step`` are compiled with the AutoSP backend, which rewrites the Dynamo graph (all-to-all around every
    ``F.scaled_dot_product_attention``, positions, label shifts and losses made right for each
    shard) before AOT autograd and ``compile_backend``. The loss a step returns and logs is the
    full-sequence loss, and gradients are those of one device on the full sequences. The
    module's ``log``/``log_dict`` and its torchmetrics objects run eagerly when a step calls
    them (a graph break each, not a recompile per step).

    Args:
        sp_size: ranks per SP group: a divisor of the devices per node, or a multiple of them (an SP
            group across nodes). ``None`` uses one SP group per node (``sp_size = devices``), or
            ``ulysses * ring`` of ``sp_layout``. Attention splits its heads over up to a node's
            ranks where they divide (Ulysses) and passes key/value blocks around a ring over the
            rest, so any ``sp_size`` works for any head count (28 heads at ``sp_size=8``:
            ``ulysses=4 x ring=2``); the layout is logged at the first compile.
        sp_layout: ``(ulysses, ring)``, overriding the automatic layout: Ulysses over ``ulysses``
            contiguous ranks (must divide the query heads), a ring over ``ring`` strided ranks;
            ``ulysses * ring`` is the SP group. YAML: ``sp_layout: [4, 2]``.
        compile_backend: the ``torch.compile`` backend run after the SP pass: ``"inductor"``
            (default), ``"aot_eager"`` (fast to compile, used by the tests) or ``"eager"`` (eager
            autograd: needs ``sac=False``).
        sac: sequence-aware activation checkpointing (needs ``compile_backend`` ``"inductor"`` or
            ``"aot_eager"``; with ``"eager"`` it is a ``ValueError``, not a silent no-op): the
            partitioner recomputes projections, MLPs and norms in backward
            instead of saving their outputs, while attention outputs (and what SDPA's backward
            needs) and every collective stay saved. Gradients are unchanged; no collective runs
            again in backward. ``"block"`` recomputes every transformer block (an element of a
            ``ModuleList``) whole from its input instead, attention and its all-to-alls included,
            and saves only what each block hands on (with ``activation_offload``: DeepSpeed ALST's
            scheme) - the least memory, for one more forward per block. ``False`` keeps
            PyTorch's default partition.
        sac_recompute: op kinds SAC recomputes, out of ``"linear"`` (matmuls and MLP
            activations), ``"norm"``, ``"embedding"``, ``"loss"``, ``"other"``; YAML:
            ``sac_recompute: [linear, norm]``.
        sac_memory_budget: the partitioner's ``activation_memory_budget`` in ``(0, 1]`` for what
            SAC leaves to it; ``1`` keeps its runtime-optimal choice, smaller values trade compute
            for memory (attention and collectives stay saved).
        seq_dim: the sequence dim of the batch's tensors (``[B, S]`` token ids: 1).
        fsdp: shard parameters, gradients and optimizer state (ZeRO-3 semantics,
            :mod:`autosp.modes.sharded.mode`) instead of a DDP replica per rank: ``True`` or
            ``"full"`` over every rank, ``"hybrid"`` over the ranks of each node with a replica per
            node. Every parameter is a ``DTensor`` under its own name with its global shape (so
            ``configure_optimizers``, clipping and norms see what they see on one device),
            all-gathered inside the compiled step and its gradient reduce-scattered. Modules built
            in ``configure_model`` or under ``Trainer.init_module()`` stay on ``meta`` until
            ``setup``; checkpoints are DCP directories that resume on any layout; after ``fit`` the
            module holds full parameters again. DDP's own arguments are refused with it.
        param_dtype: with ``fsdp``, the dtype parameters are gathered and computed in; ``None``
            follows ``Trainer(precision=...)`` (``"bf16-mixed"``: bfloat16, ``"16-mixed"``:
            float16, otherwise their own dtype). The shards (and the optimizer) stay in their
            own dtype (fp32 masters).
        reduce_dtype: with ``fsdp``, the dtype gradients are reduce-scattered in; ``None``:
            float32 where parameters are gathered in a lower precision.
        pretrained: with ``fsdp``, weights to start from per LightningModule attribute built in
            ``configure_model`` (``{"model": "/path/to/hf_model_dir"}``; ``""``: the module
            itself): a Hugging Face directory of ``*.safetensors``, a ``.safetensors`` file or a
            ``torch.save``-d state dict; each rank reads only its shards.
        chunked_loss: compute ``cross_entropy(linear(hidden, W_vocab), labels)`` in chunks of
            tokens, never the whole logits (:mod:`autosp.ops.fused_loss`; same loss and
            gradients), where nothing else in the step reads them: ``True`` sizes the chunks
            from the vocabulary, an int sets the tokens per chunk, ``False`` keeps the logits.
        tiled_attention: attention whose mask the model builds from positions (causal with padding,
            packed documents from restarting ``position_ids`` or document ids, sliding windows,
            ALiBi, soft-capping in hand-written attention) runs tile by tile with the mask
            evaluated per tile (:mod:`autosp.ops.tiled_attention`; same loss and gradients),
            so no ``S x S`` mask or score tensor exists and fully masked tiles are skipped: ``True``
            sizes the tiles automatically, an int sets the query rows and key columns per tile,
            ``False`` keeps such masks as dense ``S x S`` tensors on every rank. Plain causal
            attention (``is_causal=True``) keeps PyTorch's kernel either way.
        strict: an op the SP pass cannot run on the rank's tokens (it would all-gather its
            sequence-sharded inputs and run replicated: exact, but every rank then holds the whole
            sequence there) is an :class:`~lightning_autosp.AutoSPError` naming the op, its bytes
            per rank and the line that wrote it. ``False`` runs it replicated, with a warning
            when it holds 5% or more of the bytes the step saves for backward.
        activation_offload: move tensors the step saves for backward to host memory after
            forward computes them and back before backward reads them
            (:mod:`autosp.passes.offload`; same loss and gradients; needs
            ``compile_backend`` ``"inductor"`` or ``"aot_eager"``): ``"auto"`` (default) only
            as far as ``memory_budget`` requires, the earliest-saved first, and nothing without a
            ``memory_budget``; ``True`` every saved activation; ``False`` none. On CUDA the host
            buffers are pinned and the copies are queued on the compute stream (not yet overlapped
            with compute).
        memory_budget: bytes of saved activations per rank that may stay on the device, as a
            number or a string (``"40GB"``, ``"37.5GiB"``); ``lightning-autosp plan`` suggests one.
        **kwargs: every :class:`~lightning.pytorch.strategies.DDPStrategy` argument
            (``process_group_backend``, ``start_method``, ``timeout``, DDP kwargs such as
            ``find_unused_parameters``...).

    The module can read its place in the layout from ``self.trainer.strategy``
    (:attr:`sp_size`, :attr:`sp_rank`, :attr:`sp_group`, :attr:`dp_size`, :attr:`dp_rank`,
    :attr:`dp_group`) or ``self.device_mesh`` (dims ``"dp"`` and ``"sp"``).

    What was compiled, and what each training graph saves for backward, is read from
    :attr:`compiled_steps` (used by :class:`~lightning_autosp.ActivationMemoryMonitor`).
    """

    strategy_name = "autosp"

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
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        ddp_comm_state: Optional[object] = None,
        ddp_comm_hook: Optional[Callable] = None,
        ddp_comm_wrapper: Optional[Callable] = None,
        model_averaging_period: Optional[int] = None,
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
        self._mode.refuse_ddp_arguments(
            dict(ddp_comm_state=ddp_comm_state, ddp_comm_hook=ddp_comm_hook, ddp_comm_wrapper=ddp_comm_wrapper, model_averaging_period=model_averaging_period, **kwargs),
            fsdp,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._sp_size_arg = sp_size
        self.compile_backend, self.sac, self.seq_dim = compile_backend, sac, seq_dim
        self.sac_config = self._step_config.sac or SACConfig(recompute=tuple(sac_recompute), memory_budget=sac_memory_budget)
        self.fsdp, self.chunked_loss, self.tiled_attention, self.strict = fsdp, chunked_loss, tiled_attention, strict
        self.activation_offload, self.memory_budget, self.tiled_mlp = activation_offload, memory_budget, tiled_mlp
        self._device_mesh: Optional["DeviceMesh"] = None
        self._runner: Optional[StepRunner] = None
        self._eager_calls: list[tuple[Any, str, Any]] = []
        self._prepared: list[Prepared] = []  # what prepare_for_compile changed, undone at teardown
        self._restored_by_strategy = False  # the last load_checkpoint loaded model and optimizers itself

    @property
    def loss_chunk(self) -> Optional[int]:
        """Tokens per chunk of the fused vocabulary loss as the SP pass takes them (``0``: sized
        from the vocabulary, ``None``: off), from ``chunked_loss``."""
        return self._step_config.loss_chunk

    @property
    def compiled_steps(self) -> Mapping[str, CompiledStep]:
        """What AutoSP compiled, per step method (``"training_step"``, ``"validation_step"``,
        ``"test_step"``, ``"predict_step"``), from ``setup`` until ``teardown``: a read-only
        mapping of :class:`~autosp.backend.CompiledStep` snapshots taken when the
        property is read - per graph, what the SP pass did (``pass_stats``; summed in
        ``sdpa_rewritten``, ``all_to_alls``, ``fallbacks``) and, with an AOT ``compile_backend``,
        what each training graph saves for backward (``saved_activations``;
        ``saved_bytes_by_kind(since=earlier_snapshot)`` sums the calls in between)."""
        return StepRunner.empty_view() if self._runner is None else self._runner.compiled_steps

    @override
    def _configure_launcher(self) -> None:
        self._validated_layout()  # in the launching process, before any worker starts
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._validated_layout()
        assert self.lightning_module is not None
        prepare_rank(self._start_method, self.lightning_module)
        super().setup_environment()
        layout = self._build_grid(self.root_device.type, self._timeout, self._mode)
        self.lightning_module._device_mesh = self._device_mesh
        rank_zero_info(self._grid_summary(layout))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training loaders continue an interrupted epoch where a checkpoint stopped
        (:class:`~autosp.sampler.ResumableOrder`)."""
        dataloader = super().process_dataloader(dataloader)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.training:
            epoch_loop = trainer.fit_loop.epoch_loop
            make_resumable(dataloader, lambda: (trainer.current_epoch, epoch_loop.batch_progress.current.ready))
        return dataloader

    # ------------------------------------------------------------------ the module: the mode's
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """With ``fsdp``, modules built in ``configure_model`` or under ``Trainer.init_module()``
        go to the ``meta`` device (no memory) unless ``empty_init=False``; ``setup`` gives them
        storage on the root device, runs the model's own initialisers and shards them."""
        with self._mode.init_context(empty_init, ddp=partial(super().tensor_init_context, empty_init), precision=self.precision_plugin.tensor_init_context):
            yield

    @override
    def model_to_device(self) -> None:
        """Sharded: a model built on the meta device gets its values shard by shard - read from
        ``pretrained`` weights, or from its own initialisers one unit at a time - so no rank holds
        more of it than its shards and one unit (whole for validate/test/predict)."""
        assert self.model is not None and self.lightning_module is not None
        module = self.lightning_module
        self._mode.check_pretrained(module)  # refused before anything moves
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        self._mode.model_to_device(self.model, module, self.root_device, self.precision_plugin.precision, fitting, module.strict_loading, ddp=super().model_to_device)

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self._mode.setup_module(model, self.precision_plugin.precision, ddp=super()._setup_model)

    @override
    def on_train_end(self) -> None:
        """The module leaves ``fit`` as the user gave it: full parameters, its own classes."""
        super().on_train_end()
        self._mode.leave(self.lightning_module)

    @override
    def _register_ddp_hooks(self) -> None:
        self._mode.ddp_only(super()._register_ddp_hooks)

    # ------------------------------------------------------------------ checkpoints: the mode's
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # a distributed checkpoint is read into the module and the optimizers once they exist
        return True

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Sharded: the optimizer's state keyed by parameter name, its tensors DTensors."""
        return self._mode.optimizer_state(self.lightning_module, getattr(optimizer, "_optimizer", optimizer), ddp=super().optimizer_state)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Sharded (``fsdp`` during ``fit``): a torch distributed checkpoint directory at
        ``filepath`` (:mod:`autosp.checkpoint`); no rank gathers the model. Otherwise Lightning's
        single file, with the optimizer's parameter names added so that a sharded run can resume
        from it."""
        write_file = partial(super().save_checkpoint, filepath=filepath, storage_options=storage_options)
        self._mode.save(
            _loader_states_aside(checkpoint), filepath, self.lightning_module, self._torch_optimizers(), self.global_rank,
            self.barrier, write_file, storage_options,
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A distributed checkpoint (a directory) is read here, into the module and the
        optimizers, sharded or replicated, on any layout; a single file as Lightning reads it
        (into the module by :meth:`load_model_state_dict`)."""
        module = self.lightning_module
        assert module is not None
        read_file = partial(super().load_checkpoint, **load_checkpoint_kwargs(weights_only))
        checkpoint, self._restored_by_strategy = self._mode.load(checkpoint_path, module, self._torch_optimizers(), module.strict_loading, weights_only, read_file)
        return _loader_states_back(checkpoint)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._restored_by_strategy:
            self._mode.load_model_state(self.lightning_module, checkpoint["state_dict"], strict, self._ckpt_path())

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._restored_by_strategy:
            self._mode.load_optimizer_states(self.lightning_module, self._torch_optimizers(), checkpoint, self._ckpt_path())

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        return [getattr(o, "_optimizer", o) for o in self.optimizers]

    def _ckpt_path(self) -> str:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return str(getattr(trainer, "ckpt_path", None) or "the checkpoint")

    # ------------------------------------------------------------------ compile
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        module = self.lightning_module
        assert module is not None
        if self._runner is None:
            self._runner = StepRunner(self._runner_config(), self.sp_size, self.sp_rank, self.sp_group, self.root_device)
        self._prepared.append(prepare_for_compile(module))
        for name in _COMPILED_STEPS:
            if name not in module.__dict__:  # (compiled already by an earlier stage)
                setattr(module, name, self._runner.compile(name, getattr(module, name)))
        if not self._eager_calls:  # (as the steps: once until teardown)
            self._eager_calls = module_hooks.keep_out_of_graphs(module)
            hook = "on_before_optimizer_step"  # (only sharded parameters raise what it explains)
            self._eager_calls.append((module, hook, module.__dict__.get(hook, module_hooks.ABSENT)))
            setattr(module, hook, module_hooks.explaining_dtensor_errors(getattr(module, hook), hook))

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        if trainer is not None and trainer.state.status == TrainerStatus.RUNNING:
            # a fit that ran no epoch (resumed at max_steps) ends without on_train_end; not after
            # an exception, where a peer may never reach this collective
            self._mode.leave(module)
        if module is not None:
            for name in _COMPILED_STEPS:
                module.__dict__.pop(name, None)
        module_hooks.restore(self._eager_calls)
        module_hooks.drop_deferred()
        self._eager_calls = []
        for prepared in self._prepared:
            prepared.undo()
        self._prepared = []
        self._runner = None
        super().teardown()

    def _run_step(self, step: str, parent: Callable, *args: Any, **kwargs: Any) -> Any:
        assert self._runner is not None
        where = f"{type(self.lightning_module).__name__}.{step}"
        try:
            out = self._runner.run(step, where, parent, args[0] if args else None, *args, **kwargs)
        except BaseException:
            module_hooks.drop_deferred()
            raise
        module_hooks.replay_deferred()  # the step's self.log calls (module_hooks)
        return out

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("training_step", super().training_step, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("validation_step", super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("test_step", super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("predict_step", super().predict_step, *args, **kwargs)


#: where Lightning keeps the states of a fit's stateful training loaders in a checkpoint
_FIT_LOOP_STATE = ("loops", "fit_loop", "state_dict")


def _fit_loop_state(checkpoint: dict[str, Any]) -> Optional[dict[str, Any]]:
    holder: Any = checkpoint
    for key in _FIT_LOOP_STATE:
        holder = holder.get(key) if isinstance(holder, dict) else None
    return holder if isinstance(holder, dict) else None


def _loader_states_aside(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint to write: the training loader's position (the state of AutoSP's resumable
    sample order, which Lightning saves as its loop's ``combined_loader`` states) moved under
    ``checkpoint["autosp"]``, so that another strategy, whose loaders have no such state, resumes
    from the checkpoint too (Lightning refuses a loader state no loader takes). The caller's dict
    is left as it was."""
    holder = _fit_loop_state(checkpoint)
    states = holder.get("combined_loader") if holder is not None else None
    if not states:
        return checkpoint
    loops = dict(checkpoint["loops"])
    loops["fit_loop"] = {**loops["fit_loop"], "state_dict": {**holder, "combined_loader": []}}
    return {**checkpoint, "loops": loops, "autosp": {**checkpoint.get("autosp", {}), "loader_states": states}}


def _loader_states_back(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint read for AutoSP: the loader position :func:`_loader_states_aside` moved put
    back where Lightning's loop restores it (in place)."""
    states = (checkpoint.get("autosp") or {}).get("loader_states")
    holder = _fit_loop_state(checkpoint)
    if states and holder is not None and not holder.get("combined_loader"):
        holder["combined_loader"] = states
    return checkpoint
