"""``AutoSPStrategy``: DeepSpeed-Ulysses sequence parallelism for unmodified Lightning modules."""

from __future__ import annotations

import functools
import logging
from collections import Counter
from contextlib import contextmanager
from datetime import timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Generator, Literal, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError
from torch.utils._pytree import keystr, tree_flatten_with_path
from typing_extensions import override

from lightning_autosp._compat import graph_break_counter, load_checkpoint_kwargs
from lightning_autosp.backend import AOT_BACKENDS, SUPPORTED_BACKENDS, AutoSPBackend, CompiledStep
from lightning_autosp.batch_agreement import check_sp_batch_agreement
from lightning_autosp.checkpoint import (
    check_fits,
    is_distributed_checkpoint,
    load_distributed,
    named_optimizer_state,
    optimizer_param_names,
    save_distributed,
)
from lightning_autosp.errors import AutoSPError
from lightning_autosp.fsdp import DDP_ONLY_ARGUMENTS, FSDPConfig, ShardingPolicy, broadcast_module, is_sharded, shard_module, unshard_module, whole
from lightning_autosp.layout import SPLayout, check_sequence_fits, validate_layout, validate_sp_size
from lightning_autosp.launch import prepare_rank
from lightning_autosp.passes.sac import SACConfig
from lightning_autosp.sampler import make_resumable
from lightning_autosp.sharded_init import has_meta_tensors, load_pretrained, load_whole, materialize_meta, materialize_sharded, move_real_tensors

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

__all__ = ["AutoSPStrategy"]

_COMPILED_STEPS = ("training_step", "validation_step", "test_step", "predict_step")


