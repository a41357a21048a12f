"""The AutoSP ``torch.compile`` backend: SP pass on the Dynamo graph, then the chosen backend."""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import sympy
import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from autosp._compat import graph_break_counter
from autosp._gc import full_collections_deferred
from autosp.ops.local_shapes import LocalShapeCompiled, LocalShapes, add_chunk_input, build_local_shapes
from autosp.passes.accounting import SavedActivations, empty_by_kind
from autosp.passes import SPPassStats, sequence_parallel_pass
from autosp.passes.bucketing import BucketStats, bucket_parameter_collectives_pass
from autosp.passes.checkpoints import inline_checkpoints
from autosp.passes.offload import OffloadConfig
from autosp.passes.tiled_mlp import tile_token_regions
from autosp.passes.sac import SACConfig, SACPartitioner

__all__ = ["AutoSPBackend", "CompiledStep", "SUPPORTED_BACKENDS", "AOT_BACKENDS"]

log = logging.getLogger(__name__)

SUPPORTED_BACKENDS = ("inductor", "aot_eager", "eager")
#: the backends that build the AOT joint graph, which SAC partitions and whose saves are recorded
AOT_BACKENDS = ("inductor", "aot_eager")


@dataclass(frozen=True)
class CompiledStep:
    """What AutoSP compiled for one step method, as it stood when read: later compiles and
    calls do not change it (see :attr:`AutoSPStrategy.compiled_steps
    <lightning_autosp.AutoSPStrategy.compiled_steps>`).

    Attributes:
        compile_backend: the backend run after the SP pass.
        sac: the SAC configuration, ``None`` without SAC.
        pass_stats: what the SP pass did to each graph Dynamo compiled for the step, in compile
            order (:class:`~autosp.passes.SPPassStats`: attention calls rewritten,
            all-to-alls inserted, ops run replicated).
        saved_activations: one record per training graph compiled with an AOT backend (none for
            inference graphs or ``"eager"``): the tensors its forward saves for backward and its
            calls so far (:class:`~autosp.passes.accounting.SavedActivations`, whose
            ``bytes_by_kind()`` sizes the latest call).
    """

    compile_backend: str
    sac: Optional[SACConfig]
    pass_stats: tuple[SPPassStats, ...]
    saved_activations: tuple[SavedActivations, ...]
    #: per forward and backward graph compiled with an AOT backend (not on an inductor cache hit):
    #: the sharded mode's parameter collectives before and after bucketing per block
    bucket_stats: tuple[BucketStats, ...] = ()

    @property
    def sdpa_rewritten(self) -> int:
        """Attention calls and other sequence mixers the SP pass rewrote, over every graph."""
        return sum(g.mixers for g in self.pass_stats)

    @property
    def all_to_alls(self) -> int:
        """All-to-alls the SP pass inserted into the forward, over every graph."""
        return sum(g.all_to_all for g in self.pass_stats)

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """Ops run replicated (their sharded inputs all-gathered), over every graph."""
        return tuple(f for g in self.pass_stats for f in g.fallbacks)

    def saved_bytes_by_kind(self, since: Optional["CompiledStep"] = None) -> dict[str, int]:
        """Bytes saved for backward per op kind (:data:`~autosp.passes.accounting.OP_KINDS`),
        summed over the calls of every training graph made after ``since`` (an earlier
        snapshot of the same step; ``None``: every call so far). Each graph's calls are sized
        at the sequence length of its latest call: exact for one call per graph in between,
        as between the start and the end of one training step.

        Raises ``ValueError`` if a saved size depends on a symbol the graph inputs do not give.
        """
        before = since.saved_activations if since is not None else ()
        out = empty_by_kind()
        for i, record in enumerate(self.saved_activations):  # records are only ever appended
            calls = record.calls - (before[i].calls if i < len(before) else 0)
            if calls > 0:
                for kind, nbytes in record.bytes_by_kind().items():
                    out[kind] += calls * nbytes
        return out


