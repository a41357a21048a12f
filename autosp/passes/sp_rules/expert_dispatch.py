"""Mixture-of-experts dispatch on the rank's own tokens.

Hugging Face's grouped experts (the ``grouped_mm`` experts of Mixtral, Qwen3-MoE, DeepSeek-V3
and the other MoE families under ``torch.compile``) send the ``tokens x top_k`` rows of the
router's choices through a permutation of the rows::

    expert_ids_g, perm = torch.sort(expert_ids)          # rows grouped by expert
    x_g = hidden[perm // top_k]; w_g = weights[perm]      # each row's token and routing weight
    offsets = torch.cumsum(torch.histc(expert_ids_g.float(), bins=E, min=0, max=E - 1), 0)
    y_g = grouped_mm(x_g, W, offs=offsets) ...  * w_g[:, None]
    inv = torch.empty_like(perm); inv[perm] = torch.arange(rows)
    y = y_g[inv]                                          # back in token order

Each row's result depends on its own token and choice only: the sort only orders rows, the
offsets put each row into the group of its own key (the sorted keys fall into consecutive
histogram bins, whatever the other rows are) and the inverse permutation undoes the order. So
the region runs on the rank's own rows - sort, gathers, group counts and inverse computed
locally - and its result, back in token order, is this rank's shard of the one-device result:
no all-gather, the experts compute only the rank's tokens.

:func:`match_dispatch` proves this for one ``sort`` (or ``argsort``) of a sequence-sharded row
tensor, before anything is emitted: it follows every use of the sort's results forward and
accepts only the steps above and row-wise math on the permuted rows (elementwise ops, dtype
casts, chunks and splits of features, linear layers, reshapes that keep the rows, reductions over
features, expert biases indexed by the sorted keys). Any other use rejects the whole region - a
group count read as a statistic, a cumsum over the rows (expert capacity: a row's fate then
depends on the rows before it), permuted rows returned, all-gathered or mixed with rows in token
order - and the ``sort`` then runs replicated as before (its inputs all-gathered; exact, and
reported as a fallback). Values inside a region have the placement :data:`~.placement.RANK_LOCAL`:
they mean nothing outside it, and the pass refuses to let one escape.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import sympy
import torch
import torch.fx as fx

from autosp.passes.placement import RANK_LOCAL, REPLICATE, Shard, is_polynomial_quotient, is_tensor, norm_dim, shape_exprs
from autosp.passes.sp_rules.registry import calls, lookup
from autosp.passes.sp_rules.shape import ELEMENTWISE_OPS

if TYPE_CHECKING:
    from autosp.passes.rewrite import SPRewrite

__all__ = ["Dispatch", "starts_dispatch", "match_dispatch", "emit_dispatch"]

#: row-wise steps on permuted rows: elementwise ops (the names :func:`~.registry.lookup` gives)
_ELEMENTWISE = {spelling.name for spelling in ELEMENTWISE_OPS} - {"copy"}
#: dtype and layout conversions: the role of their first argument passes through
_CONVERSIONS = {"to", "float", "half", "bfloat16", "double", "int", "long", "type", "contiguous", "clone", "detach"}
#: comparisons of a count with bounds (the runtime checks Dynamo adds for data-dependent sizes)
_COMPARISONS = (operator.ge, operator.gt, operator.le, operator.lt, operator.eq, operator.ne)
#: reductions over feature dims (never dim 0, the rows)
_FEATURE_REDUCTIONS = {"sum", "mean", "amax", "amin"}


@dataclass
class Dispatch:
    """One matched region. ``rows`` is the placement of the sorted row tensor (its sequence
    shard), ``roles`` every node of the region with its role, ``divisor`` the divisor of each
    index (``perm // top_k`` indexes token rows: divisor ``top_k``), ``gathered`` the shard each
    row tensor indexed by the permutation must have (token-ordered rows of the same tokens)."""

    sort: fx.Node
    rows: Shard
    roles: dict[fx.Node, str] = field(default_factory=dict)
    divisor: dict[fx.Node, int] = field(default_factory=dict)
    gathered: dict[fx.Node, Shard] = field(default_factory=dict)
    #: the ``arange(rows)`` each inverse permutation is written from, and the buffers written
    aranges: dict[fx.Node, fx.Node] = field(default_factory=dict)


def _name(node: fx.Node) -> Optional[str]:
    found = lookup(node)
    if found is not None:
        return found[0].name
    if node.op == "call_method":
        return node.target
    name = getattr(node.target, "__name__", None)  # a torch function without a rule (torch.bmm)
    return name if node.op == "call_function" and getattr(torch, str(name), None) is node.target else None


def _is_select(node: fx.Node) -> bool:
    """``torch.where(mask)``: the coordinates of the true elements (rows of data-dependent count)."""
    return calls(node, "where") and len(node.args) == 1 and not node.kwargs


def starts_dispatch(node: fx.Node) -> bool:
    """``node`` may start a dispatch region: a sort of rows, or the rows a mask selects."""
    return calls(node, "sort") or calls(node, "argsort") or _is_select(node)


def _is_grouped_mm(node: fx.Node) -> bool:
    """``torch._grouped_mm``, ``F.grouped_mm`` or a custom op named ``*grouped_mm*``
    (transformers' ``grouped_mm_fallback`` for dtypes the fused kernel lacks)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target in (getattr(torch, "_grouped_mm", None), getattr(torch.nn.functional, "grouped_mm", None)):
        return True
    name = getattr(target, "_name", None) or getattr(target, "__name__", "")
    return isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and "grouped_mm" in str(name)


class _Reject(Exception):
    """The region is not a dispatch this module can run per rank."""


class _Matcher:
    def __init__(self, rw: "SPRewrite", sort: fx.Node, rows: Shard, src_rows: sympy.Expr, n_rows: sympy.Expr):
        self.rw = rw
        self.d = Dispatch(sort, rows)
        self.src_rows = src_rows  # rows of the sorted (or masked) tensor, in token order
        self.n_rows = n_rows  # rows of the region (the same for a sort; those selected by a mask)
        self.seq_symbols = rw.seq.free_symbols
        self.written: set[fx.Node] = set()

    # -------------------------------------------------------------- helpers
    def role(self, n: Any) -> Optional[str]:
        return self.d.roles.get(n) if isinstance(n, fx.Node) else None

    def has_rows(self, n: fx.Node) -> bool:
        """``n``'s dim 0 holds the region's rows."""
        val = self.rw.val(n)
        return is_tensor(val) and val.dim() >= 1 and sympy.simplify(self.rw.shape(n)[0] - self.n_rows) == 0

    def weight_like(self, n: Any) -> bool:
        """An outside value with no sequence axis: replicated, the same on every rank (a weight,
        a number, a size)."""
        if not isinstance(n, fx.Node):
            return True
        val = self.rw.val(n)
        if is_tensor(val):
            if any(e.free_symbols & self.seq_symbols for e in self.rw.shape(n)):
                return False
            placement = self.rw.placements.get(n)
            return placement is None or placement is REPLICATE
        return not isinstance(val, torch.SymInt) or not (val.node.expr.free_symbols & self.seq_symbols)

    def outside(self, node: fx.Node) -> list[fx.Node]:
        return [a for a in node.all_input_nodes if a not in self.d.roles]

    def only_weights_outside(self, node: fx.Node, allowed: tuple[str, ...] = ("rows", "keys", "coords")) -> None:
        for a in node.all_input_nodes:
            r = self.role(a)
            if (r is None and not self.weight_like(a)) or (r is not None and r not in allowed):
                raise _Reject(f"{node.name} mixes {a.name} into the permuted rows")

    def broadcasts_rows(self, node: fx.Node) -> None:
        """Outside tensors of an elementwise op must not reach the rows dim (they broadcast along it)."""
        out_ndim = self.rw.val(node).dim()
        for a in self.outside(node):
            val = self.rw.val(a)
            if is_tensor(val) and val.dim() >= out_ndim and self.rw.shape(a)[val.dim() - out_ndim] != 1:
                raise _Reject(f"{a.name} spans the rows of {node.name}")

    # -------------------------------------------------------------- classification
    def classify(self, node: fx.Node) -> str:
        name = _name(node)
        if node.op == "output":
            raise _Reject("the permuted rows are returned")
        if node.target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default) or name in ("size", "numel"):
            return "size"  # the region's row count: its own rows on this rank, read only by the checks below
        if any(self.role(a) == "size" for a in node.all_input_nodes):  # Dynamo's checks of a data-dependent count
            if node.target in _COMPARISONS and not any(isinstance(a, fx.Node) and self.role(a) != "size" for a in node.args):
                return "size"
            if node.target is torch.ops.aten._assert_scalar.default:
                return "assert"
            raise _Reject(f"{node.name} uses the number of rows the region holds, a count of this rank's rows only")
        if node.target is operator.getitem:
            return self._getitem(node)
        if node.target is operator.setitem:
            return self._setitem(node)
        if name in ("floordiv", "floor_divide") or (name == "div" and node.kwargs.get("rounding_mode") == "floor"):
            x, k = node.args[0], node.args[1]
            if self.role(x) != "index" or not isinstance(k, int) or k <= 0 or node.kwargs.keys() - {"rounding_mode"}:
                raise _Reject(f"{node.name} divides an index")
            self.d.divisor[node] = self.d.divisor[x] * k
            return "index"
        if name == "histc":
            if self.role(node.args[0]) != "keys" or len(node.all_input_nodes) != 1:
                raise _Reject(f"{node.name} counts something other than the sorted keys")
            return "counts"
        if name == "cumsum" and self.role(node.args[0]) == "counts":
            return "counts"
        if _is_grouped_mm(node):
            x = node.args[0]
            offs = node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)
            w = node.args[1] if len(node.args) > 1 else node.kwargs.get("mat_b", node.kwargs.get("weight"))
            others = [a for a in node.all_input_nodes if a not in (x, offs)]
            if self.role(x) != "rows" or self.role(offs) != "counts" or not all(self.weight_like(a) for a in others) or w is None:
                raise _Reject(f"{node.name}: a grouped matmul not over the permuted rows and their group counts")
            return "rows"
        if name in ("empty_like",) and self.role(node.args[0]) == "index" and self.d.divisor[node.args[0]] == 1:
            return "buffer"
        if name == "argsort" and self.role(node.args[0]) == "index" and self.d.divisor[node.args[0]] == 1:
            return "inverse"
        if name in _CONVERSIONS:
            x = node.args[0]
            r = self.role(x)
            if r in ("keys", "counts", "rows") and all(self.weight_like(a) for a in self.outside(node)) and not any(
                self.role(a) for a in node.all_input_nodes if a is not x
            ):
                return r
            raise _Reject(f"{node.name} converts {x.name}")
        return self._rowwise(node, name)

    def _getitem(self, node: fx.Node) -> str:
        base, idx = node.args
        rb, ri = self.role(base), self.role(idx)
        if rb == "sort":
            if idx == 0:
                return "keys"
            self.d.divisor[node] = 1
            return "index"
        if rb == "select":  # the selected rows' row numbers, then their other coordinates
            if idx == 0:
                self.d.divisor[node] = 1
                return "index"
            return "coords"
        if rb == "pieces" and isinstance(idx, int):
            return "rows"
        if ri == "index" and rb is None:  # each row's token (or its routing weight) from the token-ordered rows
            return self._gather(node, base, self.d.divisor[idx])
        if isinstance(idx, tuple) and idx and self.role(idx[0]) == "index" and rb is None:  # probs[rows, cols, None]
            if not all(i is None or i == slice(None) or self.role(i) in ("coords", "keys") for i in idx[1:]):
                raise _Reject(f"{node.name} indexes {base.name} by values from outside the region")
            return self._gather(node, base, self.d.divisor[idx[0]])
        if ri == "keys" and rb is None:  # a per-expert parameter for each row (an expert bias)
            if not self.weight_like(base):
                raise _Reject(f"{node.name} indexes {base.name} by expert")
            return "rows"
        if ri in ("inverse", "buffer") and rb in ("rows", "keys"):
            if ri == "buffer" and idx not in self.written:
                raise _Reject(f"{node.name} reads the inverse permutation before it is written")
            if not self.has_rows(base):
                raise _Reject(f"{node.name} un-permutes a tensor that does not hold the rows")
            return "out"
        raise _Reject(f"{node.name} indexes the region's values")

    def _gather(self, node: fx.Node, base: fx.Node, divisor: int) -> str:
        rw, rows = self.rw, self.d.rows
        val = rw.val(base)
        if not is_tensor(val) or val.dim() < 1:
            raise _Reject(f"{node.name} gathers from a non-tensor")
        inner = is_polynomial_quotient(rows.inner, divisor)
        if inner is None or sympy.simplify(rw.shape(base)[0] * divisor - self.src_rows) != 0:
            raise _Reject(f"{node.name} gathers from {base.name}, whose rows are not the region's tokens")
        self.d.gathered[node] = Shard(0, rows.length, inner, rows.off)
        return "rows"

    def _setitem(self, node: fx.Node) -> str:
        buf, idx, value = node.args
        if self.role(buf) is None and self.role(idx) == "index" and self.role(value) == "rows":
            return self._write_back(node, buf, self.d.divisor[idx])
        if self.role(buf) != "buffer" or self.role(idx) != "index" or self.d.divisor[idx] != 1 or buf in self.written:
            raise _Reject(f"{node.name} writes into the region's values")
        if not (isinstance(value, fx.Node) and value.op == "call_function" and value.target is torch.arange
                and len(value.args) == 1 and set(value.kwargs) <= {"device", "dtype"}
                and sympy.simplify(self.rw.shape(value)[0] - self.n_rows) == 0
                and all(u is node for u in value.users)):
            raise _Reject(f"{node.name} writes something other than arange(rows) at the permutation")
        self.written.add(buf)
        self.d.aranges[node] = value
        return "write"

    def _write_back(self, node: fx.Node, y: fx.Node, divisor: int) -> str:
        """``y[token_idx] = rows``: the rows written back at their tokens, into a tensor split
        like them (the experts' output buffer)."""
        rows = self.d.rows
        inner = is_polynomial_quotient(rows.inner, divisor)
        placement = self.rw.placements.get(y)
        if inner is None or not (isinstance(placement, Shard) and placement.dim == 0 and placement.same_layout(
            Shard(0, rows.length, inner, rows.off)
        )) or sympy.simplify(self.rw.shape(y)[0] * divisor - self.src_rows) != 0:
            raise _Reject(f"{node.name} writes the rows into {y.name}, which is not split like their tokens")
        return "write_back"

    def _rowwise(self, node: fx.Node, name: Optional[str]) -> str:
        if node.op not in ("call_function", "call_method") or name is None:
            raise _Reject(f"{node.name} ({node.target}) is not a row-wise step")
        ndim = self.rw.val(node).dim() if is_tensor(self.rw.val(node)) else None
        if name in ("chunk", "split", "unbind"):
            x = node.args[0]
            pos = 1 if name == "unbind" else 2
            dim = node.kwargs.get("dim", node.args[pos] if len(node.args) > pos else 0)
            if self.role(x) != "rows" or not isinstance(dim, int) or norm_dim(dim, self.rw.val(x).dim()) == 0:
                raise _Reject(f"{node.name} splits the rows")
            self.only_weights_outside(node, ("rows",))
            return "pieces"
        if ndim is None or not self.has_rows(node):
            raise _Reject(f"{node.name} does not keep the rows in dim 0")
        if name in _ELEMENTWISE:
            self.only_weights_outside(node)
            self.broadcasts_rows(node)
            return "rows"
        if name == "bmm":  # each row times its own matrix (experts' weights gathered per row)
            if not all(self.role(a) == "rows" for a in node.all_input_nodes) or node.kwargs:
                raise _Reject(f"{node.name} multiplies rows by values from outside the region")
            return "rows"
        if name in ("linear", "matmul"):
            x = node.args[0]
            if self.role(x) != "rows" or any(self.role(a) for a in node.all_input_nodes if a is not x):
                raise _Reject(f"{node.name} multiplies two region values")
            self.only_weights_outside(node)
            return "rows"
        if name in ("unsqueeze", "squeeze"):
            x = node.args[0]
            dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
            limit = self.rw.val(x).dim() + (1 if name == "unsqueeze" else 0)
            if self.role(x) != "rows" or not isinstance(dim, int) or norm_dim(dim, limit) == 0:
                raise _Reject(f"{node.name} moves the rows dim")
            return "rows"
        if name in ("view", "reshape"):
            x = node.args[0]
            sizes = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
            if self.role(x) != "rows" or node.kwargs or not all(isinstance(s, int) for s in sizes[1:]):
                raise _Reject(f"{node.name} reshapes the rows")
            return "rows"
        if name in _FEATURE_REDUCTIONS:
            x = node.args[0]
            dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
            dims = (dim,) if isinstance(dim, int) else dim
            if self.role(x) != "rows" or not isinstance(dims, (tuple, list)) or any(
                not isinstance(d, int) or norm_dim(d, self.rw.val(x).dim()) == 0 for d in dims
            ):
                raise _Reject(f"{node.name} reduces over the rows")
            self.only_weights_outside(node, ("rows",))
            return "rows"
        raise _Reject(f"{node.name} ({name}) is not a row-wise step")

    def run(self) -> Dispatch:
        root = self.d.sort
        self.d.roles[root] = "select" if _is_select(root) else "index" if calls(root, "argsort") else "sort"
        if self.d.roles[self.d.sort] == "index":
            self.d.divisor[self.d.sort] = 1
        started = False
        for node in self.rw.gm.graph.nodes:
            if node is self.d.sort:
                started = True
                continue
            if not started or not any(a in self.d.roles and self.d.roles[a] != "out" for a in node.all_input_nodes):
                continue
            self.d.roles[node] = self.classify(node)
        if not {"out", "write_back"} & set(self.d.roles.values()):
            raise _Reject("the permuted rows are never put back in token order")
        leftover = [n for n, r in self.d.roles.items() if r == "buffer" and n not in self.written]
        if leftover:
            raise _Reject(f"{leftover[0].name} is never written")
        return self.d