class AutoSPStrategy(DDPStrategy):
    """Sequence parallelism (DeepSpeed-Ulysses) applied by a compiler pass, on top of DDP.

    The world is a ``(dp, sp)`` grid: each SP group of ``sp_size`` contiguous ranks (inside one
    node) splits every sequence of its batch; SP groups are data-parallel replicas that see
    disjoint samples. In ``setup`` the module's ``training_step``, ``validation_step``,
    ``test_step`` and ``predict_step`` are compiled with the AutoSP backend, which rewrites the Dynamo graph (all-to-all around every
    ``F.scaled_dot_product_attention``, positions, label shifts and losses made right for each
    shard) before AOT autograd and ``compile_backend``. The loss a step returns and logs is the
    full-sequence loss, and gradients are those of one device on the full sequences. The
    module's ``log``/``log_dict`` and its torchmetrics objects run eagerly when a step calls
    them (a graph break each, not a recompile per step).

    Args:
        sp_size: ranks per SP group. Must divide the devices per node (and so the world size).
            ``None`` uses one SP group per node (``sp_size = devices``).
        compile_backend: the ``torch.compile`` backend run after the SP pass: ``"inductor"``
            (default), ``"aot_eager"`` (fast to compile, used by the tests) or ``"eager"`` (eager
            autograd: needs ``sac=False``).
        sac: sequence-aware activation checkpointing (needs ``compile_backend`` ``"inductor"`` or
            ``"aot_eager"``; with ``"eager"`` it is a ``ValueError``, not a silent no-op): the
            partitioner recomputes projections, MLPs and norms in backward
            instead of saving their outputs, while attention outputs (and what SDPA's backward
            needs) and every collective stay saved. Gradients are unchanged; no collective runs
            again in backward. ``False`` keeps PyTorch's default partition.
        sac_recompute: op kinds SAC recomputes, out of ``"linear"`` (matmuls and MLP
            activations), ``"norm"``, ``"embedding"``, ``"loss"``, ``"other"``; YAML:
            ``sac_recompute: [linear, norm]``.
        sac_memory_budget: the partitioner's ``activation_memory_budget`` in ``(0, 1]`` for what
            SAC leaves to it; ``1`` keeps its runtime-optimal choice, smaller values trade compute
            for memory (attention and collectives stay saved).
        seq_dim: the sequence dim of the batch's tensors (``[B, S]`` token ids: 1).
        fsdp: shard parameters, gradients and optimizer state (ZeRO-3 semantics,
            :mod:`lightning_autosp.fsdp`) instead of a DDP replica per rank: ``True`` or ``"full"``
            over every rank of the ``dp x sp`` world, ``"hybrid"`` over the ranks of each node with
            a replica per node (parameters gathered over intra-node links only). Every parameter
            is a ``DTensor`` under the model's own name, with its global shape; its gradient and
            the optimizer's elementwise state are DTensors too, so ``configure_optimizers``,
            ``clip_grad_norm_`` / ``gradient_clip_val`` and norms see what they see on one
            device. The parameters are all-gathered inside the compiled step (with ``sac=True``
            gathered again in backward rather than saved) and their gradients
            reduce-scattered; losses and parameters stay those of one device. At the end of
            ``fit`` the module gets its full parameters back (gathered on every rank), so
            ``trainer.validate``/``test`` and saving the model work as after DDP. Modules built in
            ``configure_model`` or under ``Trainer.init_module()`` stay on the ``meta`` device
            until ``setup`` initialises them (see :meth:`tensor_init_context`). Checkpoints saved
            during ``fit`` are torch distributed checkpoint (DCP) directories
            (:mod:`lightning_autosp.checkpoint`) that resume on any layout, sharded or not. The
            DDP wrapper's own arguments (``ddp_comm_hook``, ``find_unused_parameters``, ...) are
            refused with it.
        param_dtype: with ``fsdp``, the dtype parameters are gathered and computed in; ``None``
            follows ``Trainer(precision=...)`` (``"bf16-mixed"``: bfloat16, ``"16-mixed"``:
            float16, otherwise their own dtype). The shards (and the optimizer) stay in their
            own dtype (fp32 masters).
        reduce_dtype: with ``fsdp``, the dtype gradients are reduce-scattered in; ``None``:
            float32 where parameters are gathered in a lower precision.
        pretrained: with ``fsdp``, weights to start from, per LightningModule attribute built in
            ``configure_model`` (``{"model": "/path/to/hf_model_dir"}``; ``""``: the module
            itself): a Hugging Face directory of ``*.safetensors`` files, a ``.safetensors``
            file, or a ``torch.save``-d state dict; keys as the attribute's ``state_dict()``
            names them. Each rank reads only the rows of its own shards
            (:func:`lightning_autosp.sharded_init.load_pretrained`).
        chunked_loss: compute ``cross_entropy(linear(hidden, W_vocab), labels)`` in chunks of
            tokens so the ``tokens x vocabulary`` logits are never live whole
            (:mod:`lightning_autosp.fused_loss`; same loss and gradients). ``True`` (default)
            sizes the chunks from the vocabulary (about 256 MiB of fp32 logits each), an int sets
            the tokens per chunk, ``False`` keeps the logits. Applied only where nothing else in
            the step reads the logits (a step that returns or logs them keeps them).
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
        sac: bool = True,
        sac_recompute: Sequence[str] = ("linear", "norm"),
        sac_memory_budget: float = 1.0,
        seq_dim: int = 1,
        fsdp: Union[bool, str] = False,
        param_dtype: Optional[Union[str, torch.dtype]] = None,
        reduce_dtype: Optional[Union[str, torch.dtype]] = None,
        pretrained: Optional[dict[str, str]] = None,
        chunked_loss: Union[bool, int] = True,
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
        validate_sp_size(sp_size)
        if compile_backend not in SUPPORTED_BACKENDS:
            raise ValueError(
                f"AutoSPStrategy(compile_backend={compile_backend!r}): choose one of {list(SUPPORTED_BACKENDS)}."
            )
        if sac and compile_backend not in AOT_BACKENDS:
            raise ValueError(
                f"AutoSPStrategy(compile_backend={compile_backend!r}, sac=True): sequence-aware activation "
                f"checkpointing partitions the AOT joint graph, which only {list(AOT_BACKENDS)} build "
                f"({compile_backend!r} keeps autograd eager). Pass sac=False to compile with {compile_backend!r}, "
                "or compile_backend='aot_eager' or 'inductor' to keep SAC."
            )
        self._fsdp = FSDPConfig.from_arguments(fsdp, param_dtype, reduce_dtype)
        if pretrained is not None and (self._fsdp is None or not isinstance(pretrained, dict)):
            raise ValueError(
                f"AutoSPStrategy(pretrained={pretrained!r}): pass a dict from a LightningModule attribute built in "
                "configure_model to its weights ({'model': '/path/to/hf_model_dir'}; '' for the LightningModule itself), "
                "with fsdp=True or 'hybrid': each rank then reads only its shards."
            )
        self._pretrained = dict(pretrained or {})
        if self._fsdp is not None:
            given = dict(ddp_comm_state=ddp_comm_state, ddp_comm_hook=ddp_comm_hook, ddp_comm_wrapper=ddp_comm_wrapper, model_averaging_period=model_averaging_period)
            ddp_only = [name for name in DDP_ONLY_ARGUMENTS if given[name] is not None] + sorted(kwargs)
            if ddp_only:
                raise ValueError(
                    f"AutoSPStrategy(fsdp={fsdp!r}) does not use PyTorch's DistributedDataParallel, so its arguments "
                    f"{ddp_only} would do nothing: the sharded mode reduce-scatters gradients inside the compiled step. "
                    "Remove them, or pass fsdp=False to train DDP replicas."
                )
        if not isinstance(seq_dim, int) or seq_dim < 1:
            raise ValueError(
                f"AutoSPStrategy(seq_dim={seq_dim!r}): the sequence dim must be an int >= 1 (dim 0 is the batch)."
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
        self.compile_backend = compile_backend
        self.sac = sac
        self.sac_config = SACConfig(recompute=tuple(sac_recompute), memory_budget=sac_memory_budget)
        self.seq_dim = seq_dim
        self.fsdp = fsdp
        if not isinstance(chunked_loss, bool) and not (isinstance(chunked_loss, int) and chunked_loss > 0):
            raise ValueError(
                f"AutoSPStrategy(chunked_loss={chunked_loss!r}): pass True (chunks sized from the vocabulary), "
                "a positive number of tokens per chunk, or False (keep the full logits)."
            )
        self.chunked_loss = chunked_loss
        self._device_mesh: Optional["DeviceMesh"] = None
        self._backends: dict[str, AutoSPBackend] = {}
        self._checked: set[str] = set()
        self._eager_calls: list[tuple[Any, str, Any]] = []
        self._marked: list[str] = []  # the batch dims the last step marked as sequence dims
        self._diverged: set[str] = set()  # steps whose SP ranks compiled different graphs (warned)
        self._shard_mesh: Optional["DeviceMesh"] = None  # the mesh parameters are sharded over (fsdp)
        self._restored_by_strategy = False  # the last load_checkpoint loaded model and optimizers itself

    @property
    def loss_chunk(self) -> Optional[int]:
        """Tokens per chunk of the fused vocabulary loss as the SP pass takes them (``0``: sized
        from the vocabulary, ``None``: off), from ``chunked_loss``."""
        if isinstance(self.chunked_loss, bool):
            return 0 if self.chunked_loss else None
        return self.chunked_loss

    # ------------------------------------------------------------------ layout
    @property
    def sp_size(self) -> int:
        return self._sp_size_arg if self._sp_size_arg is not None else max(self.num_processes, 1)

    @property
    def layout(self) -> SPLayout:
        return SPLayout(self.num_nodes * self.num_processes, self.sp_size)

    @property
    def sp_rank(self) -> int:
        return self.layout.sp_rank(self.global_rank)

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.global_rank)

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def device_mesh(self) -> "DeviceMesh":
        if self._device_mesh is None:
            raise RuntimeError("AutoSPStrategy.device_mesh is available after the process group is set up (in `setup`).")
        return self._device_mesh

    @property
    def sp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("sp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("dp")

    # ------------------------------------------------------------------ what was compiled
    @property
    def compiled_steps(self) -> Mapping[str, CompiledStep]:
        """What AutoSP compiled, per step method (``"training_step"``, ``"validation_step"``,
        ``"test_step"``, ``"predict_step"``), from ``setup`` until ``teardown``.

        A read-only mapping of :class:`~lightning_autosp.backend.CompiledStep` snapshots taken
        when the property is read: per graph, what the SP pass did (``pass_stats``; summed in
        ``sdpa_rewritten``, ``all_to_alls``, ``fallbacks``) and, with an AOT ``compile_backend``,
        what each training graph saves for backward (``saved_activations``;
        ``saved_bytes_by_kind(since=earlier_snapshot)`` sums the calls in between). A step
        appears at ``setup``; its graphs once the step has run.
        """
        return MappingProxyType({name: backend.compiled_step() for name, backend in self._backends.items()})

    def _validate_layout(self) -> SPLayout:
        return validate_layout(self.sp_size, self.num_nodes * self.num_processes, self.num_processes)

    @override
    def _configure_launcher(self) -> None:
        self._validate_layout()  # fail in the launching process, before any worker starts
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        layout = self._validate_layout()
        assert self.lightning_module is not None
        prepare_rank(self._start_method, self.lightning_module)
        super().setup_environment()
        from torch.distributed.device_mesh import DeviceMesh

        # The subgroups get the user's `timeout` (a DeviceMesh would create them with the
        # backend's default: 30 min on gloo, 10 min on NCCL). Every rank creates every group.
        sp_group, _ = dist.new_subgroups_by_enumeration(layout.all_sp_groups(), timeout=self._timeout)
        dp_group, _ = dist.new_subgroups_by_enumeration(layout.all_dp_groups(), timeout=self._timeout)
        self._device_mesh = DeviceMesh.from_group(
            [dp_group, sp_group],
            self.root_device.type,
            mesh=torch.arange(layout.world_size).view(layout.dp_size, layout.sp_size),  # [dp, sp]
            mesh_dim_names=("dp", "sp"),
        )
        if self._fsdp is not None:
            self._shard_mesh = self._build_shard_mesh(layout.world_size)
        self.lightning_module._device_mesh = self._device_mesh
        rank_zero_info(
            f"AutoSP: {layout.world_size} processes as dp={layout.dp_size} x sp={layout.sp_size}; "
            f"SP groups {layout.all_sp_groups()}"
        )

    def _build_shard_mesh(self, world_size: int) -> "DeviceMesh":
        """The mesh the sharded mode holds parameters on: the world (``"full"``) or
        ``(replicate, shard)`` = ``(nodes, ranks per node)`` (``"hybrid"``)."""
        from torch.distributed.device_mesh import DeviceMesh

        assert self._fsdp is not None
        replicate, shard = self._fsdp.shard_groups(world_size, self.num_processes)
        if self._fsdp.mode == "full":
            return DeviceMesh.from_group(dist.group.WORLD, self.root_device.type, mesh_dim_names=("shard",))
        shard_group, _ = dist.new_subgroups_by_enumeration(shard, timeout=self._timeout)
        replicate_group, _ = dist.new_subgroups_by_enumeration(replicate, timeout=self._timeout)
        return DeviceMesh.from_group(
            [replicate_group, shard_group],
            self.root_device.type,
            mesh=torch.tensor(shard),  # [nodes, ranks per node]
            mesh_dim_names=("replicate", "shard"),
        )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank of an SP group reads the same samples; SP groups read disjoint ones
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training loaders continue an interrupted epoch where a checkpoint stopped
        (:class:`~lightning_autosp.sampler.ResumableOrder`)."""
        dataloader = super().process_dataloader(dataloader)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.training:
            epoch_loop = trainer.fit_loop.epoch_loop
            make_resumable(dataloader, lambda: (trainer.current_epoch, epoch_loop.batch_progress.current.ready))
        return dataloader

    # ------------------------------------------------------------------ sharded parameters
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """With ``fsdp``, modules built in ``configure_model`` or under ``Trainer.init_module()``
        go to the ``meta`` device (no memory) unless ``empty_init=False``; ``setup`` gives them
        storage on the root device, runs the model's own initialisers and shards them."""
        if self._fsdp is None or empty_init is False:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    def _sharding_policy(self) -> ShardingPolicy:
        assert self._fsdp is not None and self._shard_mesh is not None
        return self._fsdp.policy(self._shard_mesh, self.precision_plugin.precision)

    @override
    def model_to_device(self) -> None:
        """Sharded: a model built on the meta device gets its values shard by shard
        (:mod:`lightning_autosp.sharded_init`) - read from ``pretrained`` weights, or from its own
        initialisers one unit at a time - so no rank holds more of it than its shards and one
        unit."""
        assert self.model is not None
        module = self.lightning_module
        parts = {attr: self._pretrained_part(attr) for attr in self._pretrained}  # (each must be on meta)
        if self._fsdp is None or module is None or not has_meta_tensors(self.model):
            return super().model_to_device()
        if module.trainer.state.fn != TrainerFn.FITTING:  # validate/test/predict: replicas, not sharded
            n = materialize_meta(self.model, self.root_device)
            rank_zero_info(f"AutoSP: initialised {n} tensors of the model built on the meta device on {self.root_device}")
            for attr, part in parts.items():
                load_whole(part, self._pretrained[attr], strict=module.strict_loading)
            return super().model_to_device()
        move_real_tensors(self.model, self.root_device)
        policy = self._sharding_policy()
        for attr, part in parts.items():
            n = load_pretrained(part, self._pretrained[attr], policy, self.root_device, strict=module.strict_loading)
            rank_zero_info(f"AutoSP: read {n} tensors of `{attr}` from {self._pretrained[attr]}, each rank its shards")
        report = materialize_sharded(self.model, self.root_device, policy)
        if report.units:
            rank_zero_info(
                f"AutoSP: initialised the model built on the meta device on {self.root_device} in {report.units} unit(s) "
                f"of at most {report.largest_unit_bytes / 2**20:.1f} MiB (model {report.model_bytes / 2**20:.1f} MiB), "
                "each sharded before the next"
            )

    def _pretrained_part(self, attr: str) -> torch.nn.Module:
        module = self.lightning_module
        part = module if attr == "" else getattr(module, attr, None)
        if not isinstance(part, torch.nn.Module) or not has_meta_tensors(part):
            raise AutoSPError(
                f"AutoSPStrategy(pretrained={{{attr!r}: ...}}): the LightningModule's `{attr}` must be a module built on "
                "the meta device: build it in configure_model (AutoSP builds it there without memory, then reads "
                "each rank's shard of the weights)."
            )
        return part

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self._fsdp is None:
            return super()._setup_model(model)
        broadcast_module(model)  # rank 0's initial values everywhere, as DDP does (shards stay)
        policy = self._sharding_policy()
        n = shard_module(model, policy)
        dtypes = f", gathered in {policy.param_dtype}, reduced in {policy.reduce_dtype}" if policy.param_dtype else ""
        rank_zero_info(f"AutoSP: {sum(1 for _ in model.parameters())} parameters sharded as DTensors over {self._shard_mesh} (fsdp={self.fsdp!r}{dtypes}; {n} in setup)")
        return model

    @override
    def on_train_end(self) -> None:
        """The module leaves ``fit`` as the user gave it: full parameters, its own classes."""
        super().on_train_end()
        module = self.lightning_module
        if self._fsdp is not None and module is not None and is_sharded(module):
            unshard_module(module)

    @override
    def _register_ddp_hooks(self) -> None:
        if self._fsdp is None:
            super()._register_ddp_hooks()

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # a distributed checkpoint is read into the module and the optimizers once they exist
        # (sharded: as DTensors; replicated: DCP reads whole tensors)
        return True

    def _sharded_now(self) -> bool:
        return self._fsdp is not None and self.lightning_module is not None and is_sharded(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Sharded: the optimizer's state keyed by parameter name, its tensors DTensors
        (``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``)."""
        if self._sharded_now():
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
            return get_optimizer_state_dict(self.lightning_module, optimizer)
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Sharded (``fsdp`` during ``fit``): a torch distributed checkpoint directory at
        ``filepath`` (:mod:`lightning_autosp.checkpoint`); no rank gathers the model. Otherwise
        Lightning's single file, with the optimizer's parameter names added so that a sharded run
        can resume from it."""
        if self._sharded_now():
            if storage_options is not None:
                raise TypeError("AutoSPStrategy(fsdp=...) writes distributed checkpoints itself: storage_options is not supported.")
            save_distributed(checkpoint, filepath, rank=self.global_rank, barrier=self.barrier)
            return
        if self.is_global_zero and self.lightning_module is not None and "optimizer_states" in checkpoint:
            checkpoint["autosp"] = {"optimizer_param_names": optimizer_param_names(self.lightning_module, self.optimizers)}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A distributed checkpoint (a directory) is read here, into the module and the
        optimizers, sharded or replicated, on any layout; a single file as Lightning reads it
        (into a sharded module by :meth:`load_model_state_dict`)."""
        self._restored_by_strategy = False
        if not is_distributed_checkpoint(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, **load_checkpoint_kwargs(weights_only))
        module = self.lightning_module
        assert module is not None
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        meta = load_distributed(checkpoint_path, module, optimizers, strict=module.strict_loading, weights_only=weights_only)
        self._restored_by_strategy = True
        if optimizers:
            meta["optimizer_states"] = []  # restored above; Lightning checks the key is there
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._restored_by_strategy:
            return
        if self._sharded_now():
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            check_fits(checkpoint["state_dict"], self.lightning_module.state_dict(), strict, self._ckpt_path())
            set_model_state_dict(self.lightning_module, checkpoint["state_dict"], options=StateDictOptions(full_state_dict=True, strict=strict))
            return
        super().load_model_state_dict(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._restored_by_strategy:
            return
        if not self._sharded_now():
            return super().load_optimizer_state_dict(checkpoint)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        where = self._ckpt_path()
        names = (checkpoint.get("autosp") or {}).get("optimizer_param_names")
        if names is None:
            raise AutoSPError(
                f"{where} holds optimizer state by position only (it was not written by AutoSPStrategy), and a sharded "
                "run needs it by parameter name. Resume it with fsdp=False, or load its weights into the module "
                "before fit and start the optimizer afresh."
            )
        for i, (optimizer, state) in enumerate(zip(self.optimizers, checkpoint["optimizer_states"])):
            named = named_optimizer_state(state, names[i], where)
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            set_optimizer_state_dict(self.lightning_module, optimizer, named, options=StateDictOptions(full_state_dict=True))

    def _ckpt_path(self) -> str:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return str(getattr(trainer, "ckpt_path", None) or "the checkpoint")

    # ------------------------------------------------------------------ compile
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        module = self.lightning_module
        assert module is not None
        group_name = self.sp_group.group_name
        for name in _COMPILED_STEPS:
            if name in module.__dict__:  # compiled already by an earlier stage
                continue
            backend = AutoSPBackend(
                sp_size=self.sp_size, sp_rank=self.sp_rank, group_name=group_name, seq_dim=self.seq_dim, backend=self.compile_backend,
                sac=self.sac_config if self.sac else None, loss_chunk=self.loss_chunk,
            )
            self._backends[name] = backend
            setattr(module, name, _compiled_step(getattr(module, name), backend))
        log.debug("AutoSP: compiled %s with backend %s", _COMPILED_STEPS, self.compile_backend)
        if not self._eager_calls:  # (as the steps: once until teardown)
            self._eager_calls = _keep_out_of_graphs(module)
            if self._fsdp is not None:
                hook = "on_before_optimizer_step"
                self._eager_calls.append((module, hook, module.__dict__.get(hook, _ABSENT)))
                setattr(module, hook, _explaining_dtensor_errors(getattr(module, hook), hook))

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        if self._fsdp is not None and module is not None and is_sharded(module) and trainer is not None and trainer.state.status == TrainerStatus.RUNNING:
            # a fit that ran no epoch (resumed at max_steps) ends without on_train_end; not after
            # an exception, where a peer may never reach this collective
            unshard_module(module)
        if module is not None:
            for name in _COMPILED_STEPS:
                module.__dict__.pop(name, None)
        for owner, name, before in reversed(self._eager_calls):
            if before is _ABSENT:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, before)
        self._eager_calls = []
        self._backends.clear()
        self._checked.clear()
        self._diverged.clear()
        super().teardown()

    def _prepare_batch(self, batch: Any, step: str) -> None:
        """Check that the SP group agrees on the batch and that the sequence fits, and mark the
        sequence dims dynamic, so one compile serves every length.

        The sequence length is the size at ``seq_dim`` that most of the batch's tensors share
        (token ids and labels ``[B, S]``; ties go to integer tensors). Every dim (after the batch
        dim) of a batch tensor with that size is marked: ids and labels ``[B, S]``, masks
        ``[B, 1, S, S]``; other tensors (``[B, F]`` features) stay static.
        """
        paths = [(keystr(path), t) for path, t in tree_flatten_with_path(batch)[0] if isinstance(t, torch.Tensor)]
        tensors = [t for _, t in paths]
        backend = self._backends.get(step)
        sp_graphs = backend.sp_graphs if backend is not None else 0
        counts = check_sp_batch_agreement(tensors, self.sp_group, self.sp_size, self.root_device, step, sp_graphs)
        self._check_same_graphs(step, counts)
        seq_len = _sequence_length([(p, t) for p, t in paths if t.dim() > self.seq_dim], self.seq_dim)
        if seq_len is None:
            return
        # The shift is known once the step has compiled; the pass checks the first batch itself.
        if backend is not None:
            check_sequence_fits(seq_len + backend.seq_offset, self.sp_size, backend.max_shift)
        else:
            check_sequence_fits(seq_len, self.sp_size)
        self._marked = []
        for path, t in paths:
            for d in range(1, t.dim()):
                if t.shape[d] == seq_len:
                    torch._dynamo.mark_dynamic(t, d)
                    self._marked.append(f"batch{path} dim {d}")

    def _check_same_graphs(self, step: str, counts: list[int]) -> None:
        """Every SP rank must compile the same graphs: a rank that recompiles alone is harmless
        until it reaches Dynamo's recompile limit, where it would run the step eagerly while its
        peers wait for it in an all-to-all. Warn when the counts part, stop before the limit."""
        if len(set(counts)) == 1:
            return
        what = (
            f"AutoSP: the ranks of an SP group compiled different numbers of graphs for `{step}` "
            f"(per SP rank: {counts}): a rank-dependent guard made some recompile where others did not. "
            "TORCH_LOGS=recompiles shows the guard; please report it with that output."
        )
        limit = torch._dynamo.config.recompile_limit
        if max(counts) >= limit - 1:
            raise AutoSPError(
                f"{what} One more recompile would reach Dynamo's recompile limit ({limit}), where a rank runs "
                "the step eagerly while its peers wait in an all-to-all, so AutoSP stops here. Raise "
                "torch._dynamo.config.recompile_limit, or keep the sequence lengths of the batches fixed."
            )
        if step not in self._diverged:
            self._diverged.add(step)
            log.warning(what)

    def _check_rewritten(self, step: str) -> None:
        if step in self._checked or step not in self._backends:
            return
        backend = self._backends[step]
        if backend.sdpa_rewritten == 0:
            raise AutoSPError(
                f"AutoSP found no attention to parallelize in `{type(self.lightning_module).__name__}.{step}`: "
                "sequence parallelism splits attention heads across the SP group, so the model must call "
                "`torch.nn.functional.scaled_dot_product_attention` (for Hugging Face models: "
                "attn_implementation='sdpa') or write attention over heads, `softmax(q @ k.transpose(-2, -1) * scale "
                "+ mask) @ v` with q, k, v laid out [B, H, S, D] (single-head [B, S, D] attention has no heads to "
                "split; see the supported-models page for the steps allowed between the two matmuls)."
            )
        for g in backend.pass_stats:
            if g.fallbacks:
                log.warning("AutoSP ran %d op(s) of %s replicated: %s", len(g.fallbacks), step, "; ".join(g.fallbacks))
        self._checked.add(step)

    def _run_step(self, step: str, parent: Callable, *args: Any, **kwargs: Any) -> Any:
        if args:
            self._prepare_batch(args[0], step)
        breaks_before = Counter(graph_break_counter())
        try:
            out = parent(*args, **kwargs)
        except Exception as exc:
            violation = _find_cause(exc, ConstraintViolationError)
            if violation is not None:
                where = _specialized_at(str(violation))
                raise AutoSPError(
                    "AutoSP marks every dim of the batch whose size equals the sequence length as a sequence dim "
                    f"({', '.join(self._marked)}), but the step uses one of them as a fixed size.\n"
                    f"{str(violation).splitlines()[0]}\n"
                    + (f"Dynamo fixed it here:\n{where}\n" if where else "")
                    + "Either the code there turns the sequence length into a Python number (a loop "
                    "`for i in range(T)` or a Python `if` over the length, e.g. a mask built row by row: "
                    "build it with tensor ops such as `torch.arange(T)[:, None] - torch.arange(T)` instead), "
                    "or that tensor has a feature dim that happens to equal the sequence length: give it a size "
                    "other than the sequence length (or a sequence length other than its size), or move it out "
                    "of the batch (a buffer of the module, for example)."
                ) from exc
            cause = _find_cause(exc, AutoSPError)
            if cause is None:
                raise
            breaks = Counter(graph_break_counter()) - breaks_before
            raise AutoSPError(f"{cause}{_describe_breaks(breaks)}") from exc
        self._check_rewritten(step)
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


def _sequence_length(tensors: Sequence[tuple[str, torch.Tensor]], seq_dim: int) -> Optional[int]:
    """The size at ``seq_dim`` most of ``tensors`` share (ties: the size of integer tensors,
    token ids); ``None`` without tensors. An AutoSPError if that does not decide it."""
    if not tensors:
        return None
    votes = Counter(t.shape[seq_dim] for _, t in tensors)
    top = max(votes.values())
    sizes = [size for size, n in votes.items() if n == top]
    if len(sizes) > 1:
        integer = {t.shape[seq_dim] for _, t in tensors if not t.is_floating_point() and t.dtype != torch.bool}
        sizes = [size for size in sizes if size in integer] or sizes
    if len(sizes) > 1:
        found = ", ".join(f"batch{p}: {tuple(t.shape)}" for p, t in tensors)
        raise AutoSPError(
            f"AutoSP cannot tell the sequence length from the batch: its tensors disagree at seq_dim={seq_dim} "
            f"({found}). AutoSP takes the size most of them share, preferring integer (token id) tensors. Give "
            "the sequence tensors (token ids, labels, positions) the same length, keep other tensors' seq_dim "
            "size different from it, or set AutoSPStrategy(seq_dim=...)."
        )
    return sizes[0]


def _find_cause(exc: Optional[BaseException], kind: type) -> Optional[BaseException]:
    """The exception of type ``kind`` behind ``exc`` (Dynamo wraps backend errors), if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, kind):
            return exc
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None


