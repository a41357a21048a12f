"""Random ops on sequence-sharded tensors: dropout, ``rand_like``, ``randn_like``.

Every SP rank starts a step from the same RNG state (the same seed, which keeps the random ops
on replicated tensors identical across the group). Run as it is on each rank's shard, a random
op would then draw the same numbers for token ``i`` of every shard: the dropout masks of the
shards would repeat. These rules draw the random tensor for the global, single-device shape -
the same on every rank - and keep this rank's window of it, so each token gets its own draw,
forward and backward alike (autograd keeps the mask).

Attention dropout (``scaled_dot_product_attention(..., dropout_p>0)``) is drawn inside the
kernel on each rank's heads; it cannot be drawn globally, so the attention rule refuses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.errors import AutoSPError
from autosp.passes import runtime
from autosp.passes.placement import Shard
from autosp.passes.sp_rules.registry import OpCall, RuleResult, op, sp_rule

if TYPE_CHECKING:
    from autosp.passes.rewrite import SPRewrite

_DROPOUT_ARGS = ("input", "p", "training", "inplace")


@sp_rule(op("dropout", F.dropout, method=False))
def dropout(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    bound = {"p": 0.5, "training": True, "inplace": False, **dict(zip(_DROPOUT_ARGS, node.args)), **node.kwargs}
    x, p, training, inplace = bound["input"], bound["p"], bound["training"], bound["inplace"]
    shard = rw.placements.get(x)
    if not isinstance(shard, Shard) or any(isinstance(a, fx.Node) for a in (p, training, inplace)):
        return None  # run replicated: the same full mask on every rank, as one device draws it
    if not training or p == 0:
        return rw.copy(node), shard
    if inplace:
        raise AutoSPError(
            f"AutoSP: in-place dropout ({node.name}) on a tensor split over the sequence is not supported; "
            "use `F.dropout(x, p)` / `nn.Dropout(p)` without inplace=True."
        )
    noise = rw.graph.call_function(runtime.window_of_random, _window_args(rw, x, shard, "rand", torch.float32))
    return rw.graph.call_function(runtime.dropout_with, (rw.new_value[x], noise, p)), shard


@sp_rule(op("rand_like", torch.rand_like, method=False), op("randn_like", torch.randn_like, method=False))
def random_like(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    x = node.args[0] if node.args else node.kwargs.get("input")
    shard = rw.placements.get(x)
    if not isinstance(shard, Shard) or set(node.kwargs) - {"input", "dtype"} or len(node.args) > 1:
        return None
    dtype = node.kwargs.get("dtype") or rw.val(x).dtype
    kind = "rand" if call.name == "rand_like" else "randn"
    return rw.graph.call_function(runtime.window_of_random, _window_args(rw, x, shard, kind, dtype)), shard


def _window_args(rw: "SPRewrite", x: fx.Node, shard: Shard, kind: str, dtype: torch.dtype) -> tuple:
    """Arguments of :func:`runtime.window_of_random`: ``x``'s global shape and this rank's window."""
    global_shape = [rw.emit(e) for e in rw.shape(x)]
    return (rw.new_value[x], kind, dtype, global_shape, *rw.redistribute.slice_args(x, shard))
