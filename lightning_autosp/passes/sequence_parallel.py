"""The Ulysses sequence-parallel pass on Dynamo (torch IR) graphs.

``sequence_parallel_pass(gm, sp_size=P, sp_rank=r, group_name=...)`` rewrites a graph written
for one device into the graph one SP rank runs:

* graph inputs are replicated; activations become sequence-sharded at the first token-wise
  op (embedding, linear, norm) that sees the sequence dim, by slicing its input;
* replicated tensors that meet sharded ones (labels, position ids, RoPE tables) are sliced the
  same way, so positions, label shifts and masks built from ``arange`` are right on every rank;
* every ``F.scaled_dot_product_attention`` gets an all-to-all on q, k, v
  (``[B, H, S/P, D] -> [B, H/P, S, D]``) and one on its output (the reverse);
* reductions over the sequence (``sum``, ``mean``, ``cross_entropy``/``nll_loss`` with any
  reduction and ``ignore_index``) are combined over the SP group, token-weighted;
* a slice of a sharded tensor on the sequence (``logits[:, :-1]``) keeps every token where it is
  and is tracked as an uneven shard (see :mod:`.placement`): no token is lost at a boundary;
* an op the pass has no rule for gets its sharded inputs all-gathered and runs replicated -
  correct, only slower - and is reported in :attr:`SPPassStats.fallbacks`;
* graph outputs are all-gathered, so code outside the graph sees full-sequence values.

Postcondition (checked, :class:`~lightning_autosp.errors.AutoSPError` otherwise): every SDPA
reads its q, k, v from an all-to-all and feeds one; the graph lints.
"""

from __future__ import annotations

import inspect
import logging
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from lightning_autosp.errors import AutoSPError
from lightning_autosp.passes import runtime
from lightning_autosp.passes.placement import (
    REPLICATE,
    Shard,
    SizeEmitter,
    is_polynomial_quotient,
    shape_exprs,
)

__all__ = ["sequence_parallel_pass", "SPPassStats", "find_sequence_symbol", "SDPA", "ALL_TO_ALL"]

log = logging.getLogger(__name__)

SDPA = F.scaled_dot_product_attention
ALL_TO_ALL = torch.ops.autosp.all_to_all.default


@dataclass
class SPPassStats:
    """What the pass did to one graph (also stored as ``gm.meta["autosp"]``)."""

    sdpa: int = 0
    all_to_all: int = 0
    fallbacks: list[str] = field(default_factory=list)
    seq_symbol: Optional[str] = None
    #: largest static shift of the sequence seen (``x[:, k:]``); the local chunk must be longer.
    max_shift: int = 0


# ----------------------------------------------------------------------------- op tables
_ELEMENTWISE_FUNCS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.pow,
    operator.neg, operator.mod, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
    operator.ge, operator.and_, operator.or_, operator.xor, operator.invert,
    torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.pow, torch.neg, torch.exp,
    torch.log, torch.sqrt, torch.rsqrt, torch.tanh, torch.sigmoid, torch.sin, torch.cos, torch.abs,
    torch.clamp, torch.where, torch.maximum, torch.minimum, torch.erf, torch.square,
    torch.reciprocal, torch.relu, torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge,
    torch.logical_and, torch.logical_or, torch.logical_not, torch.masked_fill, torch.zeros_like,
    torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like,
    torch.clone, torch.lerp, torch.addcmul,
    F.gelu, F.silu, F.relu, F.dropout, F.sigmoid, F.tanh, F.softplus, F.mish, F.leaky_relu, F.elu,
    F.hardtanh, F.relu6,
}
_ELEMENTWISE_METHODS = {
    "add", "sub", "mul", "div", "true_divide", "pow", "neg", "exp", "log", "sqrt", "rsqrt", "tanh",
    "sigmoid", "sin", "cos", "abs", "clamp", "clamp_min", "clamp_max", "float", "half", "bfloat16",
    "double", "int", "long", "bool", "to", "type", "type_as", "contiguous", "clone", "detach",
    "masked_fill", "where", "square", "reciprocal", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_not", "logical_and", "logical_or", "relu", "erf", "lerp", "__and__", "__or__",
    "__invert__", "__mul__", "__add__", "__sub__", "__truediv__", "__neg__", "__rmul__", "__radd__",
    "__rsub__", "__rtruediv__", "silu", "gelu",
}
_RESHAPE_FUNCS = {torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze}
_RESHAPE_METHODS = {"view", "reshape", "flatten", "squeeze", "unsqueeze"}
_CREATE_METHODS = {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}
_SPLIT_FUNCS = {torch.split: "split", torch.chunk: "chunk", torch.unbind: "unbind", torch.tensor_split: "tensor_split"}
_SPLIT_METHODS = {"split", "chunk", "unbind", "split_with_sizes", "tensor_split"}
# ops that keep the shape and work along one dim
_DIMWISE = {F.softmax: "softmax", F.log_softmax: "softmax", torch.softmax: "softmax",
            torch.log_softmax: "softmax", torch.cumsum: "cumsum"}
_DIMWISE_METHODS = {"softmax", "log_softmax", "cumsum"}
_REDUCE_FUNCS = {torch.sum: "sum", torch.mean: "mean", torch.amax: "amax", torch.amin: "amin",
                 torch.logsumexp: "logsumexp", torch.var: "var", torch.std: "std", torch.all: "all",
                 torch.any: "any", torch.prod: "prod", torch.argmax: "argmax", torch.argmin: "argmin"}