def _specialized_at(violation: str) -> str:
    """The innermost frame of the "User stack" in Dynamo's ConstraintViolationError: the code
    that made a marked size a constant."""
    lines = violation.split("User stack:", 1)[1].splitlines() if "User stack:" in violation else []
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    if not frames:
        return ""
    return "\n".join(line for line in lines[frames[-1] : frames[-1] + 2] if line.strip())


def _describe_breaks(breaks: Counter) -> str:
    if not breaks:
        return ""
    lines = "\n".join(f"  - {_break_summary(reason)}" for reason in breaks)
    data_dependent = any("depends on input Tensor data" in reason or reason.startswith("Dynamic shape operator") for reason in breaks)
    return (
        f"\nDynamo split this step into several graphs at these graph breaks:\n{lines}\n"
        "A graph break inside the model hides the sequence dim from the graphs after it. Remove "
        "print/logging calls from forward, replace data-dependent Python branches with torch.where, "
        "and keep such code in training_step after the loss (TORCH_LOGS=graph_breaks shows where they are)."
        + (
            "\nAn op whose output shape depends on the data (`torch.where(mask)` with one argument, `nonzero`, "
            "indexing with a boolean mask - e.g. a mixture-of-experts router that gathers each expert's tokens, "
            "as LitGPT's LLaMAMoE does) cannot be traced into the graph AutoSP splits: such a model is not supported. "
            "Route with fixed shapes instead (every expert on every token, weighted by its gate; or a "
            "scatter/gather by expert index with a fixed capacity)."
            if data_dependent else ""
        )
    )


