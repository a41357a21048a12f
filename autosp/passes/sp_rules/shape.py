"""Rules for ops that move no data across tokens: elementwise math, views and reshapes,
indexing and slicing, splits and concatenation, sizes, and new tensors.

Each keeps the sequence axis where it is (or follows it to its new dim) and runs on the
local shard; replicated inputs that meet a sharded one are sliced to the same window.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Optional

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.errors import AutoSPError
from autosp.passes import runtime
from autosp.passes.placement import REPLICATE, Shard, is_polynomial_quotient, is_tensor, norm_dim, shape_exprs, size_expr
from autosp.passes.sp_rules.registry import OpCall, RuleResult, op, sp_rule

if TYPE_CHECKING:
    from autosp.passes.rewrite import SPRewrite

ELEMENTWISE_OPS = (
    # arithmetic and comparisons, with their operator spellings
    op("add", torch.add, operator.add), op("sub", torch.sub, operator.sub), op("mul", torch.mul, operator.mul),
    op("div", torch.div, operator.truediv), op("true_divide", torch.true_divide), op("pow", torch.pow, operator.pow),
    op("neg", torch.neg, operator.neg), op("floordiv", operator.floordiv, method=False),
    op("mod", operator.mod, method=False), op("eq", torch.eq, operator.eq), op("ne", torch.ne, operator.ne),
    op("lt", torch.lt, operator.lt), op("le", torch.le, operator.le), op("gt", torch.gt, operator.gt),
    op("ge", torch.ge, operator.ge), op("__and__", operator.and_), op("__or__", operator.or_),
    op("xor", operator.xor, method=False), op("__invert__", operator.invert), op("__mul__"), op("__add__"),
    op("__sub__"), op("__truediv__"), op("__neg__"), op("__rmul__"), op("__radd__"), op("__rsub__"), op("__rtruediv__"),
    # augmented assignment (``x += y``): in place, see passes/inplace.py
    op("iadd", operator.iadd, method=False), op("isub", operator.isub, method=False),
    op("imul", operator.imul, method=False), op("itruediv", operator.itruediv, method=False),
    # pointwise math
    op("exp", torch.exp), op("log", torch.log), op("sqrt", torch.sqrt), op("rsqrt", torch.rsqrt),
    op("tanh", torch.tanh, F.tanh), op("sigmoid", torch.sigmoid, F.sigmoid), op("sin", torch.sin), op("cos", torch.cos),
    op("abs", torch.abs), op("clamp", torch.clamp), op("clamp_min"), op("clamp_max"), op("where", torch.where),
    op("maximum", torch.maximum, method=False), op("minimum", torch.minimum, method=False), op("erf", torch.erf),
    op("square", torch.square), op("reciprocal", torch.reciprocal), op("lerp", torch.lerp),
    op("addcmul", torch.addcmul, method=False), op("logical_and", torch.logical_and),
    op("logical_or", torch.logical_or), op("logical_not", torch.logical_not), op("masked_fill", torch.masked_fill),
    # activations
    op("relu", torch.relu, F.relu), op("silu", F.silu), op("gelu", F.gelu),
    op("softplus", F.softplus, method=False), op("mish", F.mish, method=False),
    op("leaky_relu", F.leaky_relu, method=False), op("elu", F.elu, method=False),
    op("hardtanh", F.hardtanh, method=False), op("relu6", F.relu6, method=False),
    # dtype, layout and copies
    op("float"), op("half"), op("bfloat16"), op("double"), op("int"), op("long"), op("bool"), op("type"),
    op("contiguous"), op("clone", torch.clone), op("detach"),
    # ``dst.copy_(src)``: in place, see passes/inplace.py (the result is dst's placement)
    op("copy"),
    # new tensors shaped like their input
    op("zeros_like", torch.zeros_like, method=False), op("ones_like", torch.ones_like, method=False),
    op("empty_like", torch.empty_like, method=False), op("full_like", torch.full_like, method=False),
    # (dropout, rand_like and randn_like: random_ops.py)
)


@sp_rule(*ELEMENTWISE_OPS)
def elementwise(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """Broadcasting ops: the output is sharded like its sharded inputs; replicated inputs that
    span the sequence are sliced to match, those that broadcast along it stay whole."""
    out = rw.val(node)
    if not is_tensor(out):
        return None
    ndim = out.dim()
    spec: Optional[Shard] = None
    for n in rw.tensor_inputs(node):
        shard = rw.placements.get(n)
        if isinstance(shard, Shard):
            aligned = shard.with_dim(shard.dim + ndim - rw.val(n).dim())  # right-aligned broadcasting
            if spec is None:
                spec = aligned
            elif aligned.dim != spec.dim or not aligned.same_layout(spec):
                return None
    assert spec is not None, "the driver calls this rule only with a sharded input"
    out_size = shape_exprs(out)[spec.dim]

    def local(n: Any) -> Any:
        if not isinstance(n, fx.Node):
            return n
        if not is_tensor(rw.val(n)) or rw.is_shard(n):
            return rw.new_value[n]
        shp = rw.shape(n)
        dim = spec.dim - (ndim - len(shp))
        if dim < 0 or shp[dim] == 1:
            return rw.new_value[n]  # broadcasts along the sequence
        if sympy.simplify(shp[dim] - out_size) != 0:
            raise AutoSPError(f"internal: cannot align {n.name} {shp} with the sequence dim of {node.name}")
        return rw.redistribute.to_shard(n, spec.with_dim(dim))

    return rw.copy(node, fx.map_arg(node.args, local), fx.map_arg(node.kwargs, local)), spec


@sp_rule(op("to"), op("type_as"))
def convert(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """``x.to(other)``, ``x.type_as(other)``: only ``x``'s data flows; ``other`` (any shape, any
    placement) lends its dtype and device, which its local value has too."""
    x = node.args[0]
    if not is_tensor(rw.val(node)):
        return None
    return rw.copy(node), rw.placements[x]


def _map_reshape(in_shape: list, shard: Shard, out_shape: list) -> Optional[Shard]:
    """Where the sequence axis of ``shard`` lands after a reshape to ``out_shape`` (it may be
    flattened with other axes, as ``(outer, seq, inner)``), or ``None`` if it is split up."""
    outer_in = is_polynomial_quotient(in_shape[shard.dim], shard.length * shard.inner)
    if outer_in is None:
        return None
    before = sympy.Integer(1)  # global elements per sequence position, before and after it
    for x in in_shape[: shard.dim]:
        before *= x
    before *= outer_in
    after = shard.inner
    for x in in_shape[shard.dim + 1 :]:
        after *= x
    cum = sympy.Integer(1)
    for j, size in enumerate(out_shape):
        outer = is_polynomial_quotient(before, cum)
        if outer is not None:
            inner = is_polynomial_quotient(size, outer * shard.length)
            if inner is not None:
                rest = sympy.Integer(1)
                for x in out_shape[j + 1 :]:
                    rest *= x
                if sympy.simplify(inner * rest - after) == 0:
                    return Shard(j, shard.length, inner, shard.off)
        cum = cum * size
    return None


@sp_rule(
    op("reshape", torch.reshape), op("view"), op("flatten", torch.flatten), op("squeeze", torch.squeeze),
    op("unsqueeze", torch.unsqueeze), op("unflatten", torch.unflatten),
)
def reshape(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """Views and reshapes: the sequence axis is followed to its new dim; explicit sizes of that
    dim in ``view``/``reshape`` are replaced by the local size (``unflatten`` of the dim holding the
    sequence has none to replace: it runs replicated)."""
    x = node.args[0]
    shard = rw.placements[x]
    if not isinstance(shard, Shard) or any(rw.is_shard(n) for n in rw.tensor_inputs(node)[1:]):
        return None
    if call.name == "unflatten":
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        if not isinstance(dim, int) or norm_dim(dim, rw.val(x).dim()) == shard.dim:
            return None
    out = rw.val(node)
    new_shard = _map_reshape(rw.shape(x), shard, shape_exprs(out))
    if new_shard is None:
        return None
    args = list(rw.new(node.args))
    kwargs = dict(rw.new(node.kwargs))
    if call.name in ("view", "reshape"):
        if "shape" in kwargs or "size" in kwargs:
            return None
        if len(args) == 2 and isinstance(node.args[1], fx.Node) and isinstance(rw.val(node.args[1]), (tuple, list)):
            # a shape read from a tensor (``x.reshape(z.shape)``): its sizes, one by one
            args[1] = tuple(rw.graph.call_function(operator.getitem, (args[1], i)) for i in range(len(rw.val(node.args[1]))))
        packed = len(args) == 2 and isinstance(args[1], (tuple, list))
        shape = list(args[1]) if packed else args[1:]
        if len(shape) != out.dim():
            return None
        if not (isinstance(shape[new_shard.dim], int) and shape[new_shard.dim] == -1):
            outer = is_polynomial_quotient(shape_exprs(out)[new_shard.dim], new_shard.length * new_shard.inner)
            shape[new_shard.dim] = rw.redistribute.local_size(outer, new_shard)
        args = [args[0], tuple(shape)] if packed else [args[0], *shape]
    return rw.copy(node, args, kwargs), new_shard


@sp_rule(op("expand"))
def expand(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    x = node.args[0]
    shard = rw.placements[x]
    if not isinstance(shard, Shard) or node.kwargs:
        return None
    dim = shard.dim + rw.val(node).dim() - rw.val(x).dim()
    args = list(rw.new(node.args))
    packed = len(args) == 2 and isinstance(args[1], (tuple, list))
    shape = list(args[1]) if packed else args[1:]
    shape[dim] = -1  # keep the (local) sequence size
    args = [args[0], tuple(shape)] if packed else [args[0], *shape]
    return rw.copy(node, args), shard.with_dim(dim)


def repeat_interleave_args(node: fx.Node) -> Optional[tuple[fx.Node, int, int]]:
    """``(x, n, dim)`` of ``x.repeat_interleave(n, dim=dim)`` with an integer ``n`` and ``dim``
    (no ``output_size``); else ``None`` (a tensor of repeats, or no dim: the input flattened)."""
    bound = dict(zip(("input", "repeats", "dim"), node.args))
    bound.update(node.kwargs)
    x, reps, dim = bound.get("input"), bound.get("repeats"), bound.get("dim")
    if set(bound) - {"input", "repeats", "dim"} or not isinstance(x, fx.Node):
        return None
    if not isinstance(reps, int) or not isinstance(dim, int) or reps < 1:
        return None
    return x, reps, dim


@sp_rule(op("repeat_interleave", torch.repeat_interleave))
def repeat_interleave(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """``x.repeat_interleave(n, dim=d)`` along a dim other than the sequence (LitGPT's repeat of
    KV heads): each token's values repeated in place, on the rank's tokens."""
    found = repeat_interleave_args(node)
    if found is None or not isinstance(rw.placements.get(found[0]), Shard):
        return None
    x, _, dim = found
    shard = rw.placements[x]
    if norm_dim(dim, rw.val(x).dim()) == shard.dim:
        return None
    return rw.copy(node), shard


#: ``x.mT`` as torch >= 2.15 traces it (an aten op; older torch: ``getattr(x, "mT")``, a fallback)
_MT = tuple(f for f in (getattr(torch.ops.aten, "mT", None),) if f is not None)


@sp_rule(
    op("transpose", torch.transpose), op("permute", torch.permute), op("swapaxes", torch.swapaxes), op("t"),
    op("mT", *_MT, method=False),
)
def transpose(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    x = node.args[0]
    shard = rw.placements[x]
    if not isinstance(shard, Shard) or node.kwargs:
        return None
    ndim = rw.val(x).dim()
    if call.name == "t":
        perm = list(range(ndim))[::-1]
    elif call.name == "mT":
        perm = [*range(ndim - 2), ndim - 1, ndim - 2]
    elif call.name in ("transpose", "swapaxes"):
        a, b = (norm_dim(int(v), ndim) for v in node.args[1:3])
        perm = list(range(ndim))
        perm[a], perm[b] = perm[b], perm[a]
    else:  # permute
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        perm = [norm_dim(int(v), ndim) for v in dims]
    return rw.copy(node), shard.with_dim(perm.index(shard.dim))


@sp_rule(op("getitem", operator.getitem, method=False))
def getitem(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """Basic indexing. A slice of the sequence axis (``x[:, 1:]``, ``x[:, :-1]``) keeps every
    token on its rank and is tracked as a shifted shard (see :func:`_shift`)."""
    x, idx = node.args
    shard = rw.placements.get(x)
    if not isinstance(shard, Shard):
        return None
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if any(isinstance(i, fx.Node) and is_tensor(rw.val(i)) for i in items):
        return None  # advanced indexing
    ndim = rw.val(x).dim()
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    expanded: list[Any] = []
    for i in items:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (ndim - consumed))
        else:
            expanded.append(i)
    in_dim = out_dim = 0
    new_shard: Optional[Shard] = None
    new_items = list(expanded)
    for k, i in enumerate(expanded):
        if i is None:
            out_dim += 1
            continue
        if in_dim == shard.dim:
            if not isinstance(i, slice):
                return None
            if i == slice(None):
                new_shard = shard.with_dim(out_dim)
            else:
                shifted = _shift(rw, x, shard, i)
                if shifted is None:
                    return None
                new_shard, new_items[k] = shifted
                new_shard = new_shard.with_dim(out_dim)
        if isinstance(i, slice):
            out_dim += 1
        in_dim += 1
    if new_shard is None:  # sequence dim not indexed explicitly
        new_shard = shard.with_dim(out_dim + shard.dim - in_dim)
    return rw.copy(node, (rw.new_value[x], tuple(rw.new(new_items))), {}), new_shard


def _shift(rw: "SPRewrite", x: fx.Node, shard: Shard, s: slice) -> Optional[tuple[Shard, slice]]:
    """``x[.., a:b, ..]`` on the sequence dim: the same tokens, re-labelled (no data moves).

    Returns the new placement and the slice this rank applies locally: only the first rank
    drops ``a`` leading positions and only the last rank ``-b`` trailing ones.
    """
    start, stop, step = s.start, s.stop, s.step
    if isinstance(stop, fx.Node) and isinstance(rw.val(stop), torch.SymInt):
        # ``x[..., :seq_len]`` of an axis ``k`` longer than ``seq_len`` (a padded convolution's output):
        # the static stop ``-k``
        cut = sympy.expand(size_expr(rw.val(stop)) - shard.length)
        if not (cut.is_Integer and cut <= 0):
            return None
        stop = int(cut) or None
    if step not in (None, 1) or shard.inner != 1 or sympy.simplify(rw.shape(x)[shard.dim] - shard.length) != 0:
        return None
    if not (start is None or (isinstance(start, int) and start >= 0)) or not (
        stop is None or (isinstance(stop, int) and stop < 0)
    ):
        return None
    start = start or 0
    length = sympy.expand(shard.length - start + (stop or 0))
    new = Shard(shard.dim, length, shard.inner, shard.off + start)
    trim = sympy.expand(rw.seq - new.off - length)
    if not trim.is_Integer:
        return None
    rw.stats.max_shift = max(rw.stats.max_shift, new.off, int(trim))
    first, last = rw.sp_rank == 0, rw.sp_rank == rw.sp_size - 1
    local = slice(start if first and start else None, stop if last else None)
    return new, local


@sp_rule(
    op("split", torch.split), op("chunk", torch.chunk), op("unbind", torch.unbind),
    op("tensor_split", torch.tensor_split), op("split_with_sizes"),
)
def split(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """Splits along any dim but the sequence: every piece keeps the sequence axis."""
    x = node.args[0]
    shard = rw.placements[x]
    if not isinstance(shard, Shard):
        return None
    ndim = rw.val(x).dim()
    pos = 1 if call.name == "unbind" else 2
    dim = node.kwargs.get("dim", node.args[pos] if len(node.args) > pos else 0)
    if isinstance(dim, int) and norm_dim(dim, ndim) == shard.dim and call.name == "tensor_split":
        return _split_off_nothing(rw, node, shard)
    if not isinstance(dim, int) or norm_dim(dim, ndim) == shard.dim:
        return None
    dim = norm_dim(dim, ndim)
    out_dim = shard.dim - 1 if (call.name == "unbind" and dim < shard.dim) else shard.dim
    pieces = rw.val(node)
    return rw.copy(node), tuple(shard.with_dim(out_dim) if is_tensor(p) else None for p in pieces)


def _split_off_nothing(rw: "SPRewrite", node: fx.Node, shard: Shard) -> RuleResult:
    """``tensor_split(x, [n, ..], dim=seq)`` with every ``n`` the sequence's whole length (Hugging
    Face's scans split off the positions they keep recurrent states for, none in training): the
    first piece is ``x`` as it is, the others are empty on every rank."""
    indices = node.kwargs.get("indices", node.kwargs.get("tensor_indices_or_sections", node.args[1] if len(node.args) > 1 else None))
    if not isinstance(indices, (list, tuple)) or not indices or shard.off != 0:
        return None
    for i in indices:
        v = rw.val(i) if isinstance(i, fx.Node) else i
        if not isinstance(v, (int, torch.SymInt)) or sympy.expand(size_expr(v) - shard.length) != 0:
            return None
    local = rw.new_value[node.args[0]]
    empty = rw.graph.call_function(torch.narrow, (local, shard.dim, 0, 0))
    pieces = [local] + [empty] * len(indices)
    return rw.graph.call_function(runtime.pack, tuple(pieces)), (shard,) + (REPLICATE,) * len(indices)


def _legacy_empty(rw: "SPRewrite", n: Any) -> bool:
    v = rw.val(n)
    return is_tensor(v) and v.dim() == 1 and isinstance(v.shape[0], int) and v.shape[0] == 0


@sp_rule(op("cat", torch.cat, method=False), op("concat", torch.concat, method=False), op("stack", torch.stack, method=False))
def cat(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """Concatenation along any dim but the sequence (stacking along any dim)."""
    tensors = node.args[0]
    out = rw.val(node)
    stack = call.name == "stack"
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    if not isinstance(dim, int) or not isinstance(tensors, (list, tuple)):
        return None
    if not stack:  # torch.cat skips legacy empty 1-D tensors (e.g. an empty KV cache)
        tensors = [n for n in tensors if not _legacy_empty(rw, n)]
        if len(tensors) == 1 and rw.is_shard(tensors[0]):
            return rw.new_value[tensors[0]], rw.placements[tensors[0]]
    spec: Optional[Shard] = None
    for n in tensors:
        shard = rw.placements.get(n)
        if isinstance(shard, Shard):
            if spec is not None and (shard.dim != spec.dim or not shard.same_layout(spec)):
                return None
            spec = shard
    dim = norm_dim(dim, out.dim() if stack else rw.val(tensors[0]).dim())
    if not stack and dim == spec.dim:
        return None
    pieces = [rw.new_value[n] if rw.is_shard(n) else rw.redistribute.to_shard(n, spec) for n in tensors]
    out_dim = spec.dim + 1 if (stack and dim <= spec.dim) else spec.dim
    return rw.copy(node, (pieces, *rw.new(node.args[1:]))), spec.with_dim(out_dim)


@sp_rule(op("size", torch.ops.aten.sym_size.int))
def size(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """Sizes keep their global meaning: the sequence dim reports the global length.
    (``x.shape`` is looked up as ``x.size()``.)"""
    x = node.args[0]
    shard = rw.placements[x]
    shp = rw.shape(x)
    dim = None if node.target is getattr else (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"))
    if dim is None:
        dims = tuple(rw.emit(e) for e in shp)
        return rw.graph.call_function(runtime.global_sizes, dims), None
    if not isinstance(dim, int):
        return None
    if norm_dim(dim, len(shp)) != shard.dim:
        return rw.copy(node), None
    seq_len = rw.emit(shp[shard.dim])
    if isinstance(seq_len, int):
        return None
    return seq_len, None


@sp_rule(op("new_zeros"), op("new_ones"), op("new_empty"), op("new_full"), op("new_tensor"))
def create(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    """``x.new_zeros(size)`` and friends (``x`` split over the sequence lends dtype and device).

    A buffer with one dim as long as the sequence is created split like the activations, at
    its local size, so that writes of split data into slices of it that keep the sequence dim
    whole (``buf[..., :d].copy_(k)``, as DeepSeek-V3's attention assembles q and k) run on the
    local values; every element starts equal (zeros, ones, a fill value or uninitialised), so a
    rank's part of the buffer is the buffer's part. Any other size (and ``new_tensor``, which
    holds data) gives a replicated tensor of the given global size."""
    dims = rw.seq_dims(node)
    if call.name == "new_tensor" or len(dims) != 1 or "size" in node.kwargs:
        return rw.copy(node), REPLICATE
    args = list(rw.new(node.args))
    packed = len(args) >= 2 and isinstance(args[1], (tuple, list))
    if call.name == "new_full" and not packed:  # new_full(size, fill_value)
        return rw.copy(node), REPLICATE
    sizes = list(args[1]) if packed else args[1:]
    if len(sizes) != rw.val(node).dim():
        return rw.copy(node), REPLICATE
    shard = rw.base_shard(dims[0])
    sizes[dims[0]] = rw.redistribute.local_size(sympy.Integer(1), shard)
    new_args = [args[0], tuple(sizes), *args[2:]] if packed else [args[0], *sizes]
    return rw.copy(node, new_args), shard
