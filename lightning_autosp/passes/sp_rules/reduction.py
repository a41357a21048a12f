"""Rules for reductions and losses.

A reduction over other dims stays sharded. A ``sum``/``mean`` over the sequence becomes a
local sum all-reduced over the SP group (``mean`` divided by the global count);
``cross_entropy``/``nll_loss`` become :func:`~lightning_autosp.passes.runtime.token_loss`,
token-weighted and ``ignore_index``-aware, so the loss is the one of one device.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from lightning_autosp.passes import runtime
from lightning_autosp.passes.placement import REPLICATE, Shard, norm_dim
from lightning_autosp.passes.sp_rules.registry import OpCall, RuleResult, op, sp_rule

if TYPE_CHECKING:
    from lightning_autosp.passes.rewrite import SPRewrite

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


_LOSS_SIGNATURES = {F.cross_entropy: inspect.signature(F.cross_entropy), F.nll_loss: inspect.signature(F.nll_loss)}


@sp_rule(op("cross_entropy", F.cross_entropy, method=False), op("nll_loss", F.nll_loss, method=False))
def loss(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    sig = _LOSS_SIGNATURES[node.target]
    bound = sig.bind(*node.args, **node.kwargs)
    a = {**{k: p.default for k, p in sig.parameters.items()}, **bound.arguments}
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