def match_dispatch(rw: "SPRewrite", sort: fx.Node) -> Optional[Dispatch]:
    """The dispatch region that starts at ``sort`` (see the module docstring), or ``None`` when
    it cannot run on the rank's rows (``rw.stats`` then records why, with the fallback)."""
    x = sort.args[0] if sort.args else sort.kwargs.get("input")
    placement = rw.placements.get(x) if isinstance(x, fx.Node) else None
    val = rw.val(x) if isinstance(x, fx.Node) else None
    if not (isinstance(placement, Shard) and placement.dim == 0 and is_tensor(val) and val.dim() >= 1):
        return None
    if _is_select(sort):  # the rows of the mask's true elements: as many as the data says
        n_rows = shape_exprs(rw.val(sort)[0])[0]
    else:
        dim = sort.kwargs.get("dim", sort.args[1] if len(sort.args) > 1 and isinstance(sort.args[1], int) else -1)
        if val.dim() != 1 or dim not in (0, -1):
            return None
        n_rows = rw.shape(x)[0]
    try:
        return _Matcher(rw, sort, placement, rw.shape(x)[0], n_rows).run()
    except _Reject as why:
        rw.stats.dispatch_rejections.append(f"{sort.name}: {why}")
        return None


def emit_dispatch(rw: "SPRewrite", d: Dispatch, node: fx.Node) -> tuple[Any, Any]:
    """``node`` of region ``d`` in the new graph, computed on the rank's rows: ``(value, placement)``."""
    role = d.roles[node]
    if role == "write":  # inv[perm] = arange(rows): the arange over the rank's rows
        buf, idx, _ = node.args
        arange = d.aranges[node]
        n_local = rw.graph.call_method("size", (rw.new_value[idx], 0))
        local = rw.graph.call_function(torch.arange, (n_local,), dict(arange.kwargs))
        new = rw.copy(node, (rw.new_value[buf], rw.new_value[idx], local))
        rw.mutations.add(new)
        return new, None
    if role == "write_back":  # y[token_idx] = rows: this rank's tokens of y, written in place
        y = node.args[0]
        new = rw.copy(node)
        rw.mutations.add(new)
        rw.redistribute.forget(rw.aliases(y))
        return new, None
    if node in d.gathered:  # token-ordered rows (this rank's tokens) indexed by the local permutation
        base, idx = node.args
        return rw.copy(node, (_rank_rows(rw, base, d.gathered[node]), rw.new(idx))), RANK_LOCAL
    if role == "out":
        return rw.copy(node), d.rows
    if role == "rows" and _name(node) in ("view", "reshape"):  # the rows dim is the rank's: -1
        x = node.args[0]
        packed = len(node.args) == 2 and isinstance(node.args[1], (tuple, list))
        rest = list(node.args[1] if packed else node.args[1:])[1:]
        return rw.copy(node, (rw.new_value[x], -1, *rest)), RANK_LOCAL
    new = rw.copy(node)
    if role == "size":
        return new, None
    if role == "assert" or (node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("__")):
        rw.mutations.add(new)  # in place on permuted rows (an expert bias added with add_)
    val = rw.val(node)
    if isinstance(val, (tuple, list)):
        return new, tuple(RANK_LOCAL if is_tensor(v) else None for v in val)
    return new, RANK_LOCAL if is_tensor(val) else None


def _rank_rows(rw: "SPRewrite", base: fx.Node, want: Shard) -> fx.Node:
    """This rank's rows of ``base`` (token-ordered rows of the region's tokens) as ``want``: its
    own value when split so, sliced when whole, else gathered and sliced (a layout of other tokens)."""
    placement = rw.placements.get(base)
    if placement is REPLICATE or (isinstance(placement, Shard) and placement.dim == 0 and placement.same_layout(want)):
        return rw.redistribute.to_shard(base, want)
    from autosp.errors import AutoSPError
    from autosp.passes import runtime

    if not isinstance(placement, Shard):
        raise AutoSPError(f"internal: {base.name} ({placement}) gathered by a mixture-of-experts dispatch")
    whole = rw.redistribute.to_replicate(base)
    return rw.graph.call_function(runtime.shard_slice, (whole, *rw.redistribute.slice_args(base, want)))
