"""Token-wise work over tiles of rows: an MLP's wide intermediates, a norm's fp32 copies never exist whole.

An MLP turns each token's ``[hidden]`` vector into ``[4 x hidden]`` (or more) intermediates and
back, and autograd keeps those intermediates, and their gradients, for the whole sequence. Every
row of such a region depends on its own row alone, so :func:`tiled_rows` runs it ``tile`` rows at a
time and keeps nothing but its inputs; backward runs each tile's forward again and takes that
tile's gradients with autograd while the tile's intermediates are live (DeepSpeed ALST's TiledMLP,
applied by a compiler pass instead of by hand). The vocabulary loss
(:mod:`autosp.ops.fused_loss`) tiles rows the same way; it computes its gradients in forward
because its backward only scales them.

The region is a small FX graph the pass (:mod:`autosp.passes.tiled_mlp`) cut out of the
step: the first input is the token rows ``[..., features]``, the others are weights.
:func:`register_region` traces it once to aten ops with ``make_fx`` (rows symbolic, autocast as
the step had it, so the casts are explicit): its forward, and its forward again followed by the
backward of ``sum(grad * out)`` with respect to the rows and the weights. The ops run those graphs
per tile, so they need neither autograd nor autocast inside (a custom op's kernel runs below
both). Each region is registered under a key made from its code, dtypes and autocast state, so a
compiled graph that names the key finds the same region in any process that ran the pass. The
ops live in their own namespace (``autosp_tile``), not ``autosp``: the memory report and SAC count
every ``autosp::`` op as a collective.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["register_region", "tiled_rows", "tiled_rows_backward", "auto_tile_rows", "workspace_bytes", "region_kind", "TILE_BYTES"]

#: the widest intermediate of one tile, in bytes, when the tile is sized automatically
TILE_BYTES = 64 * 2**20

@dataclass(frozen=True)
class _Region:
    forward: fx.GraphModule  # (rows, *weights) -> out rows
    backward: fx.GraphModule  # (rows, *weights, grad rows) -> (grad rows, *grad weights)
    out_features: int
    out_dtype: torch.dtype


_REGIONS: dict[str, _Region] = {}


def auto_tile_rows(width: int, item_size: int) -> int:
    """Rows per tile so that one tile's widest intermediate (``width`` features of ``item_size``
    bytes) takes about :data:`TILE_BYTES` (1170 rows for Llama-3-8B's 14336 features in bf16)."""
    return max(64, TILE_BYTES // max(int(width) * int(item_size), 1))


def _autocast(device: torch.device, dtype: Optional[torch.dtype]) -> torch.autocast:
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def register_region(
    region: fx.GraphModule, x: torch.Tensor, weights: Sequence[torch.Tensor], autocast_dtype: Optional[torch.dtype]
) -> str:
    """Trace ``region`` for rows like ``x`` (any number of them; its last dim is the features) and
    ``weights`` (their shapes, dtypes and device; nothing is read), under autocast to
    ``autocast_dtype`` (``None``: off). Returns the key :func:`tiled_rows` takes."""
    device = x.device
    spec = (region.code, x.shape[-1], str(x.dtype), str(device.type), autocast_dtype,
            tuple((tuple(w.shape), str(w.dtype)) for w in weights))
    key = "region_" + hashlib.sha256(repr(spec).encode()).hexdigest()[:16]
    if key in _REGIONS:
        return key
    # examples: 7 rows (not 0 or 1, which symbolic tracing would specialise), weights as one
    # element expanded to their shape (nothing of their size is allocated)
    rows = torch.zeros(7, x.shape[-1], dtype=x.dtype, device=device)
    ws = [torch.zeros(1, dtype=w.dtype, device=device).expand(w.shape) for w in weights]

    def forward(r, *w):
        with _autocast(device, autocast_dtype):
            return region(r, *w)

    with torch.no_grad():
        out = forward(rows, *ws)
    grad = torch.zeros_like(out)

    def backward(r, *args):
        *w, g = args
        with torch.enable_grad():
            r = r.detach().requires_grad_(True)
            w = [t.detach().requires_grad_(t.is_floating_point()) for t in w]
            with _autocast(device, autocast_dtype):
                y = region(r, *w)
            wrt = [r, *(t for t in w if t.requires_grad)]
            return torch.autograd.grad(y, wrt, g, allow_unused=True)

    fw = make_fx(forward, tracing_mode="symbolic")(rows, *ws)
    bw = make_fx(backward, tracing_mode="symbolic")(rows, *ws, grad)
    for gm in (fw, bw):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    _REGIONS[key] = _Region(fw, bw, int(out.shape[-1]), out.dtype)
    return key


_MATMULS = {"mm", "addmm", "bmm", "matmul", "linear"}
#: reductions over the last dim a region may hold (an RMSNorm's mean of squares)
ROW_REDUCTIONS = frozenset({"mean", "sum", "amax", "amin"})


@functools.lru_cache(maxsize=1024)
def region_kind(key: str) -> str:
    """The memory report's kind of a region's output (and SAC's, which recomputes the ``linear``
    and ``norm`` kinds by default): ``"linear"`` when it holds a matmul (an MLP), ``"norm"`` when
    it reduces its rows without one (a norm), else ``"other"``."""
    names = {n.target._overloadpacket.__name__ for n in _region(key).forward.graph.nodes if isinstance(n.target, torch._ops.OpOverload)}
    return "linear" if names & _MATMULS else "norm" if names & ROW_REDUCTIONS else "other"


@functools.lru_cache(maxsize=4096)  # a region's key names its code: the answer never changes
def workspace_bytes(key: str, tile: int, backward: bool = False) -> int:
    """Bytes the op (``backward``: its backward) allocates while it runs beyond its inputs and
    outputs: for one tile of ``tile`` rows, the peak of a liveness walk over the region's traced
    graph (each op allocates its output, freed after its last use; views counted as allocations:
    an upper bound), and in backward the weights' gradient accumulators (fp32 for 16-bit weights).
    What the memory model adds at the op."""
    gm = (_region(key).backward if backward else _region(key).forward)
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    rows = placeholders[0].meta["val"].shape[0]
    env = rows.node.shape_env
    hints = getattr(env, "backed_var_to_val", None) or env.var_to_val  # renamed in torch 2.13
    binding = dict(hints)
    binding[rows.node.expr] = tile

    def nbytes(n: fx.Node) -> int:
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor):
            return 0
        numel = v.numel()
        numel = int(numel.node.expr.xreplace(binding)) if isinstance(numel, torch.SymInt) else int(numel)
        return numel * v.element_size()

    last = {n: i for i, n in enumerate(nodes)}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[a] = i
    live = peak = 0
    for i, n in enumerate(nodes[:-1]):
        if n.op == "call_function":
            live += nbytes(n)
            peak = max(peak, live)
        for a in n.all_input_nodes:
            if last[a] == i and a.op == "call_function":
                live -= nbytes(a)
    if backward:
        for w in placeholders[1:-1]:
            v = w.meta["val"]
            if v.is_floating_point():
                numel = v.numel()
                numel = int(numel.node.expr.xreplace(binding)) if isinstance(numel, torch.SymInt) else int(numel)
                peak += numel * max(4, v.element_size())
    return peak


def _region(key: str) -> _Region:
    try:
        return _REGIONS[key]
    except KeyError:
        raise RuntimeError(
            f"internal: tiled region {key} is not registered in this process (a compiled graph from another "
            "process's cache?). Report this; AutoSPStrategy(tiled_mlp=False) is a workaround."
        ) from None


@torch.library.custom_op("autosp_tile::rows", mutates_args=())
def tiled_rows(x: torch.Tensor, weights: list[torch.Tensor], key: str, tile: int) -> torch.Tensor:
    """The region registered as ``key`` on ``x``'s rows (its dims before the last, flattened),
    ``tile`` rows at a time."""
    region = _region(key)
    rows = x.reshape(-1, x.shape[-1])
    out = rows.new_empty((rows.shape[0], region.out_features), dtype=region.out_dtype)
    for start in range(0, rows.shape[0], tile):
        out[start : start + tile] = region.forward(rows[start : start + tile], *weights)
    return out.reshape(*x.shape[:-1], region.out_features)


@tiled_rows.register_fake
def _(x, weights, key, tile):
    region = _region(key)
    return x.new_empty((*x.shape[:-1], region.out_features), dtype=region.out_dtype)


@torch.library.custom_op("autosp_tile::rows_backward", mutates_args=())
def tiled_rows_backward(grad: torch.Tensor, x: torch.Tensor, weights: list[torch.Tensor], key: str, tile: int) -> list[torch.Tensor]:
    """The gradients of ``sum(grad * tiled_rows(x, weights, key, tile))`` with respect to ``x``
    and each weight (zeros for weights that are not floating point): each tile's forward run
    again, then its backward; the weights' gradients summed over the tiles (in fp32 for 16-bit
    weights)."""
    region = _region(key)
    rows = x.reshape(-1, x.shape[-1])
    grad_rows = grad.reshape(-1, grad.shape[-1])
    grad_x = torch.empty_like(rows)
    trainable = [w for w in weights if w.is_floating_point()]
    acc = [torch.zeros_like(w, dtype=torch.float32 if w.element_size() < 4 else w.dtype) for w in trainable]
    for start in range(0, rows.shape[0], tile):
        grads = region.backward(rows[start : start + tile], *weights, grad_rows[start : start + tile])
        grad_x[start : start + tile] = grads[0]
        for a, g in zip(acc, grads[1:]):
            if g is not None:
                a += g
    it = iter(acc)
    out = [grad_x.reshape(x.shape)]
    for w in weights:
        out.append(next(it).to(w.dtype) if w.is_floating_point() else torch.zeros_like(w))
    return out


@tiled_rows_backward.register_fake
def _(grad, x, weights, key, tile):  # the rows' gradient contiguous whatever x's layout (as the kernel writes it)
    return [x.new_empty(x.shape), *(torch.empty_like(w) for w in weights)]


def _setup_context(ctx, inputs, output) -> None:
    x, weights, key, tile = inputs
    ctx.save_for_backward(x, *weights)
    ctx.key, ctx.tile = key, tile


def _backward(ctx, grad):
    x, *weights = ctx.saved_tensors
    grads = tiled_rows_backward(grad, x, list(weights), ctx.key, ctx.tile)
    return grads[0], list(grads[1:]), None, None


tiled_rows.register_autograd(_backward, setup_context=_setup_context)
