"""Rules for reductions and losses.

A reduction over other dims stays sharded. A ``sum``/``mean`` over the sequence becomes a
local sum all-reduced over the SP group (``mean`` divided by the global count), a ``histc`` of
sharded values the sum of each rank's counts;
``cross_entropy``/``nll_loss`` become :func:`~autosp.passes.runtime.token_loss`,
token-weighted and ``ignore_index``-aware, so the loss is the one of one device.

``cross_entropy(linear(h, W, b) [row slices, reshapes to (tokens, V), dtype casts], target)``
whose logits nothing else reads (not returned, logged or reused) becomes
:func:`~autosp.passes.runtime.linear_token_loss`: the same loss, computed in chunks of
tokens by :mod:`autosp.ops.fused_loss`, so the ``tokens x V`` logits are never live.
"""

from __future__ import annotations

import inspect
import operator
from typing import TYPE_CHECKING, Any, Optional

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.passes import runtime
from autosp.passes.placement import REPLICATE, Shard, norm_dim
from autosp.passes.sp_rules.registry import OpCall, RuleResult, calls, op, sp_rule

if TYPE_CHECKING:
    from autosp.passes.rewrite import SPRewrite

REDUCTIONS = tuple(
    op(name, getattr(torch, name))
    for name in ("sum", "mean", "amax", "amin", "logsumexp", "var", "std", "all", "any", "prod", "argmax", "argmin")
)


def _dim_and_keepdim(node: fx.Node, call: OpCall) -> tuple:
    """``dim`` and ``keepdim`` of a reduction, positional or not. ``var``/``std`` take
    ``unbiased`` before ``keepdim`` (``torch.var(x, dim, unbiased, keepdim)``), and
    ``torch.var(x, unbiased)`` reduces every dim."""
    args, kwargs = node.args, node.kwargs
    keepdim_pos = 3 if call.name in ("var", "std") else 2
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if isinstance(dim, bool):  # var(x, unbiased) / std(x, unbiased)
        dim = None
    keepdim = kwargs.get("keepdim", args[keepdim_pos] if len(args) > keepdim_pos else False)
    return dim, keepdim


