"""The liveness walk: per-rank bytes of a traced forward and backward graph at any length.

Sizes in the graphs are expressions of the sequence length, so one trace answers every length
(:class:`Trace`). :func:`walk` goes over one graph in order: each op allocates its outputs (views
allocate nothing and keep their base alive); an allocation is freed after its last use; what the
forward saves stays live into the backward and is freed after its last use there; parameter
gradients are left to the static memory, or counted to the end of the backward with
``count_grads``. The AutoSP ops that allocate working memory of their own - the fused loss's
chunk, a tiled region's tile, the tiled attention's tiles, a ring step's key/value blocks in
flight - add it at the op. The walk is over the unfused AOT graphs, so it over-counts the
transients a fusing compiler (inductor) never materialises: an upper bound for a compiled run.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from autosp.ops import fused_loss, ring_attention, tiled_attention, tiled_rows
from autosp.passes.accounting import empty_by_kind, is_alias, list_saved_activations

__all__ = ["Trace", "Walk", "walk"]


@dataclass
class Trace:
    """The forward and backward graphs of one training step."""

    fw: fx.GraphModule
    bw: fx.GraphModule
    num_fwd_outputs: int
    #: read as activation offload of every saved tensor (``walk(offload=True)``)
    offload: bool = False
    _sizes: dict = field(default_factory=dict, repr=False)

    def nbytes(self, expr: sympy.Expr, S: int) -> int:
        if expr.is_Integer:
            return int(expr)
        key = (expr, S)
        if key not in self._sizes:
            # the only dynamic sizes are the sequence lengths of ids and labels (equal)
            self._sizes[key] = int(expr.xreplace({s: sympy.Integer(S) for s in expr.free_symbols}))
        return self._sizes[key]

    def memory(self, S: int, count_grads: bool = False, offload: bool = False) -> dict[str, int]:
        """``saved``, ``fw_peak`` and ``bw_peak`` activation bytes of rank 0 at length ``S``.

        ``count_grads``: also count the parameter gradients the backward graph returns, live
        from when each is made to the end of the graph (a run whose ``.grad`` already exists);
        by default they are left to the static memory. ``offload``: every saved tensor in host
        memory from its last forward use to its first backward use (:func:`walk`)."""
        fw = walk(self.fw, S, self, saved_from=None, num_fwd_outputs=self.num_fwd_outputs, offload=offload or self.offload)
        bw = walk(self.bw, S, self, saved_from=fw, count_grads=count_grads)
        return {"saved": fw.saved, "fw_peak": fw.peak, "bw_peak": bw.peak, "peak": max(fw.peak, bw.peak), "host": fw.host}

    def saved_by_kind(self, S: int) -> dict[str, int]:
        """Bytes saved on the device per op kind (the memory report's kinds) at length ``S``."""
        out = empty_by_kind()
        if self.offload:
            return out
        for t in list_saved_activations(self.fw, self.num_fwd_outputs):
            if not t.host:
                out[t.kind] += self.nbytes(t.nbytes, S)
        return out


def _tensor_bytes(val: Any) -> Optional[sympy.Expr]:
    if not isinstance(val, torch.Tensor):
        return None
    n = val.numel()
    n = sympy.sympify(n.node.expr) if isinstance(n, torch.SymInt) else sympy.Integer(int(n))
    return sympy.expand(n * val.element_size())


def _is_alias_node(n: Any) -> bool:
    return (
        isinstance(n, fx.Node) and n.op == "call_function" and is_alias(n.target)
        and bool(n.args) and isinstance(n.args[0], fx.Node)
    )


_FUSED_LOSS = torch.ops.autosp_loss.linear_cross_entropy.default
_OFFLOAD = torch.ops.autosp_offload.offload.default
_RELOAD = torch.ops.autosp_offload.reload.default
#: tiled MLP ops -> (position of the region key, of the tile size, backward)
_TILED_ROWS = {torch.ops.autosp_tile.rows.default: (2, 3, False), torch.ops.autosp_tile.rows_backward.default: (3, 4, True)}
_TILED = {
    torch.ops.autosp_attn.tiled_attention.default: False, torch.ops.autosp_attn.tiled_attention_backward.default: True,
    torch.ops.autosp_attn.live_tiles.default: None, torch.ops.autosp_attn.ring_live_tiles.default: None,
    torch.ops.autosp_attn.ring_attention.default: False, torch.ops.autosp_attn.ring_attention_backward.default: True,
}
_RING = (torch.ops.autosp_attn.ring_attention.default, torch.ops.autosp_attn.ring_attention_backward.default)


def _tiled_workspace(n: fx.Node, S: int, tr: "Trace") -> int:
    size = lambda d: tr.nbytes(sympy.sympify(d.node.expr) if isinstance(d, torch.SymInt) else sympy.Integer(int(d)), S)  # noqa: E731
    backward = _TILED[n.target]
    if backward is None:  # live_tiles: the mask over a block of rows; its heads are at most the query's
        length = n.args[3].meta["val"] if isinstance(n.args[3], fx.Node) else n.args[3]
        return tiled_attention.probe_bytes(1, 1, size(length), n.args[2])
    q, k = (n.args[1], n.args[2]) if backward else (n.args[0], n.args[1])
    qv, kv = q.meta["val"], k.meta["val"]
    q_shape, kv_shape = tuple(size(d) for d in qv.shape), tuple(size(d) for d in kv.shape)
    if n.target in _RING:  # the tiles of one step, and the blocks in flight (with their gradients in backward)
        tile = n.args[10] if backward else n.args[6]
        return tiled_attention.workspace_bytes(q_shape, kv_shape, qv.dtype, tile, backward) + ring_attention.ring_workspace_bytes(kv_shape, kv.dtype, backward)
    return tiled_attention.workspace_bytes(q_shape, kv_shape, qv.dtype, n.args[-1], backward)


def _fused_workspace(n: fx.Node, S: int, tr: Trace) -> int:
    h, w = n.args[0].meta["val"], n.args[1].meta["val"]
    rows = tr.nbytes(_tensor_bytes(h), S) // (h.element_size() * int(h.shape[-1]))
    logits_dtype, chunk = n.args[7], n.args[8]
    plain = n.args[4] is None and not n.args[6]  # no class weights, no label smoothing
    return fused_loss.workspace_bytes(rows, int(w.shape[0]), int(w.shape[1]), w.dtype, logits_dtype, chunk, plain)


@dataclass
class Walk:
    """What a liveness walk over one graph found (see :func:`walk`)."""

    peak: int
    saved: int
    #: forward output name -> the allocation it refers to (None: a parameter or an input)
    outputs: dict[str, Any]
    size: dict[Any, int]
    #: bytes the forward moved to host memory (activation offload): not on the device
    host: int = 0
    #: the allocations moved there (``walk(offload=True)``)
    moved: set = field(default_factory=set)


def walk(
    gm: fx.GraphModule, S: int, tr: Trace, saved_from: Optional[Walk], num_fwd_outputs: int = 0, count_grads: bool = False,
    offload: bool = False,
) -> Walk:
    """Liveness walk over one graph. For the backward graph (``saved_from`` = the forward's
    walk) the placeholders that the forward saved refer to the forward's allocations.

    ``offload`` (forward): what activation offload does to every saved allocation - it leaves the
    device after its last forward use (its bytes count as ``host``) and, in the backward walk,
    comes back at its first use there."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    storage: dict[fx.Node, Any] = {}  # node -> the allocation it refers to
    size: dict[Any, int] = {}
    born: dict[Any, int] = {}
    host = 0
    for n in nodes:
        if n.op == "placeholder":
            if saved_from is None:
                continue  # forward inputs: parameters and the batch, not activations
            if n.name in saved_from.outputs:  # saved by the forward
                key = saved_from.outputs[n.name]
                if key is not None:
                    first = min((index[u] for u in n.users), default=len(nodes)) if key in saved_from.moved else -1
                    storage[n], size[key] = key, saved_from.size[key]
                    born[key] = min(born.get(key, first), first)
                continue
            if any(u.target is _RELOAD for u in n.users):  # a host copy (offload pass): its reload allocates
                continue
            b = _tensor_bytes(n.meta.get("val"))  # the loss gradient
            if b is not None:
                storage[n], size[n], born[n] = n, tr.nbytes(b, S), -1
        elif n.op != "call_function":
            continue
        elif _is_alias_node(n):
            if n.args[0] in storage:
                storage[n] = storage[n.args[0]]
        elif n.target is operator.getitem and _is_alias_node(n.args[0]):
            if n.args[0] in storage:  # an output of a multi-output view op (split, unbind)
                storage[n] = storage[n.args[0]]
        elif n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            b = _tensor_bytes(n.meta.get("val"))
            if b is not None:
                key = (n.args[0], n.args[1])
                storage[n], size[key], born[key] = key, tr.nbytes(b, S), index[n.args[0]]
        elif n.target is _OFFLOAD:  # a copy in host memory: none on the device
            storage[n], size[n], born[n] = n, 0, index[n]
            host += tr.nbytes(_tensor_bytes(n.meta["val"]), S)
        else:
            b = _tensor_bytes(n.meta.get("val"))
            if b is not None:
                storage[n], size[n], born[n] = n, tr.nbytes(b, S), index[n]
            if n.target in _TILED_ROWS:  # one tile's intermediates live only inside the op
                key_at, tile_at, backward = _TILED_ROWS[n.target]
                x = n.args[key_at - 2].meta["val"]  # the rows: rows(x, ...), rows_backward(grad, x, ...)
                rows = tr.nbytes(_tensor_bytes(x), S) // (x.element_size() * int(x.shape[-1]))
                key = ("workspace", n)
                tile = max(1, min(n.args[tile_at], rows))
                size[key], born[key] = tiled_rows.workspace_bytes(n.args[key_at], tile, backward), index[n]
            if n.target is _FUSED_LOSS:  # its chunk's logits live only inside the op
                key = ("workspace", n)
                size[key], born[key] = _fused_workspace(n, S, tr), index[n]
            elif n.target in _TILED:  # its tiles live only inside the op
                key = ("workspace", n)
                size[key], born[key] = _tiled_workspace(n, S, tr), index[n]
    out_node = nodes[-1]
    outs = [o for o in tree_leaves(out_node.args[0]) if isinstance(o, fx.Node)]
    last: dict[Any, int] = dict(born)
    for n in nodes[:-1]:
        for a in n.all_input_nodes:
            k = storage.get(a)
            if k is not None:
                last[k] = max(last[k], index[n])
    moved: set = set()
    if saved_from is None:  # forward: the loss and the saved tensors outlive the graph
        kept = {storage[o] for o in outs[num_fwd_outputs:] if storage.get(o) is not None}
        returned = {storage[o] for o in outs[:num_fwd_outputs] if storage.get(o) is not None}
        if offload:  # what stays is what the user gets back; the rest goes to host memory
            moved = {k for k in kept if k not in returned and size[k]}
            host += sum(size[k] for k in moved)
        for k in (kept | returned) - moved:
            last[k] = len(nodes)
        saved = sum(size[k] for k in kept - moved)
    else:  # backward: parameter gradients live to the end of the graph, or belong to the static memory
        for o in outs:
            if storage.get(o) is not None and born.get(storage[o], -1) >= 0:
                if count_grads:
                    last[storage[o]] = len(nodes)
                else:
                    size[storage[o]] = 0
        saved = 0
    births: dict[int, list] = {}
    deaths: dict[int, list] = {}
    for k in size:
        births.setdefault(born[k], []).append(k)
        deaths.setdefault(last[k], []).append(k)
    live = peak = sum(size[k] for k in births.get(-1, ()))
    for i in range(len(nodes)):
        live += sum(size[k] for k in births.get(i, ()))
        peak = max(peak, live)
        live -= sum(size[k] for k in deaths.get(i, ()))
    return Walk(peak=peak, saved=saved, outputs={o.name: storage.get(o) for o in outs}, size=size, host=host, moved=moved)
