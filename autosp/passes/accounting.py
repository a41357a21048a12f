"""Activation memory bookkeeping: which op kind produced each tensor saved for backward.

Two measurements share one vocabulary (:data:`OP_KINDS`) and one classifier (:func:`op_kind`):

* **compiled** (AutoSP with an AOT backend): the partitioned forward graph returns, after the
  user outputs, the tensors it saves for backward. :func:`list_saved_activations` maps each of
  them to the aten op that produced it (through views) and keeps its size as a symbolic
  expression; :class:`SavedActivations` evaluates it with the sequence length of each call.
* **eager** (single device, plain DDP): :class:`~.eager.EagerSavedTensors` records, during one
  forward, the aten op and innermost module that produced every tensor
  (a ``TorchDispatchMode`` plus module hooks), and the tensors autograd saves
  (``torch.autograd.graph.saved_tensors_hooks``).

A tensor is attributed to the op that *produced* it, the same way on both paths. Tensors that
exist before the forward starts (parameters, the batch) are not activations and are not
counted. Views are resolved to the tensor they alias, and each allocation counts once.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Optional

import sympy
import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from autosp.ops import tiled_rows
from autosp.passes.attention_schemes import schemes

__all__ = [
    "OP_KINDS",
    "COLLECTIVE_NAMESPACES",
    "op_kind",
    "qualified_op_name",
    "node_kind",
    "is_alias",
    "producer",
    "SavedTensor",
    "SavedActivations",
    "list_saved_activations",
    "empty_by_kind",
]

#: Op kinds of the activation memory report, in display order.
#:
#: ``attention``: scaled-dot-product attention outputs (and the elementwise work of attention
#: modules: RoPE, GQA repeats); ``all_to_all``: outputs of the SP collectives; ``linear``:
#: matmuls (projections, MLPs, the LM head) and MLP activations/gating; ``norm``: layer/RMS
#: norms; ``embedding``: embedding lookups; ``loss``: log-softmax and the loss; ``other``:
#: everything else (residual adds, RoPE tables, masks).
OP_KINDS = ("attention", "all_to_all", "linear", "norm", "embedding", "loss", "other")

#: namespaces of the collective ops (AutoSP's and torch's functional collectives)
#: torch's functional collectives (the sharded mode's gathers) and what the attention schemes insert
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", *(ns for s in schemes() for ns in s.op_namespaces)})
_BY_OP: dict[str, str] = {}
for _kind, _names in {
    "attention": (
        "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable",
        "_scaled_dot_product_attention_math", "_scaled_dot_product_attention_math_for_mps",
        "_flash_attention_forward", "_efficient_attention_forward",
        "tiled_attention", "tiled_attention_backward", "live_tiles",  # autosp_attn:: (autosp.ops.tiled_attention)
        "ring_attention", "ring_attention_backward", "ring_live_tiles",  # autosp_attn:: (autosp.ops.ring_attention)
    ),
    "linear": (
        "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_int_mm", "mv", "addmv",
        "_addmm_activation", "_scaled_mm",
        # activations: the elementwise half of an MLP
        "silu", "gelu", "relu", "sigmoid", "tanh", "hardswish", "hardsigmoid", "leaky_relu",
        "elu", "mish", "softplus", "glu", "hardtanh", "relu6",
    ),
    "norm": (
        "native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm", "native_group_norm",
        "group_norm", "native_batch_norm", "batch_norm", "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
        "_batch_norm_with_update", "_batch_norm_with_update_functional",
    ),
    "embedding": ("embedding", "embedding_bag", "_embedding_bag"),
    "loss": (
        "_log_softmax", "log_softmax", "nll_loss_forward", "nll_loss2d_forward", "nll_loss",
        "cross_entropy_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
        "binary_cross_entropy", "binary_cross_entropy_with_logits",
        "linear_cross_entropy",  # autosp_loss:: (autosp.ops.fused_loss)
    ),
}.items():
    for _n in _names:
        _BY_OP[_n] = _kind

# innermost-module class names (lower case) -> kind, for ops without a kind of their own
_BY_MODULE = (
    ("norm", "norm"),
    ("embedding", "embedding"),
    ("mlp", "linear"),
    ("feedforward", "linear"),
    ("ffn", "linear"),
    ("swiglu", "linear"),
    ("geglu", "linear"),
    ("attention", "attention"),
    ("attn", "attention"),
)


def empty_by_kind() -> dict[str, int]:
    return {k: 0 for k in OP_KINDS}


def op_kind(op_name: str, module_type: Optional[str] = None) -> str:
    """The kind of an op, from its qualified name (``"aten::mm"``, ``"autosp::seq_gather"``)
    and, for ops with no kind of their own (elementwise, reductions), the class name of the
    innermost module it ran in (``"RMSNorm"`` -> ``norm``, ``"FeedForward"`` -> ``linear``)."""
    ns, _, name = op_name.rpartition("::")
    for scheme in schemes():  # what an attention scheme inserts: the kind it names
        if ns in scheme.op_namespaces:
            return scheme.collective_kind
    if ns in COLLECTIVE_NAMESPACES:
        return "all_to_all"
    kind = _BY_OP.get(name)
    if kind is not None:
        return kind
    if module_type:
        low = module_type.lower()
        for key, k in _BY_MODULE:
            if key in low:
                return k
    return "other"


def qualified_op_name(target: Any) -> Optional[str]:
    """The qualified name (``"aten::mm"``) of an aten/custom op target, else ``None``."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def is_alias(target: Any) -> bool:
    """Ops whose output shares its input's storage (views, and ``_unsafe_view``)."""
    return isinstance(target, torch._ops.OpOverload) and (
        target.is_view or target._overloadpacket in (torch.ops.aten._unsafe_view, torch.ops.aten.alias)
    )