_REDUCE_METHODS = {"sum", "mean", "amax", "amin", "logsumexp", "var", "std", "all", "any", "prod",
                   "argmax", "argmin"}
_LOSSES = {F.cross_entropy: inspect.signature(F.cross_entropy), F.nll_loss: inspect.signature(F.nll_loss)}
_SDPA_SIG = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_NORMS = {F.layer_norm: 1, F.rms_norm: 1, F.group_norm: None}


def _is_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def find_sequence_symbol(gm: fx.GraphModule, seq_dim: int) -> Optional[sympy.Symbol]:
    """The SymInt symbol of the sequence length: the symbol at ``seq_dim`` of the graph's
    (non-parameter) tensor inputs. ``None`` if no input has a symbolic sequence dim, or if
    several do and the graph has no attention (it then runs replicated, which is correct)."""
    seen: Counter = Counter()
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("example_value")
        if _is_tensor(val) and not isinstance(val, torch.nn.Parameter) and val.dim() > seq_dim:
            expr = shape_exprs(val)[seq_dim]
            if isinstance(expr, sympy.Symbol):
                seen[expr] += 1
    if not seen:
        return None
    (best, n), *rest = seen.most_common()
    if rest and rest[0][1] == n:
        if not gm.graph.find_nodes(op="call_function", target=SDPA):
            return None  # e.g. a metric update after a graph break: run it replicated, unchanged
        raise AutoSPError(
            f"AutoSP found several symbolic sizes at seq_dim={seq_dim} of the graph inputs "
            f"({', '.join(str(s) for s in seen)}); inputs must share one sequence length. "
            "Check `seq_dim` or make the batch's tensors the same length."
        )
    return best


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, sp_size: int, sp_rank: int, group_name: str, seq: sympy.Symbol):
        self.gm = gm
        self.P = sp_size
        self.r = sp_rank
        self.group = group_name
        self.seq = seq
        self.g = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.pl: dict[fx.Node, Any] = {}
        self.stats = SPPassStats(seq_symbol=str(seq))
        self._cache: dict[Any, fx.Node] = {}
        self.sizes = SizeEmitter(self.g, self._size_sources(), seq, sp_size)

    # ------------------------------------------------------------------ helpers
    def _size_sources(self) -> dict[sympy.Symbol, Callable[[], fx.Node]]:
        sources: dict[sympy.Symbol, Callable[[], fx.Node]] = {}
        for node in self.gm.graph.find_nodes(op="placeholder"):
            val = node.meta.get("example_value")
            if isinstance(val, torch.SymInt) and isinstance(val.node.expr, sympy.Symbol):
                sources.setdefault(val.node.expr, lambda n=node: self.env[n])
        for node in self.gm.graph.find_nodes(op="placeholder"):
            val = node.meta.get("example_value")
            if _is_tensor(val):
                for d, e in enumerate(shape_exprs(val)):
                    if isinstance(e, sympy.Symbol) and e not in sources:
                        sources[e] = lambda n=node, d=d: self.g.call_method("size", (self.env[n], d))
        return sources

    @staticmethod
    def val(n: Any) -> Any:
        return n.meta.get("example_value") if isinstance(n, fx.Node) else n

    def shape(self, n: fx.Node) -> list[sympy.Expr]:
        return shape_exprs(self.val(n))

    def is_shard(self, n: Any) -> bool:
        return isinstance(n, fx.Node) and isinstance(self.pl.get(n), Shard)

    def seq_dims(self, n: fx.Node) -> list[int]:
        return [d for d, e in enumerate(self.shape(n)) if e == self.seq]

    def emit(self, expr) -> Any:
        return self.sizes.emit(expr)

    def bounds(self, sh: Shard) -> tuple[sympy.Expr, sympy.Expr]:
        """(first tensor position held by this rank, number held), in chunk terms."""
        c = self.sizes.chunk
        lo = sympy.Integer(0) if self.r == 0 else self.r * c - sh.off
        hi = sh.length if self.r == self.P - 1 else (self.r + 1) * c - sh.off
        return lo, sympy.expand(hi - lo)

    def outer(self, n: fx.Node, sh: Shard) -> sympy.Expr:
        q = is_polynomial_quotient(self.shape(n)[sh.dim], sh.length * sh.inner)
        assert q is not None, "placement invariant broken: dim size is not outer*length*inner"
        return q

    def local_size(self, outer: sympy.Expr, sh: Shard) -> Any:
        _, n = self.bounds(sh)
        return self.emit(outer * n * sh.inner)

    def copy(self, node: fx.Node, args=None, kwargs=None, target=None) -> fx.Node:
        args = fx.map_arg(node.args, self.env.__getitem__) if args is None else args
        kwargs = fx.map_arg(node.kwargs, self.env.__getitem__) if kwargs is None else kwargs
        new = self.g.create_node(node.op, node.target if target is None else target, tuple(args), dict(kwargs), name=node.name)
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in node.meta:
                new.meta[key] = node.meta[key]
        return new

    def replicated_placement(self, node: fx.Node) -> Any:
        v = self.val(node)
        if _is_tensor(v):
            return REPLICATE
        if isinstance(v, (tuple, list)):
            return tuple(REPLICATE if _is_tensor(x) else None for x in v)
        return None

    # -------------------------------------------------------------- redistribution
    def as_replicate(self, n: Any) -> Any:
        """The new-graph value of old node ``n`` with full (replicated) data."""
        if not isinstance(n, fx.Node):
            return n
        sh = self.pl.get(n)
        if not isinstance(sh, Shard):
            return self.env[n]
        key = ("R", n)
        if key not in self._cache:
            lo, n_local = self.bounds(sh)
            c = self.sizes.chunk
            left = lo + sh.off - self.r * c
            right = (self.r + 1) * c - (lo + n_local + sh.off)
            self._cache[key] = self.g.call_function(
                runtime.shard_gather,
                (self.env[n], sh.dim, self.emit(self.outer(n, sh)), self.emit(sh.inner), sh.off, self.emit(sh.length),
                 self.emit(sympy.expand(left)), self.emit(sympy.expand(right)), self.group, self.P),
            )
        return self._cache[key]

    def as_shard(self, n: fx.Node, sh: Shard) -> fx.Node:
        """The new-graph value of replicated old node ``n`` sliced to placement ``sh``."""
        cur = self.pl.get(n)
        if isinstance(cur, Shard):
            if cur.dim != sh.dim or not cur.same_layout(sh):
                raise AutoSPError(f"internal: {n.name} has placement {cur}, wanted {sh}")
            return self.env[n]
        key = ("S", n, sh)
        if key not in self._cache:
            lo, n_local = self.bounds(sh)
            self._cache[key] = self.g.call_function(
                runtime.shard_slice,
                (self.env[n], sh.dim, self.emit(self.outer(n, sh)), self.emit(sh.length), self.emit(sh.inner),
                 self.emit(lo), self.emit(n_local)),
            )
            self._cache[key].meta["autosp_slice_of"] = n.name
        return self._cache[key]

    def base_shard(self, dim: int) -> Shard:
        return Shard(dim, self.seq)

    # ------------------------------------------------------------------ driver
    def run(self) -> fx.Graph:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                new = self.copy(node)
                new.meta.update(node.meta)
                self.env[node] = new
                self.pl[node] = self.replicated_placement(node)
            elif node.op == "output":
                out = fx.map_arg(node.args[0], self.as_replicate)
                self.g.output(out)
            elif node.op == "get_attr":
                self.env[node] = self.copy(node)
                self.pl[node] = self.replicated_placement(node)
            else:
                self.visit(node)
        self.g.eliminate_dead_code()
        return self.g

    def tensor_inputs(self, node: fx.Node) -> list[fx.Node]:
        out: list[fx.Node] = []
        fx.map_arg((node.args, node.kwargs), lambda n: out.append(n) if _is_tensor(self.val(n)) else None)
        return out

    def _subgraph_attention(self, node: fx.Node) -> Optional[str]:
        """Name of a sub-graph (of a higher-order op such as torch.utils.checkpoint) that calls SDPA."""
        for a in node.args:
            if isinstance(a, fx.Node) and a.op == "get_attr":
                sub = getattr(self.gm, a.target, None)
                if isinstance(sub, fx.GraphModule) and any(
                    n.target is SDPA or self._subgraph_has_sdpa(n, sub) for n in sub.graph.nodes
                ):
                    return a.target
        return None

    def _subgraph_has_sdpa(self, n: fx.Node, owner: fx.GraphModule) -> bool:
        if n.op != "get_attr":
            return False
        sub = getattr(owner, n.target, None)
        return isinstance(sub, fx.GraphModule) and any(
            m.target is SDPA or self._subgraph_has_sdpa(m, sub) for m in sub.graph.nodes
        )

    def visit(self, node: fx.Node) -> None:
        sub = self._subgraph_attention(node) if node.op == "call_function" else None
        if sub is not None:
            raise AutoSPError(
                f"{node.name}: attention runs inside `{getattr(node.target, '__name__', node.target)}` (sub-graph "
                f"{sub}), e.g. a block wrapped in torch.utils.checkpoint. AutoSP does not rewrite attention inside "
                "such regions. Remove torch.utils.checkpoint from the model: AutoSPStrategy(sac=True) already "
                "recomputes the cheap ops in backward and keeps attention outputs saved."
            )
        if not any(self.is_shard(n) for n in self.tensor_inputs(node)) and not self._is_source(node) and not self._is_sdpa(node):
            # nothing sharded flows in: run as on one device (indices, masks, RoPE tables).
            self.env[node] = self.copy(node)
            self.pl[node] = self.replicated_placement(node)
            if node.op == "call_function" and node.target is operator.getitem and isinstance(self.pl.get(node.args[0]), tuple):
                self.pl[node] = self.pl[node.args[0]][node.args[1]]
            return
        rule = self._rule(node)
        result = rule(node) if rule is not None else None
        if result is None:
            self.fallback(node, "no sequence-parallel rule" if rule is None else "unsupported arguments")

    def _is_sdpa(self, node: fx.Node) -> bool:
        return node.op == "call_function" and node.target is SDPA

    def _is_source(self, node: fx.Node) -> bool:
        return (node.op == "call_function" and node.target in (F.linear, F.embedding, *_NORMS)) or (
            node.op == "call_function" and node.target in (operator.matmul, torch.matmul)
        )

    def _rule(self, node: fx.Node) -> Optional[Callable[[fx.Node], Any]]:
        t = node.target
        if node.op == "call_function":
            if t is SDPA:
                return self.rule_sdpa
            if t in _ELEMENTWISE_FUNCS:
                return self.rule_elementwise
            if t in _RESHAPE_FUNCS:
                return self.rule_reshape
            if t in (torch.transpose, torch.permute, torch.swapaxes):
                return self.rule_transpose
            if t is operator.getitem:
                return self.rule_getitem
            if t in _SPLIT_FUNCS:
                return self.rule_split
            if t is F.linear:
                return self.rule_linear
            if t in (operator.matmul, torch.matmul):
                return self.rule_matmul
            if t in _NORMS:
                return self.rule_norm
            if t is F.embedding:
                return self.rule_embedding
            if t in _DIMWISE:
                return self.rule_dimwise
            if t in _REDUCE_FUNCS:
                return self.rule_reduce
            if t in _LOSSES:
                return self.rule_loss
            if t in (torch.cat, torch.concat, torch.stack):
                return self.rule_cat
            if t is torch.ops.aten.sym_size.int:
                return self.rule_size
            if t is getattr and len(node.args) == 2 and node.args[1] == "shape":
                return self.rule_size
        elif node.op == "call_method":
            if t in _ELEMENTWISE_METHODS:
                return self.rule_elementwise
            if t in _RESHAPE_METHODS:
                return self.rule_reshape
            if t in ("transpose", "permute", "swapaxes", "t"):
                return self.rule_transpose
            if t == "expand":
                return self.rule_expand
            if t in _SPLIT_METHODS:
                return self.rule_split
            if t in _DIMWISE_METHODS:
                return self.rule_dimwise
            if t in _REDUCE_METHODS:
                return self.rule_reduce
            if t == "size":
                return self.rule_size
            if t in _CREATE_METHODS:
                return self.rule_create
            if t == "matmul":
                return self.rule_matmul
        return None

    def fallback(self, node: fx.Node, why: str) -> None:
        """Gather every sharded input and run the op replicated (always correct)."""
        what = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        self.stats.fallbacks.append(f"{node.name} ({what}): {why}")
        args = fx.map_arg(node.args, self.as_replicate)
        kwargs = fx.map_arg(node.kwargs, self.as_replicate)
        self.env[node] = self.copy(node, args, kwargs)
        self.pl[node] = self.replicated_placement(node)

    def out_shard(self, node: fx.Node, new: fx.Node, sh: Any) -> bool:
        self.env[node] = new
        self.pl[node] = sh
        return True

    # ------------------------------------------------------------------ rules
    def rule_elementwise(self, node: fx.Node):
        out = self.val(node)
        if not _is_tensor(out):
            return None
        ndim = out.dim()
        spec: Optional[Shard] = None
        for n in self.tensor_inputs(node):
            sh = self.pl.get(n)
            if isinstance(sh, Shard):
                cand = sh.with_dim(sh.dim + ndim - self.val(n).dim())
                if spec is None:
                    spec = cand
                elif cand.dim != spec.dim or not cand.same_layout(spec):
                    return None
        assert spec is not None
        out_size = shape_exprs(out)[spec.dim]

        def local(n: Any) -> Any:
            if not isinstance(n, fx.Node):
                return n
            if not _is_tensor(self.val(n)) or self.is_shard(n):
                return self.env[n]
            shp = self.shape(n)
            ad = spec.dim - (ndim - len(shp))
            if ad < 0 or shp[ad] == 1:
                return self.env[n]  # broadcasts along the sequence
            if sympy.simplify(shp[ad] - out_size) != 0:
                raise AutoSPError(f"internal: cannot align {n.name} {shp} with the sequence dim of {node.name}")
            return self.as_shard(n, spec.with_dim(ad))

        return self.out_shard(node, self.copy(node, fx.map_arg(node.args, local), fx.map_arg(node.kwargs, local)), spec)

    def _map_reshape(self, in_shape: list, sh: Shard, out_shape: list) -> Optional[Shard]:
        outer_in = is_polynomial_quotient(in_shape[sh.dim], sh.length * sh.inner)
        if outer_in is None:
            return None
        before = sympy.Integer(1)
        for x in in_shape[: sh.dim]:
            before *= x
        before *= outer_in
        after = sh.inner
        for x in in_shape[sh.dim + 1 :]:
            after *= x
        cum = sympy.Integer(1)
        for j, size in enumerate(out_shape):
            o = is_polynomial_quotient(before, cum)
            if o is not None:
                inner = is_polynomial_quotient(size, o * sh.length)
                if inner is not None:
                    rest = sympy.Integer(1)
                    for x in out_shape[j + 1 :]:
                        rest *= x
                    if sympy.simplify(inner * rest - after) == 0:
                        return Shard(j, sh.length, inner, sh.off)
            cum = cum * size
        return None

    def rule_reshape(self, node: fx.Node):
        x = node.args[0]
        sh = self.pl[x]
        if not isinstance(sh, Shard) or any(self.is_shard(n) for n in self.tensor_inputs(node)[1:]):
            return None
        out = self.val(node)
        new_sh = self._map_reshape(self.shape(x), sh, shape_exprs(out))
        if new_sh is None:
            return None
        name = node.target if node.op == "call_method" else node.target.__name__
        args = list(fx.map_arg(node.args, self.env.__getitem__))
        kwargs = dict(fx.map_arg(node.kwargs, self.env.__getitem__))
        if name in ("view", "reshape"):
            if "shape" in kwargs or "size" in kwargs:
                return None
            packed = len(args) == 2 and isinstance(args[1], (tuple, list))
            shape = list(args[1]) if packed else args[1:]
            if len(shape) != out.dim():
                return None
            if not (isinstance(shape[new_sh.dim], int) and shape[new_sh.dim] == -1):
                outer = is_polynomial_quotient(shape_exprs(out)[new_sh.dim], new_sh.length * new_sh.inner)
                shape[new_sh.dim] = self.local_size(outer, new_sh)
            args = [args[0], tuple(shape)] if packed else [args[0], *shape]
        return self.out_shard(node, self.copy(node, args, kwargs), new_sh)

    def rule_expand(self, node: fx.Node):
        x = node.args[0]
        sh = self.pl[x]
        if not isinstance(sh, Shard) or node.kwargs:
            return None
        out = self.val(node)
        d = sh.dim + out.dim() - self.val(x).dim()
        args = list(fx.map_arg(node.args, self.env.__getitem__))
        packed = len(args) == 2 and isinstance(args[1], (tuple, list))
        shape = list(args[1]) if packed else args[1:]
        shape[d] = -1  # keep the (local) sequence size
        args = [args[0], tuple(shape)] if packed else [args[0], *shape]
        return self.out_shard(node, self.copy(node, args), sh.with_dim(d))

    def rule_transpose(self, node: fx.Node):
        x = node.args[0]
        sh = self.pl[x]
        if not isinstance(sh, Shard) or node.kwargs:
            return None
        ndim = self.val(x).dim()
        name = node.target if node.op == "call_method" else node.target.__name__
        if name == "t":
            perm = list(range(ndim))[::-1]
        elif name in ("transpose", "swapaxes"):
            a, b = (_norm_dim(int(v), ndim) for v in node.args[1:3])
            perm = list(range(ndim))
            perm[a], perm[b] = perm[b], perm[a]
        else:  # permute
            dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
            perm = [_norm_dim(int(v), ndim) for v in dims]
        return self.out_shard(node, self.copy(node), sh.with_dim(perm.index(sh.dim)))

    def rule_getitem(self, node: fx.Node):
        x, idx = node.args
        sh = self.pl.get(x)
        if not isinstance(sh, Shard):
            return None
        items = list(idx) if isinstance(idx, tuple) else [idx]
        if any(isinstance(i, fx.Node) and _is_tensor(self.val(i)) for i in items):
            return None  # advanced indexing
        ndim = self.val(x).dim()
        consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
        expanded: list[Any] = []
        for i in items:
            if i is Ellipsis:
                expanded.extend([slice(None)] * (ndim - consumed))
            else:
                expanded.append(i)
        in_dim = out_dim = 0
        new_sh: Optional[Shard] = None
        new_items = list(expanded)
        for k, i in enumerate(expanded):
            if i is None:
                out_dim += 1
                continue
            if in_dim == sh.dim:
                if not isinstance(i, slice):
                    return None
                if i == slice(None):
                    new_sh = sh.with_dim(out_dim)
                else:
                    shifted = self._shift(x, sh, i)
                    if shifted is None:
                        return None
                    new_sh, new_items[k] = shifted
                    new_sh = new_sh.with_dim(out_dim)
            if isinstance(i, slice):
                out_dim += 1
            in_dim += 1
        if new_sh is None:  # sequence dim not indexed explicitly
            new_sh = sh.with_dim(out_dim + sh.dim - in_dim)
        local_idx = tuple(fx.map_arg(new_items, self.env.__getitem__))
        return self.out_shard(node, self.copy(node, (self.env[x], local_idx), {}), new_sh)

    def _shift(self, x: fx.Node, sh: Shard, s: slice):
        """``x[.., a:b, ..]`` on the sequence dim: the same tokens, re-labelled (no data moves)."""
        a, b, step = s.start, s.stop, s.step
        if step not in (None, 1) or sh.inner != 1 or sympy.simplify(self.shape(x)[sh.dim] - sh.length) != 0:
            return None
        if not (a is None or (isinstance(a, int) and a >= 0)) or not (b is None or (isinstance(b, int) and b < 0)):
            return None
        a = a or 0
        length = sympy.expand(sh.length - a + (b or 0))
        new = Shard(sh.dim, length, sh.inner, sh.off + a)
        trim = sympy.expand(self.seq - new.off - length)
        if not trim.is_Integer:
            return None
        self.stats.max_shift = max(self.stats.max_shift, new.off, int(trim))
        local = slice(a if self.r == 0 and a else None, b if self.r == self.P - 1 else None)
        return new, local

    def rule_split(self, node: fx.Node):
        x = node.args[0]
        sh = self.pl[x]
        if not isinstance(sh, Shard):
            return None
        name = node.target if node.op == "call_method" else _SPLIT_FUNCS[node.target]
        ndim = self.val(x).dim()
        default = 0
        pos = 1 if name == "unbind" else 2
        dim = node.kwargs.get("dim", node.args[pos] if len(node.args) > pos else default)
        if not isinstance(dim, int) or _norm_dim(dim, ndim) == sh.dim:
            return None
        dim = _norm_dim(dim, ndim)
        d = sh.dim - 1 if (name == "unbind" and dim < sh.dim) else sh.dim
        outs = self.val(node)
        return self.out_shard(node, self.copy(node), tuple(sh.with_dim(d) if _is_tensor(o) else None for o in outs))

    def _source(self, x: fx.Node, forbidden: Sequence[int] = ()) -> Optional[Shard]:
        """Shard a replicated input of a token-wise op on its (single) sequence dim."""
        dims = self.seq_dims(x)
        ndim = self.val(x).dim()
        if len(dims) != 1 or dims[0] in {_norm_dim(f, ndim) for f in forbidden}:
            return None
        return self.base_shard(dims[0])

    def _tokenwise(self, node: fx.Node, forbidden: Sequence[int], out_dim: Callable[[int], int]):
        x = node.args[0]
        others = self.tensor_inputs(node)[1:]
        if any(self.is_shard(n) for n in others if n is not x):
            return None
        sh = self.pl[x]
        ndim = self.val(x).dim()
        if isinstance(sh, Shard):
            if sh.dim in {_norm_dim(f, ndim) for f in forbidden}:
                return None
            new_x = self.env[x]
        else:
            sh = self._source(x, forbidden)
            if sh is None:  # no sequence dim: stays replicated
                self.env[node] = self.copy(node)
                self.pl[node] = self.replicated_placement(node)
                return True
            new_x = self.as_shard(x, sh)
        args = (new_x, *fx.map_arg(node.args[1:], self.env.__getitem__))
        return self.out_shard(node, self.copy(node, args), sh.with_dim(out_dim(sh.dim)))

    def rule_linear(self, node: fx.Node):
        return self._tokenwise(node, forbidden=(-1,), out_dim=lambda d: d)

    def rule_matmul(self, node: fx.Node):
        w = node.args[1]  # x @ w with w a (replicated) [in, out] matrix: token-wise like linear
        if node.kwargs or not (_is_tensor(self.val(w)) and self.val(w).dim() == 2 and not self.seq_dims(w)):
            return None
        return self._tokenwise(node, forbidden=(-1,), out_dim=lambda d: d)

    def rule_norm(self, node: fx.Node):
        if node.target is F.group_norm:
            return None
        shp = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
        k = len(shp) if isinstance(shp, (tuple, list)) else 1
        return self._tokenwise(node, forbidden=tuple(range(-k, 0)), out_dim=lambda d: d)

    def rule_embedding(self, node: fx.Node):
        return self._tokenwise(node, forbidden=(), out_dim=lambda d: d)

    def _dim_arg(self, node: fx.Node, pos: int, default=None):
        if "dim" in node.kwargs:
            return node.kwargs["dim"]
        return node.args[pos] if len(node.args) > pos else default

    def rule_dimwise(self, node: fx.Node):
        x = node.args[0]
        sh = self.pl[x]
        dim = self._dim_arg(node, 1)
        if not isinstance(sh, Shard) or not isinstance(dim, int) or _norm_dim(dim, self.val(x).dim()) == sh.dim:
            return None
        return self.out_shard(node, self.copy(node), sh)

    def rule_reduce(self, node: fx.Node):
        x = node.args[0]
        sh = self.pl[x]
        if not isinstance(sh, Shard) or len(self.tensor_inputs(node)) != 1:
            return None
        name = node.target if node.op == "call_method" else _REDUCE_FUNCS[node.target]
        ndim = self.val(x).dim()
        dim = self._dim_arg(node, 1)
        keepdim = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
        if not isinstance(keepdim, bool) or isinstance(dim, fx.Node):
            return None
        dims = None if dim is None else tuple(_norm_dim(d, ndim) for d in ((dim,) if isinstance(dim, int) else dim))
        if dims is not None and sh.dim not in dims:
            removed = 0 if keepdim else sum(1 for d in dims if d < sh.dim)
            return self.out_shard(node, self.copy(node), sh.with_dim(sh.dim - removed))
        if name not in ("sum", "mean") or set(node.kwargs) - {"dim", "keepdim", "dtype"}:
            return None
        if len(node.args) > 3:
            return None
        dtype = node.kwargs.get("dtype")
        if name == "sum":
            new = self.g.call_function(runtime.reduce_sum, (self.env[x], dims, keepdim, self.group, self.P, dtype))
        else:
            shp = self.shape(x)
            count = sympy.Integer(1)
            for d in dims if dims is not None else range(ndim):
                count *= shp[d]
            new = self.g.call_function(runtime.reduce_mean, (self.env[x], dims, keepdim, self.emit(count), self.group, self.P, dtype))
        return self.out_shard(node, new, REPLICATE)

    def rule_loss(self, node: fx.Node):
        sig = _LOSSES[node.target]
        bound = sig.bind(*node.args, **node.kwargs)
        a = {**{k: p.default for k, p in sig.parameters.items()}, **bound.arguments}
        inp, tgt, weight = a["input"], a["target"], a["weight"]
        if a.get("size_average") is not None or a.get("reduce") is not None:
            return None
        ls = a.get("label_smoothing", 0.0)
        if ls and weight is not None:
            return None
        sh = self.pl.get(inp)
        tv, iv = self.val(tgt), self.val(inp)
        if not isinstance(sh, Shard) or tv.is_floating_point() or self.is_shard(weight):
            return None
        if (iv.dim() == 2 and sh.dim != 0) or (iv.dim() > 2 and sh.dim < 2) or iv.dim() < 2:
            return None
        t_sh = sh.with_dim(sh.dim if iv.dim() == 2 else sh.dim - 1)
        if self.is_shard(tgt):
            if self.pl[tgt] != t_sh and not (self.pl[tgt].dim == t_sh.dim and self.pl[tgt].same_layout(t_sh)):
                return None
            new_t = self.env[tgt]
        else:
            new_t = self.as_shard(tgt, t_sh)
        reduction = a["reduction"]
        if reduction == "none":
            kwargs = dict(fx.map_arg(node.kwargs, self.env.__getitem__))
            args = [self.env[inp], new_t, *fx.map_arg(node.args[2:], self.env.__getitem__)]
            return self.out_shard(node, self.copy(node, args, kwargs), t_sh)
        if reduction not in ("mean", "sum"):
            return None
        new = self.g.call_function(
            runtime.token_loss,
            (node.target.__name__, self.env[inp], new_t, self.env.get(weight) if weight is not None else None,
             a["ignore_index"], reduction, ls or 0.0, self.group, self.P),
        )
        return self.out_shard(node, new, REPLICATE)

    def rule_cat(self, node: fx.Node):
        tensors = node.args[0]
        out = self.val(node)
        stack = node.target is torch.stack
        dim = self._dim_arg(node, 1, 0)
        if not isinstance(dim, int) or not isinstance(tensors, (list, tuple)):
            return None
        if not stack:  # torch.cat skips legacy empty 1-D tensors (e.g. an empty KV cache)
            tensors = [n for n in tensors if not self._legacy_empty(n)]
            if len(tensors) == 1 and self.is_shard(tensors[0]):
                return self.out_shard(node, self.env[tensors[0]], self.pl[tensors[0]])
        spec: Optional[Shard] = None
        for n in tensors:
            sh = self.pl.get(n)
            if isinstance(sh, Shard):
                if spec is not None and (sh.dim != spec.dim or not sh.same_layout(spec)):
                    return None
                spec = sh
        in_ndim = self.val(tensors[0]).dim()
        dim = _norm_dim(dim, out.dim() if stack else in_ndim)
        if not stack and dim == spec.dim:
            return None
        new_list = [self.env[n] if self.is_shard(n) else self.as_shard(n, spec.with_dim(spec.dim)) for n in tensors]
        out_dim = spec.dim + 1 if (stack and dim <= spec.dim) else spec.dim
        args = (new_list, *fx.map_arg(node.args[1:], self.env.__getitem__))
        return self.out_shard(node, self.copy(node, args), spec.with_dim(out_dim))

    def _legacy_empty(self, n: Any) -> bool:
        v = self.val(n)
        return _is_tensor(v) and v.dim() == 1 and isinstance(v.shape[0], int) and v.shape[0] == 0

    def rule_size(self, node: fx.Node):
        """Sizes keep their global meaning: the sequence dim reports the global length."""
        x = node.args[0]
        sh = self.pl[x]
        shp = self.shape(x)
        is_shape_attr = node.target is getattr
        dim = None if is_shape_attr else (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"))
        if dim is None:
            vals = tuple(self.emit(e) for e in shp)
            return self.out_shard(node, self.g.call_function(runtime.sizes, vals), None)
        if not isinstance(dim, int):
            return None
        if _norm_dim(dim, len(shp)) != sh.dim:
            return self.out_shard(node, self.copy(node), None)
        val = self.emit(shp[sh.dim])
        if isinstance(val, int):
            return None
        return self.out_shard(node, val, None)

    def rule_create(self, node: fx.Node):
        """``x.new_zeros(size)`` and friends: a fresh replicated tensor of the given (global) size."""
        self.env[node] = self.copy(node)
        self.pl[node] = REPLICATE
        return True

    def _valid_sp_sizes(self, heads: int) -> list[int]:
        return [d for d in range(1, heads + 1) if heads % d == 0]

    def rule_sdpa(self, node: fx.Node):
        bound = dict(zip(_SDPA_SIG, node.args))
        bound.update(node.kwargs)
        q, k, v = bound["query"], bound["key"], bound["value"]
        ndim = self.val(q).dim()
        if ndim < 3:
            raise AutoSPError(f"{node.name}: scaled_dot_product_attention with {ndim}-D inputs has no head dim to split")
        seq_d, head_d = ndim - 2, ndim - 3
        H, Hk = self.shape(q)[head_d], self.shape(k)[head_d]
        if not (H.is_Integer and Hk.is_Integer):
            raise AutoSPError(f"{node.name}: attention heads must be static, got q {list(self.shape(q))}, k {list(self.shape(k))}")
        H, Hk = int(H), int(Hk)
        if H % self.P:
            raise AutoSPError(
                f"{node.name}: the query has {H} attention heads (shape {list(self.shape(q))}), not divisible by "
                f"sp_size={self.P}. Ulysses splits the heads across the SP group; valid sp_size values for this "
                f"model: {self._valid_sp_sizes(H)}."
            )
        gqa = bool(bound.get("enable_gqa", False))
        # KV heads: split like the query heads when they divide; otherwise replicate them so that
        # every rank receives the KV head(s) its query heads read (GQA/MQA with few KV heads).
        kv_repeat = 1
        if Hk % self.P:
            if not gqa or H % Hk:
                raise AutoSPError(
                    f"{node.name}: key/value have {Hk} heads and query {H} without enable_gqa=True; "
                    f"they must match or divide by sp_size={self.P}."
                )
            kv_repeat = self.P // Hk if self.P % Hk == 0 else H // Hk
        seq_node = self.emit(self.seq)
        new_qkv = []
        for n in (q, k, v):
            sh = self.pl.get(n)
            if not isinstance(sh, Shard):
                if seq_d not in self.seq_dims(n):
                    raise AutoSPError(
                        f"{node.name}: {n.name} has shape {list(self.shape(n))} with no sequence dim at "
                        f"dim {seq_d}; AutoSP expects SDPA inputs laid out as [B, H, S, D]."
                    )
                local = self.as_shard(n, self.base_shard(seq_d))
            else:
                if sh.dim != seq_d or sh.inner != 1 or sh.off != 0 or sympy.simplify(sh.length - self.seq) != 0:
                    raise AutoSPError(
                        f"{node.name}: {n.name} (shape {list(self.shape(n))}) reaches attention sharded as {sh}; "
                        f"AutoSP expects the full sequence in dim {seq_d} of a [B, H, S, D] layout."
                    )
                local = self.env[n]
            if n is not q and kv_repeat > 1:
                local = self.g.call_function(torch.repeat_interleave, (local, kv_repeat), {"dim": head_d})  # [B, Hk*r, S/P, D]
            # [B, H, S/P, D] -> [B, H/P, S, D]
            new_qkv.append(self.g.call_function(ALL_TO_ALL, (local, head_d, seq_d, self.group, self.P, seq_node, seq_d, self.r)))
            self.stats.all_to_all += 1
        kwargs = {key: bound[key] for key in _SDPA_SIG[3:] if key in bound}
        if kv_repeat > 1 and (Hk * kv_repeat) == H:
            kwargs["enable_gqa"] = False
        mask = kwargs.get("attn_mask")
        if isinstance(mask, fx.Node):
            m = self.as_replicate(mask)
            mshape = self.shape(mask)
            if len(mshape) == ndim and mshape[head_d] != 1:
                if mshape[head_d] != H:
                    raise AutoSPError(f"{node.name}: attn_mask shape {list(mshape)} has {mshape[head_d]} heads, the query {H}")
                per = H // self.P
                m = self.g.call_function(torch.narrow, (m, head_d, self.r * per, per))  # [B, H/P, S, S]
            kwargs["attn_mask"] = m
        kwargs = {k2: (self.env[v2] if isinstance(v2, fx.Node) and k2 != "attn_mask" else v2) for k2, v2 in kwargs.items()}
        out = self.g.call_function(SDPA, tuple(new_qkv), kwargs)
        out.meta["autosp_sdpa"] = node.name
        # [B, H/P, S, D] -> [B, H, S/P, D]
        back = self.g.call_function(ALL_TO_ALL, (out, seq_d, head_d, self.group, self.P, seq_node, seq_d, self.r))
        self.stats.all_to_all += 1
        self.stats.sdpa += 1
        return self.out_shard(node, back, self.base_shard(seq_d))


def _check_postcondition(g: fx.Graph, stats: SPPassStats) -> None:
    g.lint()
    for n in g.find_nodes(op="call_function", target=SDPA):
        srcs = [a for a in n.args[:3]]
        if not all(isinstance(a, fx.Node) and a.target is ALL_TO_ALL for a in srcs) or not all(
            u.target is ALL_TO_ALL for u in n.users
        ):
            raise AutoSPError(f"internal: attention {n.name} was not fully rewritten for sequence parallelism")
    if stats.all_to_all != 4 * stats.sdpa:
        raise AutoSPError(f"internal: {stats.all_to_all} all-to-alls for {stats.sdpa} attention calls (expected 4 each)")


def sequence_parallel_pass(
    gm: fx.GraphModule,
    example_inputs: Any = None,
    *,
    sp_size: int,
    sp_rank: int,
    group_name: str,
    seq_dim: int = 1,
) -> fx.GraphModule:
    """Rewrite a Dynamo graph for Ulysses sequence parallelism (see the module docstring).

    Graphs without a symbolic sequence dim in their inputs are returned unchanged, unless they
    call SDPA, which is an error (the strategy marks the sequence dim dynamic before tracing).
    The returned module carries :class:`SPPassStats` in ``meta["autosp"]``.
    """
    if sp_size < 1 or not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} must lie in [0, sp_size={sp_size})")
    seq = find_sequence_symbol(gm, seq_dim)
    n_sdpa = len(gm.graph.find_nodes(op="call_function", target=SDPA))
    if seq is None:
        if n_sdpa:
            raise AutoSPError(
                f"AutoSP found {n_sdpa} attention call(s) in a graph with no input with a symbolic "
                f"sequence length at seq_dim={seq_dim}, so it cannot tell which dim to split. This happens "
                "when a graph break splits the model before an attention (the graph after the break sees "
                "intermediate tensors of fixed size), or when the model runs outside AutoSPStrategy (which "
                "marks the sequence dim of the batch dynamic) or with the wrong `seq_dim`."
            )
        gm.meta["autosp"] = SPPassStats()
        return gm
    rw = _Rewriter(gm, sp_size, sp_rank, group_name, seq)
    graph = rw.run()
    _check_postcondition(graph, rw.stats)
    new_gm = fx.GraphModule(gm, graph)
    new_gm.meta["autosp"] = rw.stats
    if rw.stats.fallbacks:
        log.info("AutoSP: %d op(s) ran replicated (inputs all-gathered): %s", len(rw.stats.fallbacks), "; ".join(rw.stats.fallbacks))
    return new_gm