def _break_summary(reason: str) -> str:
    """The first line of a Dynamo graph-break reason and its explanation (which names the op)."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    why = next((line.removeprefix("Explanation:").strip() for line in lines[1:] if line.startswith("Explanation:")), "")
    return (f"{lines[0]}: {why}" if why else lines[0] if lines else reason)[:300]


_ABSENT = object()
_EAGER_METRIC_CALLS = ("forward", "update", "compute", "reset")
_EAGER_MODULE_CALLS = ("log", "log_dict")


def _keep_out_of_graphs(module: "pl.LightningModule") -> list[tuple[Any, str, Any]]:
    """Run the module's ``self.log``/``self.log_dict`` and its torchmetrics objects eagerly
    when a compiled step calls them: Dynamo would trace their bookkeeping and, as a metric's
    counters change, recompile those frames at every step up to its recompile limit. Each call
    becomes a graph break instead. Set on these objects only (instance attributes, undone in
    ``teardown``); return what was replaced."""
    from torchmetrics import Metric

    replaced = []
    targets = [(module, _EAGER_MODULE_CALLS)] + [(m, _EAGER_METRIC_CALLS) for m in module.modules() if isinstance(m, Metric)]
    for owner, names in targets:
        for name in names:
            before = owner.__dict__.get(name, _ABSENT)
            replaced.append((owner, name, before))
            call = getattr(owner, name)
            if owner is module:  # a logged DTensor (a norm of sharded parameters) is logged whole
                call = _logging_whole(call, name)
            setattr(owner, name, torch.compiler.disable(call, recursive=True))
    return replaced


def _logging_whole(log_fn: Callable, name: str) -> Callable:
    """``self.log(name, value, ...)`` / ``self.log_dict(dictionary, ...)`` with DTensor values whole
    (:func:`lightning_autosp.fsdp.whole`): Lightning would read one rank's part of them."""
    values = "dictionary" if name == "log_dict" else "value"
    position = 0 if name == "log_dict" else 1

    @functools.wraps(log_fn)
    def logging_whole(*args: Any, **kwargs: Any) -> Any:
        if values in kwargs:
            kwargs[values] = whole(kwargs[values])
        elif len(args) > position:
            args = (*args[:position], whole(args[position]), *args[position + 1 :])
        return log_fn(*args, **kwargs)

    return logging_whole