def module_types(node: fx.Node) -> tuple[str, ...]:
    """Class names of the modules ``node`` ran in (``nn_module_stack``), outermost first."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    out = []
    for _, mod_type in stack.values():
        out.append(mod_type.__name__ if isinstance(mod_type, type) else str(mod_type).rsplit(".", 1)[-1])
    return tuple(out)


def _innermost_module_type(node: fx.Node) -> Optional[str]:
    types = module_types(node)
    return types[-1] if types else None


def producer(node: fx.Node) -> fx.Node:
    """The node whose allocation ``node`` aliases (walks back through views)."""
    while node.op == "call_function" and is_alias(node.target) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def node_kind(node: fx.Node) -> str:
    """The :data:`OP_KINDS` entry of an aten-level FX node (views take their input's kind;
    ``getitem`` of a multi-output op takes that op's kind)."""
    node = producer(node)
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = producer(node.args[0])
    if node.op != "call_function":
        return "other"
    if node.target is tiled_rows.tiled_rows._opoverload:  # a tiled region: the kind of what it holds
        return tiled_rows.region_kind(node.args[2])
    # inductor decomposes before partitioning; ``original_aten`` keeps the op it came from
    name = qualified_op_name(node.meta.get("original_aten")) or qualified_op_name(node.target)
    return op_kind(name, _innermost_module_type(node)) if name else "other"


def _hinted_bytes(val: torch.Tensor) -> int:
    numel = 1
    for d in val.shape:
        numel *= int(d.node.hint) if isinstance(d, torch.SymInt) and d.node.hint is not None else (int(d) if not isinstance(d, torch.SymInt) else 0)
    return numel * val.element_size()


def _to_expr(v: Any) -> sympy.Expr:
    if isinstance(v, torch.SymInt):
        return sympy.sympify(v.node.expr)
    return sympy.Integer(int(v))


@dataclass
class SavedTensor:
    """One allocation the forward graph keeps alive for backward."""

    name: str
    kind: str
    nbytes: sympy.Expr
    shape: tuple[str, ...]
    dtype: str
    #: class names of the modules the producing op ran in, outermost first (may be empty for
    #: ops a pass inserted)
    modules: tuple[str, ...] = ()
    #: kept in host memory between forward and backward (activation offload), not on the device
    host: bool = False


@dataclass
class SavedActivations:
    """The tensors one compiled training graph saves for backward, and what its partition did.

    ``tensors`` have symbolic sizes; :meth:`bytes_by_kind` evaluates them for the sequence
    length of the latest call. The AutoSP backend counts the calls and sets ``binding`` before
    every call; :meth:`snapshot` is a copy that later calls leave alone (what
    :attr:`AutoSPStrategy.compiled_steps <lightning_autosp.AutoSPStrategy.compiled_steps>` hands out).
    """

    tensors: list[SavedTensor]
    #: collectives in the forward / backward graph after partitioning
    fw_collectives: int = 0
    bw_collectives: int = 0
    #: forward ops (by aten name) that the backward graph recomputes
    recomputed: dict[str, int] = field(default_factory=dict)
    sac: bool = False
    calls: int = 0
    #: names of the size symbols (``"s0"``) and their values in the latest call
    symbols: tuple[str, ...] = ()
    binding: tuple[int, ...] = ()
    #: the symbols that follow the global sequence length ``S``: name -> ``(divisor, remainder,
    #: offset)``, the symbol is ``ceil(L / divisor)`` with ``L = S + offset`` (the positions the pass
    #: splits), for the lengths with ``divisor * ceil(L / divisor) - L == remainder`` only (``None``:
    #: any length); see :meth:`binding_at`
    length_symbols: dict = field(default_factory=dict)
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def snapshot(self) -> "SavedActivations":
        """A copy whose ``calls`` and ``binding`` stay as they are now."""
        copy = replace(self, tensors=list(self.tensors), recomputed=dict(self.recomputed))
        copy._cache = self._cache  # same tensors: the sizes per binding are shared
        return copy

    def binding_at(self, seq_len: int) -> dict[str, int]:
        """The size symbols at global sequence length ``seq_len``, the others as in the latest
        call. Raises ``ValueError`` for a length the graph was not compiled for (another
        remainder modulo ``sp_size``: the sizes of another compile)."""
        out = dict(zip(self.symbols, self.binding))
        for name, (divisor, remainder, offset) in self.length_symbols.items():
            length = seq_len + offset
            value = -(-length // divisor)
            if remainder is not None and divisor * value - length != remainder:
                raise ValueError(
                    f"this graph was compiled for sequence lengths S with {divisor}*ceil(L/{divisor}) - L == {remainder} "
                    f"(L = S{offset:+d}); {seq_len} is not one of them"
                )
            out[name] = value
        return out

    def bytes_by_kind(self, binding: Optional[Mapping[str, int]] = None) -> dict[str, int]:
        """Bytes saved per op kind by one call; ``binding`` maps size-symbol names to values
        (default: those of the latest call)."""
        if binding is None:
            binding = dict(zip(self.symbols, self.binding))
        key = tuple(sorted(binding.items()))
        if key not in self._cache:
            out = empty_by_kind()
            out.update(self.bytes_by(lambda t: t.kind, binding, host=False))
            self._cache[key] = out
        return dict(self._cache[key])

    def host_bytes(self, binding: Optional[Mapping[str, int]] = None) -> int:
        """Bytes one call keeps in host memory for backward (activation offload); not in
        :meth:`bytes_by_kind`, which counts the device's."""
        return sum(self.bytes_by(lambda t: "host", binding, host=True).values())

    def bytes_by(
        self, group: Callable[[SavedTensor], str], binding: Optional[Mapping[str, int]] = None, host: Optional[bool] = None
    ) -> dict[str, int]:
        """Bytes saved by one call, summed per ``group(tensor)`` (e.g. by module); ``host``:
        only the tensors offloaded to host memory (``True``) or kept on the device (``False``)."""
        if binding is None:
            binding = dict(zip(self.symbols, self.binding))
        out: dict[str, int] = {}
        for t in self.tensors:
            if host is not None and t.host != host:
                continue
            g = group(t)
            out[g] = out.get(g, 0) + _evaluate(t.nbytes, binding, t.name)
        return out


def _evaluate(expr: sympy.Expr, binding: Mapping[str, int], name: str) -> int:
    if expr.is_Integer:
        return int(expr)
    missing = sorted(str(s) for s in expr.free_symbols if str(s) not in binding)
    if missing:
        raise ValueError(f"saved tensor {name}: size {expr} depends on unbound symbols {missing}")
    val = expr.subs({s: binding[str(s)] for s in expr.free_symbols})
    return int(val)


def list_saved_activations(fw: fx.GraphModule, num_fwd_outputs: int) -> list[SavedTensor]:
    """Read-only pass over a partitioned forward graph: the tensors it saves for backward.

    The outputs after the first ``num_fwd_outputs`` are saved for backward. Each is resolved
    through views to the allocation it aliases; graph inputs (parameters, the batch) are not
    activations and are skipped; each allocation counts once.
    """
    out_node = fw.graph.find_nodes(op="output")[0]
    outs = tree_leaves(out_node.args[0])
    seen: set[fx.Node] = set()
    saved: list[SavedTensor] = []
    # sizes the graph's inputs fix (the sequence length); any other symbol in a saved size (a
    # random op's generator state when backward replays it) is taken at its traced value
    bound = set()
    for p in fw.graph.find_nodes(op="placeholder"):
        v = p.meta.get("val")
        for d in (v.shape if isinstance(v, torch.Tensor) else (v,) if isinstance(v, torch.SymInt) else ()):
            bound |= _to_expr(d).free_symbols
    for n in outs[num_fwd_outputs:]:
        if not isinstance(n, fx.Node):
            continue
        host = n.op == "call_function" and qualified_op_name(n.target) == "autosp_offload::offload"  # passes.offload
        base = producer(n.args[0] if host else n)
        if base.op == "placeholder" or base in seen:
            continue
        val = base.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue  # saved SymInts
        seen.add(base)
        nbytes = _to_expr(val.numel()) * val.element_size()
        if not nbytes.free_symbols <= bound:
            nbytes = sympy.Integer(_hinted_bytes(val))
        saved.append(
            SavedTensor(
                name=base.name,
                kind=node_kind(base),
                nbytes=sympy.expand(nbytes),
                shape=tuple(str(s) for s in val.shape),
                dtype=str(val.dtype).removeprefix("torch."),
                modules=module_types(base),
                host=host,
            )
        )
    return saved


def count_ops(gm: fx.GraphModule, namespaces: Iterable[str] = COLLECTIVE_NAMESPACES) -> int:
    ns = set(namespaces)
    return sum(
        1 for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace in ns
    )