@sp_rule(*REDUCTIONS)
def reduce(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    x = node.args[0]
    shard = rw.placements[x]
    if not isinstance(shard, Shard) or len(rw.tensor_inputs(node)) != 1:
        return None
    ndim = rw.val(x).dim()
    dim, keepdim = _dim_and_keepdim(node, call)
    if not isinstance(keepdim, bool) or isinstance(dim, fx.Node):
        return None
    dims = None if dim is None else tuple(norm_dim(d, ndim) for d in ((dim,) if isinstance(dim, int) else dim))
    if dims is not None and shard.dim not in dims:  # the sequence axis survives
        removed = 0 if keepdim else sum(1 for d in dims if d < shard.dim)
        return rw.copy(node), shard.with_dim(shard.dim - removed)
    if call.name not in ("sum", "mean") or set(node.kwargs) - {"dim", "keepdim", "dtype"} or len(node.args) > 3:
        return None
    dtype = node.kwargs.get("dtype")
    group = (rw.group_name, rw.sp_size)
    if call.name == "sum":
        return rw.graph.call_function(runtime.reduce_sum, (rw.new_value[x], dims, keepdim, *group, dtype)), REPLICATE
    shp = rw.shape(x)
    count = sympy.Integer(1)
    for d in dims if dims is not None else range(ndim):
        count *= shp[d]
    reduced = rw.graph.call_function(runtime.reduce_mean, (rw.new_value[x], dims, keepdim, rw.emit(count), *group, dtype))
    return reduced, REPLICATE


@sp_rule(op("histc", torch.histc))
def histogram(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """``torch.histc`` of sequence-sharded values (a router's count of the tokens sent to each
    expert, for a load-balancing loss): each rank counts its own tokens, the counts are summed
    over the SP group - the counts of one device, exactly."""
    if not rw.is_shard(node.args[0]) or len(rw.tensor_inputs(node)) != 1:
        return None
    return rw.graph.call_function(runtime.group_sum, (rw.copy(node), rw.group_name, rw.sp_size)), REPLICATE


_LOSS_SIGNATURES = {F.cross_entropy: inspect.signature(F.cross_entropy), F.nll_loss: inspect.signature(F.nll_loss)}


def loss_arguments(node: fx.Node) -> Optional[dict[str, Any]]:
    """Every argument of a ``cross_entropy``/``nll_loss`` call by name, defaults included;
    ``None`` for another node or arguments that do not bind."""
    sig = _LOSS_SIGNATURES.get(node.target) if node.op == "call_function" else None
    if sig is None:
        return None
    try:
        bound = sig.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    return {**{k: p.default for k, p in sig.parameters.items()}, **bound.arguments}


@sp_rule(op("cross_entropy", F.cross_entropy, method=False), op("nll_loss", F.nll_loss, method=False))
def loss(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    a = loss_arguments(node)
    if a is None:
        return None
    inp, tgt, weight = a["input"], a["target"], a["weight"]
    if a.get("size_average") is not None or a.get("reduce") is not None:
        return None
    smoothing = a.get("label_smoothing", 0.0)
    if smoothing and weight is not None:
        return None
    shard = rw.placements.get(inp)
    target_val, input_val = rw.val(tgt), rw.val(inp)
    if not isinstance(shard, Shard) or target_val.is_floating_point() or rw.is_shard(weight):
        return None
    # [N, C] with the sequence in N, or [B, C, S, ...] with it after the class dim
    if (input_val.dim() == 2 and shard.dim != 0) or (input_val.dim() > 2 and shard.dim < 2) or input_val.dim() < 2:
        return None
    target_shard = shard.with_dim(shard.dim if input_val.dim() == 2 else shard.dim - 1)
    if rw.is_shard(tgt):
        current = rw.placements[tgt]
        if current != target_shard and not (current.dim == target_shard.dim and current.same_layout(target_shard)):
            return None
        new_target = rw.new_value[tgt]
    else:
        new_target = rw.redistribute.to_shard(tgt, target_shard)
    reduction = a["reduction"]
    fused = _vocab_projection(rw, node, inp) if call.name == "cross_entropy" and reduction in ("mean", "sum") else None
    if fused is not None and not (smoothing and weight is not None):
        rw.stats.fused_losses += 1
        args = (*fused, new_target, rw.new_value.get(weight) if weight is not None else None, a["ignore_index"], reduction,
                smoothing or 0.0, rw.loss_chunk, rw.group_name, rw.sp_size)
        return rw.graph.call_function(runtime.linear_token_loss, args), REPLICATE
    if reduction == "none":
        args = [rw.new_value[inp], new_target, *rw.new(node.args[2:])]
        return rw.copy(node, args, dict(rw.new(node.kwargs))), target_shard
    if reduction not in ("mean", "sum"):
        return None
    total = rw.graph.call_function(
        runtime.token_loss,
        (
            call.name, rw.new_value[inp], new_target, rw.new_value.get(weight) if weight is not None else None,
            a["ignore_index"], reduction, smoothing or 0.0, rw.group_name, rw.sp_size,
        ),
    )
    return total, REPLICATE


_LINEAR = (F.linear, torch._C._nn.linear)
_RESHAPES = ("view", "reshape")
_KEEP_ROWS = ("contiguous", "float", "double", "half", "bfloat16", "to", "type")  # layout and dtype only


def _row_index(index: Any, ndim: int) -> bool:
    """``x[index]`` only slices dims before the last (rows of the logits, not classes); a leading
    ``...`` stands for full slices (``x[..., :-1, :]``)."""
    index = index if isinstance(index, tuple) else (index,)
    if index and index[0] is Ellipsis:
        index = (slice(None),) * (ndim - len(index) + 1) + index[1:]
    if not all(isinstance(i, slice) for i in index) or len(index) > ndim:
        return False
    return len(index) < ndim or index[-1] == slice(None)


def _row_op(node: fx.Node, ndim: int) -> Optional[str]:
    """How ``node`` (on a tensor of ``ndim`` dims) may act on logit rows: ``"slice"`` (rows
    only), ``"reshape"`` (``view``/``reshape``), ``"keep"`` (layout or dtype), else ``None``."""
    if node.target is operator.getitem:
        return "slice" if _row_index(node.args[1], ndim) else None
    if any(calls(node, name) for name in _RESHAPES):
        return "reshape"
    return "keep" if node.op == "call_method" and node.target in _KEEP_ROWS else None


def _chain_step(rw: "SPRewrite", node: fx.Node, vocab: Any) -> Optional[fx.Node]:
    """The input of ``node`` if ``node`` maps logit rows to logit rows (keeps the class dim
    last and whole: row slices, reshapes, casts), else ``None``."""
    val = rw.val(node)
    if not isinstance(node.args[0] if node.args else None, fx.Node):
        return None
    src = node.args[0]
    src_val = rw.val(src)
    if not (isinstance(val, torch.Tensor) and isinstance(src_val, torch.Tensor)) or val.dim() < 1 or src_val.dim() < 1:
        return None
    if val.shape[-1] != vocab or src_val.shape[-1] != vocab or val.device != src_val.device:
        return None
    return src if _row_op(node, src_val.dim()) is not None else None


def _vocab_projection(rw: "SPRewrite", loss: fx.Node, inp: fx.Node) -> Optional[tuple]:
    """``(h, W, b, logits_dtype, with_grad)`` in the new graph if the input ``inp`` of the
    ``cross_entropy`` node ``loss`` is a ``linear`` seen through row slices, reshapes and casts,
    read by nothing else; else ``None``. ``h`` carries the new graph's row slices (they differ
    per rank on a shifted sequence). Dtypes follow what the graph recorded, autocast included:
    ``h``, ``W``, ``b`` are cast to the dtype of the linear's output, and the loss is computed in
    the dtype of the loss (autocast upcasts ``cross_entropy`` of bf16 logits to fp32)."""
    if rw.loss_chunk is None or rw.val(inp).dim() != 2:
        return None
    vocab = rw.val(inp).shape[-1]
    chain: list[fx.Node] = []
    node = inp
    while node.op != "call_function" or node.target not in _LINEAR:
        chain.append(node)
        node = _chain_step(rw, node, vocab)
        if node is None:
            return None
    linear = node
    if any(len(n.users) != 1 for n in (linear, *chain)):
        return None  # the logits (or a view of them) are also returned, logged or reused
    x, w = linear.args[0], linear.args[1] if len(linear.args) > 1 else linear.kwargs.get("weight")
    b = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    new_linear = rw.new_value[linear]
    if not rw.is_shard(linear) or not isinstance(w, fx.Node) or rw.is_shard(w) or rw.is_shard(b) or rw.val(w).dim() != 2:
        return None
    if not (isinstance(new_linear, fx.Node) and new_linear.target in _LINEAR):
        return None
    # the linear's inputs as the new graph has them (h already this rank's tokens)
    new_x, new_w = new_linear.args[0], new_linear.args[1] if len(new_linear.args) > 1 else new_linear.kwargs.get("weight")
    new_b = new_linear.args[2] if len(new_linear.args) > 2 else new_linear.kwargs.get("bias")
    # the same steps in the new graph; only its row slices act on h (reshapes and casts are implied)
    new_chain, new = [], rw.new_value[inp]
    while new is not new_linear:
        if not isinstance(new, fx.Node) or not new.args or not isinstance(new.args[0], fx.Node):
            return None
        kind = _row_op(new, rw.val(x).dim())
        if kind is None:
            return None
        new_chain.append((new, kind))
        new = new.args[0]
    kinds = [kind for _, kind in reversed(new_chain)]  # from the linear towards the loss
    if "reshape" in kinds and "slice" in kinds[kinds.index("reshape") :]:
        return None  # a row slice after a reshape indexes the reshaped rows, not h's
    lin_dtype, loss_dtype = rw.val(linear).dtype, rw.val(loss).dtype
    if any(rw.val(n).dtype not in (lin_dtype, rw.val(inp).dtype) for n in chain):
        return None  # an intermediate cast (fp32 -> fp16 -> fp32) rounds what one cast would not

    def cast(old: fx.Node, new: Any) -> Any:
        return new if rw.val(old).dtype == lin_dtype else rw.graph.call_method("to", (new, lin_dtype))

    h = cast(x, new_x)
    for step, kind in reversed(new_chain):
        if kind == "slice":
            h = rw.graph.call_function(operator.getitem, (h, step.args[1]))
    bias = cast(b, new_b) if isinstance(b, fx.Node) else None
    logits_dtype = loss_dtype if loss_dtype != lin_dtype else None
    with_grad = bool(rw.val(linear).requires_grad)
    return h, cast(w, new_w), bias, logits_dtype, with_grad
