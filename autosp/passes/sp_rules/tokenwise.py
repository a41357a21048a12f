"""Rules for token-wise ops - each token's output depends on that token alone - and for ops
along one non-sequence dim.

Embedding, linear/matmul and norms are where activations become sequence-sharded: given a
replicated input with a sequence dim, they slice it to this rank's tokens first (they are the
``source`` rules), so the heavy compute after them runs on ``S / sp_size`` tokens.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.ops import tiled_rows  # noqa: F401  (registers autosp_tile::rows)
from autosp.passes.placement import REPLICATE, Shard, is_tensor, norm_dim
from autosp.passes.sp_rules.registry import OpCall, RuleResult, op, sp_rule

if TYPE_CHECKING:
    from autosp.passes.rewrite import SPRewrite


def _source_shard(rw: "SPRewrite", x: fx.Node, forbidden: Sequence[int]) -> Optional[Shard]:
    """The shard of a replicated input of a token-wise op: on its (single) sequence dim."""
    dims = rw.seq_dims(x)
    ndim = rw.val(x).dim()
    if len(dims) != 1 or dims[0] in {norm_dim(f, ndim) for f in forbidden}:
        return None
    return rw.base_shard(dims[0])


def _tokenwise(rw: "SPRewrite", node: fx.Node, forbidden: Sequence[int], out_dim: Callable[[int], int]) -> RuleResult:
    """An op on ``node.args[0]`` that is token-wise except along the ``forbidden`` dims (which
    it mixes, e.g. a linear's features); the other tensor arguments (weights) are replicated."""
    x = node.args[0]
    others = rw.tensor_inputs(node)[1:]
    if any(rw.is_shard(n) for n in others if n is not x):
        return None
    shard = rw.placements[x]
    ndim = rw.val(x).dim()
    if isinstance(shard, Shard):
        if shard.dim in {norm_dim(f, ndim) for f in forbidden}:
            return None
        new_x = rw.new_value[x]
    else:
        shard = _source_shard(rw, x, forbidden)
        if shard is None:  # no sequence dim: stays replicated
            return rw.copy(node), rw.replicated_placement(node)
        new_x = rw.redistribute.to_shard(x, shard)
    args = (new_x, *rw.new(node.args[1:]))
    return rw.copy(node, args), shard.with_dim(out_dim(shard.dim))


def _same_dim(dim: int) -> int:
    return dim


@sp_rule(op("linear", F.linear, method=False), source=True)
def linear(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    return _tokenwise(rw, node, forbidden=(-1,), out_dim=_same_dim)


@sp_rule(op("matmul", torch.matmul, operator.matmul), source=True)
def matmul(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """``x @ w`` with ``w`` a replicated ``[in, out]`` matrix: token-wise, like linear; and
    ``w @ x`` with ``w`` a replicated ``[out, in]`` matrix and ``x`` channels-first, ``[.., in, S]``
    (Mamba-1's time-step projection): token-wise too, the sequence stays last."""
    w = node.args[1]
    first, x = node.args[0], node.args[1]
    shard = rw.placements.get(x)
    if (
        not node.kwargs and is_tensor(rw.val(first)) and rw.val(first).dim() == 2 and not rw.is_shard(first)
        and not rw.seq_dims(first) and isinstance(shard, Shard) and rw.val(x).dim() >= 2 and shard.dim == rw.val(x).dim() - 1
    ):
        return rw.copy(node), shard
    if node.kwargs or not (is_tensor(rw.val(w)) and rw.val(w).dim() == 2 and not rw.seq_dims(w)):
        return None
    return _tokenwise(rw, node, forbidden=(-1,), out_dim=_same_dim)


@sp_rule(
    op("layer_norm", F.layer_norm, torch.layer_norm, method=False), op("rms_norm", F.rms_norm, torch.rms_norm, method=False),
    op("group_norm", F.group_norm, method=False), source=True,
)
def norm(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """Norms over the trailing ``normalized_shape`` dims (group norm mixes channels and the
    sequence: it runs replicated)."""
    if call.name == "group_norm":
        return None
    shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
    k = len(shape) if isinstance(shape, (tuple, list)) else 1
    return _tokenwise(rw, node, forbidden=tuple(range(-k, 0)), out_dim=_same_dim)


@sp_rule(op("tiled_rows", torch.ops.autosp_tile.rows.default, method=False))
def tiled_region(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """A region of token-wise ops run over tiles of rows (:mod:`autosp.passes.tiled_mlp`)."""
    return _tokenwise(rw, node, forbidden=(-1,), out_dim=_same_dim)


@sp_rule(op("embedding", F.embedding, method=False), source=True)
def embedding(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    return _tokenwise(rw, node, forbidden=(), out_dim=_same_dim)


@sp_rule(
    op("softmax", F.softmax, torch.softmax), op("log_softmax", F.log_softmax, torch.log_softmax),
    op("cumsum", torch.cumsum),
)
def along_dim(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """Shape-preserving ops along one dim: local when that dim is not the sequence."""
    x = node.args[0]
    shard = rw.placements[x]
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if not isinstance(shard, Shard) or not isinstance(dim, int) or norm_dim(dim, rw.val(x).dim()) == shard.dim:
        return None
    return rw.copy(node), shard


def _dim_arg(node: fx.Node, position: int, default: Optional[int] = None) -> Optional[int]:
    dim = node.kwargs.get("dim", node.args[position] if len(node.args) > position else default)
    return dim if isinstance(dim, int) else None


@sp_rule(op("topk", torch.topk), op("sort", torch.sort))
def select_along_dim(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """``topk``/``sort`` along a dim other than the sequence (a router's top experts per token):
    values and indices keep the input's split."""
    x = node.args[0]
    shard = rw.placements[x]
    dim = _dim_arg(node, 2 if call.name == "topk" else 1, -1)
    if not isinstance(shard, Shard) or dim is None or norm_dim(dim, rw.val(x).dim()) == shard.dim:
        return None
    if any(rw.is_shard(n) for n in rw.tensor_inputs(node)[1:]):
        return None
    return rw.copy(node), (shard, shard)


@sp_rule(op("gather", torch.gather), op("scatter", torch.scatter), op("scatter_add", torch.scatter_add))
def index_along_dim(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """``gather``/``scatter``/``scatter_add`` along a dim other than the sequence (a router's
    weights of its chosen experts, a mask of chosen groups): the input, the index and the source
    hold the same positions of the sequence, so each rank works on its own (an index or source
    held whole is sliced like the input)."""
    from autosp.passes.sp_rules.shape import elementwise

    x = node.args[0]
    dim = _dim_arg(node, 1)
    shards = [rw.placements[n] for n in rw.tensor_inputs(node) if rw.is_shard(n)]
    if call.name == "scatter_add" and dim is not None and not rw.is_shard(x):
        return sum_over_tokens(rw, node, call)
    if dim is None or not shards or any(norm_dim(dim, rw.val(x).dim()) == s.dim for s in shards):
        return None
    # every tensor holds the same positions: the same dims, the same sequence length (an index
    # shorter along the sequence would pick other rows on each rank; broadcasting is no excuse)
    seq = shards[0].dim
    tensors = [*rw.tensor_inputs(node), node]
    if any(rw.val(n).dim() != rw.val(x).dim() or rw.shape(n)[seq] != rw.shape(x)[seq] for n in tensors):
        return None
    return elementwise(rw, node, call)


@sp_rule(op("index_add", torch.index_add))
def sum_over_tokens(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """``d.scatter_add(dim, index, src)`` and ``d.index_add(dim, index, src)`` with ``index`` and
    ``src`` running along the sequence in ``dim`` into a replicated ``d`` (a load-balancing loss's
    count of the tokens each expert got, padding masked out): each rank adds its own tokens into
    zeros, the partial sums are added over the SP group and to ``d`` - one device's result. In
    place (``scatter_add_``), ``d`` is then overwritten with it (:mod:`..inplace`)."""
    from autosp.passes import runtime

    d, dim, index, src = (*node.args, None, None, None)[:4]
    dim = _dim_arg(node, 1)
    index = node.kwargs.get("index", index)
    src = node.kwargs.get("source" if call.name == "index_add" else "src", src)
    if dim is None or set(node.kwargs) - {"dim", "index", "src", "source"} or len(node.args) > 4:
        return None
    if not (isinstance(index, fx.Node) and isinstance(src, fx.Node)) or rw.is_shard(d):
        return None
    index_dim, src_dim = norm_dim(dim, rw.val(index).dim()), norm_dim(dim, rw.val(src).dim())
    shards = [p for p in (rw.placements.get(index), rw.placements.get(src)) if isinstance(p, Shard)]
    if not shards or rw.shape(index)[index_dim] != rw.shape(src)[src_dim]:
        return None
    if call.name == "scatter_add" and rw.shape(index) != rw.shape(src):
        return None
    shard = shards[0]
    if shard.dim != (index_dim if rw.is_shard(index) else src_dim) or any(not shard.same_layout(p) for p in shards):
        return None
    if len(shards) == 2 and index_dim != src_dim:
        return None
    new_index = rw.redistribute.to_shard(index, shard.with_dim(index_dim))  # the one held whole is sliced like the other
    new_src = rw.redistribute.to_shard(src, shard.with_dim(src_dim))
    args = (call.name, rw.new_value[d], dim, new_index, new_src, rw.group_name, rw.sp_size)
    return rw.graph.call_function(runtime.add_over_group, args), REPLICATE