@dataclass
class AutoSPBackend:
    """A ``torch.compile`` backend for one SP rank.

    Holds only plain values (the group travels by name), so it pickles and deep-copies.
    ``pass_stats`` collects the :class:`SPPassStats` of every graph compiled through it;
    :meth:`compiled_step` is a read-only snapshot of both records.

    With ``backend="aot_eager"`` or ``"inductor"`` the joint graph is partitioned by a
    :class:`~autosp.passes.sac.SACPartitioner` given to this compile only (AOT
    autograd's ``partition_fn``, or inductor's ``custom_partitioner_fn`` config patch): with
    ``sac`` set it applies sequence-aware activation checkpointing, and either way it records
    the activations each training graph saves for backward in ``saved_activations`` (one
    :class:`~autosp.passes.accounting.SavedActivations` per graph, sized for its
    latest call). Any other registered backend name is looked up and called unchanged after the
    SP pass; it gets no records, and ``sac`` is refused with it (``"eager"`` included).

    With ``local_shapes`` (the default), the AOT backends compile a graph the SP pass rewrote in
    a shape environment of its own, where the sequence length is ``sp_size*c - r``
    (:mod:`autosp.ops.local_shapes`): the local lengths are plain symbols, which compiles
    faster, and AutoSP checks that compile's guards on every call itself. The records' sizes
    then use that environment's symbols (:attr:`SavedActivations.length_symbols
    <autosp.passes.accounting.SavedActivations.length_symbols>` says how they follow
    the sequence length).
    """

    sp_size: int
    sp_rank: int
    group_name: str
    seq_dim: int = 1
    backend: str = "inductor"
    sac: Optional[SACConfig] = None
    #: tokens per chunk of the fused vocabulary projection and loss (0: automatic, None: off)
    loss_chunk: Optional[int] = 0
    #: rows/columns per tile of attention with a mask built from positions (0: automatic, None:
    #: masks stay dense; :func:`~autosp.passes.sequence_parallel_pass`)
    attention_tile: Optional[int] = 0
    #: an op the SP pass would run replicated is an :class:`~autosp.errors.AutoSPError`
    strict: bool = False
    #: compile SP graphs with the sequence length as ``sp_size*c - r`` (:mod:`autosp.ops.local_shapes`)
    local_shapes: bool = True
    #: KV heads the model repeats reach attention unrepeated with ``enable_gqa`` (``None``: on CPU;
    #: see :func:`~autosp.passes.sequence_parallel_pass`)
    native_gqa: Optional[bool] = None
    #: merge the sharded mode's parameter all-gathers and reduce-scatters per transformer block
    #: in the partitioned graphs (:mod:`autosp.passes.bucketing`)
    bucket_collectives: bool = True
    #: rows per tile of the step's MLPs (0: sized automatically, where a rank holds two tiles or more;
    #: None: off; :mod:`autosp.passes.tiled_mlp`)
    mlp_tile: Optional[int] = None
    #: move saved activations to host memory after the partition (:mod:`autosp.passes.offload`)
    offload: Optional[OffloadConfig] = None
    #: ``(ulysses, ring)``: how the SP group splits attention (None: from the heads, Ulysses up to
    #: ``max_ulysses`` ranks; :func:`~autosp.passes.sequence_parallel.attention_layout`)
    sp_layout: Optional[tuple[int, int]] = None
    max_ulysses: Optional[int] = None
    pass_stats: list[SPPassStats] = field(default_factory=list)
    #: per forward and backward graph compiled with an AOT backend: the parameter collectives
    #: before and after bucketing
    bucket_stats: list[BucketStats] = field(default_factory=list, repr=False)
    saved_activations: list[SavedActivations] = field(default_factory=list, repr=False)
    #: seconds spent so far in AutoSP's own compile steps: ``"sp_pass"`` (the SP pass) and
    #: ``"partition"`` (SAC tagging, the min-cut partition and its checks, the records)
    timings: dict[str, float] = field(default_factory=lambda: {"sp_pass": 0.0, "partition": 0.0}, repr=False)
    #: Dynamo's graph-break counts (by reason) when each graph reached this backend: the breaks
    #: counted between two compiles ended the second graph (:meth:`autosp.steps.StepRunner.run`)
    break_marks: list[dict[str, int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.offload is not None and self.backend not in AOT_BACKENDS:
            raise ValueError(
                f"AutoSPBackend(backend={self.backend!r}, offload=...): activation offload rewrites the partitioned "
                f"forward and backward graphs, which only the {list(AOT_BACKENDS)} backends build. Use one of them."
            )
        if self.sac is not None and self.backend not in AOT_BACKENDS:
            raise ValueError(
                f"AutoSPBackend(backend={self.backend!r}, sac=...): sequence-aware activation checkpointing "
                f"partitions the AOT joint graph, which only the {list(AOT_BACKENDS)} backends expose here. "
                "Use one of them or pass sac=None."
            )

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        self.break_marks.append(graph_break_counter())
        with full_collections_deferred():  # see autosp._gc
            return self._compile(gm, example_inputs)

    def _compile(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        start = time.perf_counter()
        checkpointed = inline_checkpoints(gm)  # the user's gradient checkpointing, in the one graph (recomputed by the partition)
        if checkpointed and self.backend not in AOT_BACKENDS and not _warned_checkpoints:
            _warned_checkpoints.append(True)
            log.warning(
                "AutoSP: %d region(s) under gradient checkpointing run without recomputation with compile_backend=%r, which "
                "does not partition the graph: use 'inductor' or 'aot_eager' for it to take effect.", checkpointed, self.backend,
            )
        regions = []
        if self.mlp_tile is not None:
            regions = tile_token_regions(gm, tile=self.mlp_tile, min_tiles=0 if self.mlp_tile else 2, sp_size=self.sp_size)
        gm = sequence_parallel_pass(
            gm, example_inputs, sp_size=self.sp_size, sp_rank=self.sp_rank, group_name=self.group_name, seq_dim=self.seq_dim,
            loss_chunk=self.loss_chunk, native_gqa=self.native_gqa, attention_tile=self.attention_tile,
            strict=self.strict, sp_layout=self.sp_layout, max_ulysses=self.max_ulysses,
        )
        gm.meta["autosp"].tiled_regions = len(regions)
        gm.meta["autosp"].checkpoint_regions = checkpointed
        self.pass_stats.append(gm.meta["autosp"])
        self.timings["sp_pass"] += time.perf_counter() - start
        if self.backend not in AOT_BACKENDS:
            return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)
        partitioner = SACPartitioner(self.sac, offload=self.offload)
        stats = gm.meta["autosp"]
        local = build_local_shapes(_example_values(gm), stats.seq_symbol, self.sp_size, offset=stats.seq_offset) if self.local_shapes and stats.mixers else None
        if local is not None:
            return self._compile_local(gm, local, partitioner)
        compiled = self._compile_aot(gm, example_inputs, partitioner)
        self.timings["partition"] += partitioner.seconds
        if not partitioner.records:  # an inference graph (no_grad): nothing is saved
            return compiled
        record = partitioner.records[-1]
        getters = _size_getters(gm)
        record.symbols = tuple(name for name, _, _ in getters)
        record.length_symbols = {stats.seq_symbol: (1, None, 0)} if stats.seq_symbol else {}
        self.saved_activations.append(record)
        return _recording_sizes(compiled, record, getters)

    def _compile_local(self, gm: fx.GraphModule, local: LocalShapes, partitioner: SACPartitioner) -> Callable:
        """Compile in a shape environment of the graph's own (:mod:`autosp.ops.local_shapes`);
        each compile's record of saved activations is sized with that environment's symbols."""
        values = _example_values(gm)
        add_chunk_input(gm)
        pristine = copy.deepcopy(gm.graph)  # inductor's graph passes change the graph they compile
        records: list[SavedActivations] = []

        def compile_one(inputs: list[Any], _: LocalShapes) -> Callable:
            with full_collections_deferred():  # a later compile runs inside a call, not in __call__
                return compile_aot(inputs)

        def compile_aot(inputs: list[Any]) -> Callable:
            before, seconds = len(partitioner.records), partitioner.seconds
            target = gm
            if records:  # a later compile: a fresh copy of the rewritten graph (node meta shared)
                target = fx.GraphModule(gm, copy.deepcopy(pristine))
                target.meta.update(gm.meta)
            compiled = self._compile_aot(target, inputs, partitioner)
            self.timings["partition"] += partitioner.seconds - seconds
            record = partitioner.records[-1] if len(partitioner.records) > before else None
            if record is not None:
                self.saved_activations.append(record)
            records.append(record)
            return compiled

        def on_call(index: int, variant: LocalShapes, args: tuple) -> None:
            record = records[index]
            if record is not None:
                record.symbols = variant.symbol_names()
                record.length_symbols = variant.length_symbols()
                record.binding = variant.symbol_values(args)
                record.calls += 1

        return LocalShapeCompiled(compile_one, local, values, gm.meta["autosp"].seq_symbol, on_call)

    def _compile_aot(self, gm: fx.GraphModule, example_inputs: list[Any], partitioner: SACPartitioner) -> Callable:
        bucketing = _BucketPass(self.bucket_stats, merge=self.bucket_collectives)
        if self.backend == "aot_eager":
            # torch's aot_eager, with our partition function (and bucketing of the graphs it makes)
            def nop(graph: fx.GraphModule, inputs: list[Any]) -> Callable:
                bucketing(graph.graph)
                return boxed_nop(graph, inputs)

            return aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partitioner, keep_inference_input_mutations=True)(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx

        bucketing = _BucketPass(self.bucket_stats, merge=self.bucket_collectives, ordered=True)
        if not collectives_keep_their_order() and not _warned_order:
            _warned_order.append(True)
            log.warning(
                "AutoSP: this torch (%s) has no control_deps, with which inductor keeps AutoSP's collectives in the "
                "graph's order. SP ranks holding different token counts (a length not divisible by sp_size) may then "
                "run them in different orders (seen with DeepSeek-V3): the job stops with a collective mismatch (gloo) "
                "or hangs (NCCL). Use a torch with control_deps (2.13 and 2.15 have it), compile_backend='aot_eager', or lengths "
                "divisible by sp_size.",
                torch.__version__,
            )

        # The AOT autograd cache would skip partitioning (and so our records) on a hit; inductor's
        # FX graph cache still serves the compiled kernels.
        patches: dict[str, Any] = {"custom_partitioner_fn": partitioner, "post_grad_custom_post_pass": bucketing}
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, config_patches=patches)

    def compiled_step(self) -> CompiledStep:
        """A snapshot of what this backend compiled so far (copies: later calls leave it alone)."""
        return CompiledStep(
            compile_backend=self.backend,
            sac=self.sac,
            pass_stats=tuple(copy.deepcopy(g) for g in self.pass_stats),
            saved_activations=tuple(r.snapshot() for r in self.saved_activations),
            bucket_stats=tuple(copy.copy(b) for b in self.bucket_stats),
        )

    @property
    def sdpa_rewritten(self) -> int:
        return sum(g.mixers for g in self.pass_stats)

    @property
    def sp_graphs(self) -> int:
        """Graphs compiled so far with attention or another sequence mixer rewritten (the step's model graphs)."""
        return sum(1 for g in self.pass_stats if g.mixers)

    @property
    def max_shift(self) -> int:
        return max((g.max_shift for g in self.pass_stats), default=0)

    @property
    def seq_offset(self) -> int:
        """The pass splits ``S + seq_offset`` of a batch's ``S`` positions (the model graphs'
        :attr:`~autosp.passes.rewrite.SPPassStats.seq_offset`; the smallest if they differ)."""
        return min((g.seq_offset for g in self.pass_stats if g.mixers), default=0)


class _BucketPass(CustomGraphPass):
    """:func:`~autosp.passes.bucketing.bucket_parameter_collectives_pass` on each
    partitioned graph (inductor's ``post_grad_custom_post_pass``, or before aot_eager runs it);
    appends each graph's :class:`BucketStats` to ``stats``; ``merge=False`` only counts;
    ``ordered``: AutoSP's collectives then keep their order through inductor's scheduler."""

    def __init__(self, stats: list[BucketStats], merge: bool = True, ordered: bool = False) -> None:
        self.stats, self.merge, self.ordered = stats, merge, ordered

    def __call__(self, graph: fx.Graph) -> None:
        stats = BucketStats()
        bucket_parameter_collectives_pass(graph.owning_module, stats, merge=self.merge)
        self.stats.append(stats)
        if self.ordered:
            _keep_collective_order(graph)

    def uuid(self) -> Any:
        from autosp.passes import bucketing

        return (get_hash_for_files((bucketing.__file__, __file__)), self.merge, self.ordered)


_warned_order: list[bool] = []
_warned_checkpoints: list[bool] = []


def collectives_keep_their_order() -> bool:
    """Whether this torch has ``control_deps``, with which inductor keeps AutoSP's collectives in
    graph order (see :func:`_keep_collective_order`)."""
    try:
        from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering  # noqa: F401
    except ImportError:
        return False
    return True


def _keep_collective_order(graph: fx.Graph) -> None:
    """Make each of AutoSP's collectives depend on the one before it in the graph (torch's
    ``control_deps``), so that inductor's scheduler cannot reorder them. The SP ranks' graphs
    differ in their sizes (31 tokens: 16 and 15), and the scheduler orders independent ops by
    sizes: it ran DeepSeek-V3's q/k/v exchanges in different orders on two ranks, a collective
    mismatch (gloo aborts, NCCL hangs). Without ``control_deps`` (older torch) the graph is left as it is."""
    if not collectives_keep_their_order():
        return
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    from autosp.ops.collectives import _NS

    collectives = [n for n in graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", None) == _NS]
    preserve_node_ordering(graph, {b: OrderedSet([a]) for a, b in zip(collectives, collectives[1:])})


def _example_values(gm: fx.GraphModule) -> list[Any]:
    """The example values (fake tensors, SymInts) Dynamo recorded for the graph's inputs."""
    return [n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.find_nodes(op="placeholder")]


def _size_getters(gm: fx.GraphModule) -> list[tuple[str, int, Optional[int]]]:
    """For every size symbol of the graph's inputs: (name, input index, dim or None for a SymInt input)."""
    out: dict[str, tuple[str, int, Optional[int]]] = {}
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        val = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(val, torch.SymInt) and isinstance(val.node.expr, sympy.Symbol):
            out.setdefault(str(val.node.expr), (str(val.node.expr), i, None))
        elif isinstance(val, torch.Tensor):
            for d, s in enumerate(val.shape):
                if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                    out.setdefault(str(s.node.expr), (str(s.node.expr), i, d))
    return list(out.values())


def _recording_sizes(compiled: Callable, record: SavedActivations, getters: list[tuple[str, int, Optional[int]]]) -> Callable:
    """Wrap a compiled graph so that each call stores its size-symbol values in ``record``.

    Dynamo calls a backend's result with the graph inputs as positional arguments.
    """

    def run(*args: Any) -> Any:
        record.binding = tuple(int(args[i]) if d is None else int(args[i].shape[d]) for _, i, d in getters)
        record.calls += 1
        return compiled(*args)

    return run
