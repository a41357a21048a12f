"""The state of one run of the SP pass: the old graph, the graph being built, placements.

:class:`SPRewrite` is what every rule receives (:mod:`.sp_rules`): queries on the old,
single-device graph (shapes are global), the new graph with helpers to build it, and the
:class:`~.redistribute.Redistributor` that moves values between placements. The driver
(:mod:`.sequence_parallel`) fills it node by node.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import sympy
import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from autosp.passes.placement import REPLICATE, Shard, is_tensor, shape_exprs
from autosp.passes.redistribute import Redistributor

if TYPE_CHECKING:
    from autosp.passes.attention_schemes.base import AttentionScheme

__all__ = ["SPRewrite", "SPPassStats", "mutated_input"]

_INPLACE_FUNCTIONS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.ipow,
    operator.iand, operator.ior, operator.ixor, operator.setitem,
}



@dataclass
class SPPassStats:
    """What the pass did to one graph (also stored as ``gm.meta["autosp"]``)."""

    sdpa: int = 0
    #: the exchanges the attention scheme emitted (Ulysses: all-to-alls, four per attention call)
    all_to_all: int = 0
    #: ops run replicated (their sharded inputs all-gathered): ``"name (op): why"``
    fallbacks: list[str] = field(default_factory=list)
    #: per fallback: the bytes a rank holds for it at the compiled length (its gathered inputs,
    #: whole, and its replicated output), and where the user wrote it
    fallback_bytes: list[int] = field(default_factory=list)
    fallback_sources: list[str] = field(default_factory=list)
    seq_symbol: Optional[str] = None
    #: the pass splits a sequence of ``seq_symbol + seq_offset`` positions, the length attention
    #: runs over (-1 for a step that runs the model on ``tokens[:, :-1]``)
    seq_offset: int = 0
    #: largest static shift of the sequence seen (``x[:, k:]``); the local chunk must be longer.
    max_shift: int = 0
    #: ``cross_entropy(linear(..))`` computed in chunks of tokens (:mod:`autosp.ops.fused_loss`)
    fused_losses: int = 0
    #: losses computed in chunks of rows (``cat`` of per-chunk ``cross_entropy``) or summed per row,
    #: merged into one loss over the rows before the rewrite (:mod:`autosp.passes.chunks`)
    merged_losses: int = 0
    #: k or v inputs of attention exchanged before the model's own head repeat (``repeat_kv``)
    kv_exchanged_unrepeated: int = 0
    #: attention calls given those KV heads unrepeated (``enable_gqa=True``) instead of repeated after the exchange
    native_gqa: int = 0
    #: hand-written attention (``softmax(q @ k^T ..) @ v``) rewritten like SDPA (:mod:`.sp_rules.manual_attention`)
    manual_attention: int = 0
    #: attention calls (of either form) whose mask or score terms run per tile in
    #: :func:`~autosp.ops.tiled_attention.tiled_attention`: no ``S x S`` tensor exists for them
    tiled_attention: int = 0
    #: attention calls computed by the ring level (:mod:`autosp.ops.ring_attention`)
    ring_attention: int = 0
    #: how the SP group split attention: ``(ulysses, ring)``
    layout: tuple[int, int] = (1, 1)
    #: regions under the user's gradient checkpointing, recomputed whole in backward (:mod:`.checkpoints`)
    checkpoint_regions: int = 0
    #: attention calls that keep a dense ``S x S`` mask or scores on every rank, with the mask's
    #: size at the compiled length and why it could not be tiled (reported as a warning)
    dense_masks: list[str] = field(default_factory=list)
    #: the graph inputs (placeholder names) the attention masks of the graph read, tiled or dense:
    #: e.g. ``L_batch_position_ids_`` when packed documents come from restarting position ids
    mask_inputs: set[str] = field(default_factory=set)
    #: mixture-of-experts dispatches (a ``sort`` of the router's choices ... back in token order)
    #: run on each rank's own rows (:mod:`.sp_rules.expert_dispatch`)
    expert_dispatch: int = 0
    #: token-wise regions (MLPs) run over tiles of rows (:mod:`autosp.passes.tiled_mlp`)
    tiled_regions: int = 0
    #: ``conv1d`` over the sequence run on each rank's shard with a halo (:mod:`.sp_rules.convolution`)
    halo_convolutions: int = 0
    #: sequence mixers other than attention (scans, gated delta rules) run on the rank's heads over the
    #: whole sequence (:mod:`.sp_rules.mixers`), and the all-to-alls around them
    sequence_mixers: int = 0
    mixer_all_to_alls: int = 0
    #: sorts of sequence-sharded rows that could not run per rank, and why (each then runs replicated)
    dispatch_rejections: list[str] = field(default_factory=list)

    @property
    def attention(self) -> int:
        """Attention calls rewritten: SDPA and hand-written."""
        return self.sdpa + self.manual_attention

    @property
    def mixers(self) -> int:
        """Everything that mixes positions split over the SP group: attention and other sequence mixers."""
        return self.attention + self.sequence_mixers


class SPRewrite:
    """One run of the pass over one graph: what the rules read and build.

    The old (single-device) graph is read-only; for every old node the driver records its value
    in the new graph (:attr:`new_value`) and its placement (:attr:`placements`). Shapes are
    always those of the old graph (global sizes).
    """

    def __init__(
        self, gm: fx.GraphModule, sp_size: int, sp_rank: int, group_name: str, seq: sympy.Symbol, loss_chunk: Optional[int] = 0,
        kv_before_repeat: bool = True, native_gqa: Optional[bool] = None, seq_offset: int = 0,
        attention_tile: Optional[int] = 0, attention: Optional["AttentionScheme"] = None, ring: int = 1, zigzag: bool = True,
    ):
        self.gm = gm
        #: ring ranks of the SP group (``sp_size / ring`` ranks split the heads) and whether the
        #: ring's segments are head-tail (:func:`~autosp.layout.ring_segment`)
        self.ring, self.zigzag = ring, zigzag
        #: how each attention is parallelised (:mod:`autosp.passes.attention_schemes`; default Ulysses)
        self.attention: "AttentionScheme" = attention if attention is not None else _default_scheme()
        #: rows per chunk of the fused vocabulary projection and loss (0: automatic, None: off)
        self.loss_chunk = loss_chunk
        #: exchange KV heads before the model's own repeat of them (see the attention rule)
        self.kv_before_repeat = kv_before_repeat
        #: KV heads exchanged before the model's repeat reach attention unrepeated (``enable_gqa``)
        #: instead of repeated after the exchange; ``None``: where verified (CPU tensors)
        self.native_gqa = native_gqa
        #: rows/columns per tile of the tiled attention for masks built from positions (0: automatic,
        #: None: keep masks dense)
        self.attention_tile = attention_tile
        self.sp_size = sp_size
        self.sp_rank = sp_rank
        self.group_name = group_name
        #: the global length of the sequence the pass splits: the batch's ``seq`` plus ``seq_offset``
        self.seq: sympy.Expr = sympy.expand(seq + seq_offset)
        self.graph = fx.Graph()
        self.new_value: dict[fx.Node, Any] = {}
        self.placements: dict[fx.Node, Any] = {}
        self.stats = SPPassStats(seq_symbol=str(seq), seq_offset=seq_offset, layout=(sp_size // ring, ring))
        self.mutations: set[fx.Node] = set()  # new-graph nodes that mutate a tensor in place
        #: old node -> the hand-written attention chain it belongs to (filled by the driver)
        self.manual: dict[fx.Node, Any] = {}
        #: old node -> the mixture-of-experts dispatch it belongs to (filled at the region's sort)
        self.dispatch: dict[fx.Node, Any] = {}
        #: (score program, its leaves in the new graph, tile) -> the new graph's ``live_tiles`` of that mask
        self.live_tiles: dict[tuple, fx.Node] = {}
        self.redistribute = Redistributor(
            self.graph, self.new_value, self.placements, self._size_sources(), self.seq, sp_size, sp_rank, group_name
        )

    def _size_sources(self) -> dict[sympy.Symbol, Callable[[], fx.Node]]:
        """For every size symbol of the inputs: how to read it in the new graph."""
        sources: dict[sympy.Symbol, Callable[[], fx.Node]] = {}
        for node in self.gm.graph.find_nodes(op="placeholder"):
            val = node.meta.get("example_value")
            if isinstance(val, torch.SymInt) and isinstance(val.node.expr, sympy.Symbol):
                sources.setdefault(val.node.expr, lambda n=node: self.new_value[n])
        for node in self.gm.graph.find_nodes(op="placeholder"):
            val = node.meta.get("example_value")
            if is_tensor(val):
                for d, e in enumerate(shape_exprs(val)):
                    if isinstance(e, sympy.Symbol) and e not in sources:
                        sources[e] = lambda n=node, d=d: self.graph.call_method("size", (self.new_value[n], d))
        return sources

    # ------------------------------------------------------------- the old graph
    @staticmethod
    def val(node: Any) -> Any:
        """The example value Dynamo recorded for an old node (a fake tensor, a SymInt...)."""
        return node.meta.get("example_value") if isinstance(node, fx.Node) else node

    def shape(self, node: fx.Node) -> list[sympy.Expr]:
        return shape_exprs(self.val(node))

    def is_shard(self, node: Any) -> bool:
        return isinstance(node, fx.Node) and isinstance(self.placements.get(node), Shard)

    def seq_dims(self, node: fx.Node) -> list[int]:
        """The dims of ``node`` whose size is the global sequence length."""
        return [d for d, e in enumerate(self.shape(node)) if e == self.seq]

    def mutations_of(self, node: fx.Node) -> list[fx.Node]:
        """The old graph's in-place ops that mutate ``node``'s storage (through any alias), in order."""
        if not hasattr(self, "_mutators"):
            self._mutators: dict[Any, list[fx.Node]] = {}
            for n in self.gm.graph.nodes:
                target = mutated_input(self, n) if n.op in ("call_function", "call_method") else None
                if target is not None:
                    self._mutators.setdefault(_storage(self.val(target)), []).append(n)
        return list(self._mutators.get(_storage(self.val(node)), ()))

    def record_mask_inputs(self, nodes: list[fx.Node]) -> None:
        """Note the graph inputs that ``nodes`` (a mask, or a score program's leaves) are computed from."""
        todo, seen = list(nodes), set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder":
                self.stats.mask_inputs.add(n.name)
            todo.extend(n.all_input_nodes)

    def aliases(self, node: fx.Node) -> list[fx.Node]:
        """The old nodes visited so far whose tensors share ``node``'s storage (views, in-place
        results, ``node`` itself), from the fake tensors Dynamo recorded."""
        storage = _storage(self.val(node))
        if storage is None:
            return []
        return [n for n in self.placements if _storage(self.val(n)) == storage]

    def tensor_inputs(self, node: fx.Node) -> list[fx.Node]:
        out: list[fx.Node] = []
        fx.map_arg((node.args, node.kwargs), lambda n: out.append(n) if is_tensor(self.val(n)) else None)
        return out

    def base_shard(self, dim: int) -> Shard:
        """The placement of an unsliced activation with its sequence in ``dim``."""
        return Shard(dim, self.seq)

    def replicated_placement(self, node: fx.Node) -> Any:
        val = self.val(node)
        if is_tensor(val):
            return REPLICATE
        if isinstance(val, (tuple, list)):
            return tuple(REPLICATE if is_tensor(x) else None for x in val)
        return None

    # ------------------------------------------------------------- the new graph
    def new(self, node: Any) -> Any:
        """The new-graph value of an old node as it is (sharded or not); other values unchanged."""
        return fx.map_arg(node, self.new_value.__getitem__)

    def emit(self, expr: Any) -> Any:
        return self.redistribute.emit(expr)

    def copy(self, node: fx.Node, args: Any = None, kwargs: Any = None, target: Any = None) -> fx.Node:
        """``node`` in the new graph, with its args mapped as they are (or the given ones)."""
        args = self.new(node.args) if args is None else args
        kwargs = self.new(node.kwargs) if kwargs is None else kwargs
        new = self.graph.create_node(
            node.op, node.target if target is None else target, tuple(args), dict(kwargs), name=node.name
        )
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "custom"):
            if key in node.meta:
                new.meta[key] = node.meta[key]
        return new

    def record(self, node: fx.Node, new_value: Any, placement: Any) -> None:
        """Old ``node`` is ``new_value`` in the new graph, with ``placement``."""
        self.new_value[node] = new_value
        self.placements[node] = placement


def _storage(value: Any) -> Optional[int]:
    """An id of the (fake) tensor's storage, shared by its views."""
    return StorageWeakRef(value.untyped_storage()).cdata if is_tensor(value) else None


def _default_scheme() -> "AttentionScheme":
    from autosp.passes.attention_schemes.base import DEFAULT_SCHEME, get_scheme

    return get_scheme(DEFAULT_SCHEME)


def mutated_input(rw: "SPRewrite", node: fx.Node) -> Optional[fx.Node]:
    """The old node whose tensor ``node`` mutates in place, or ``None``."""
    target = None
    if node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("__"):
        target = node.args[0]
    elif node.op == "call_function":
        if node.kwargs.get("inplace") is True:
            target = node.args[0]
        elif "out" in node.kwargs:
            target = node.kwargs["out"]
        else:
            try:
                if node.target in _INPLACE_FUNCTIONS:
                    target = node.args[0]
            except TypeError:  # an unhashable target
                pass
    return target if isinstance(target, fx.Node) and is_tensor(rw.val(target)) else None