def _explaining_dtensor_errors(hook: Callable, hook_name: str) -> Callable:
    """The module's ``hook`` (``on_before_optimizer_step``), with the error Lightning's
    ``grad_norm`` raises on DTensor gradients turned into one that names the fix."""

    @functools.wraps(hook)
    def explained(*args: Any, **kwargs: Any) -> Any:
        try:
            return hook(*args, **kwargs)
        except RuntimeError as exc:
            if "data is not allocated" not in str(exc):
                raise
            raise AutoSPError(
                f"`{hook_name}` read a DTensor's storage directly: with AutoSPStrategy(fsdp=...) parameters and their "
                "gradients are DTensors, and Lightning's `lightning.pytorch.utilities.grad_norm` (like any code that "
                "builds `torch.tensor` from their norms) cannot read them. Use `lightning_autosp.grad_norm(self, "
                "norm_type)`: the same keys with the whole model's norms. Norms of single DTensors are partial per "
                "rank: call `.full_tensor()` before `.item()`."
            ) from exc

    return explained


def _compiled_step(fn: Callable, backend: AutoSPBackend) -> Callable:
    compiled = torch.compile(fn, backend=backend)

    def step(*args: Any, **kwargs: Any) -> Any:
        # Dynamo's DDP optimizer would split our graph per gradient bucket; the SP pass needs
        # the whole step in one graph, and DDP still overlaps the gradient all-reduce.
        with torch._dynamo.config.patch(optimize_ddp=False):
            return compiled(*args, **kwargs)

    step.__wrapped__ = fn  # type: ignore[attr-defined]
    return step
