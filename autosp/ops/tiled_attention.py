"""Attention over tiles of (query rows x key columns), with the mask evaluated as a function per tile.

A mask a model builds for attention (causal, padding, packed documents, sliding windows, ALiBi,
soft-capping) reaches this op as a *score program* and its *leaves*
(:mod:`autosp.ops.score_program`): the logits of a tile as a function of its raw scores and of
tensors with at most one sequence axis. :func:`tiled_attention` never materialises the ``S x S``
mask. Three ops:

* :func:`~autosp.ops.live_tiles.live_tiles` - which tiles may hold an unmasked logit (above
  :data:`~autosp.ops.score_program.MASKED`), from the program's bounds over each tile
  (:mod:`autosp.ops.live_tiles`), as a map on the host. It depends on the mask alone: the SP pass
  emits it once for every attention that reads the same mask, and it reads the device once.
* :func:`tiled_attention` - per query block, an online softmax over its live key tiles (fp32
  running max, sum and output; :mod:`autosp.ops.tile_kernels`), each tile (or run of tiles
  without a bias) in the kernel the kernel table (:mod:`autosp.ops.kernels`) names for the device.
  It returns the output and, per query row, the running max (or log-sum-exp) ``m`` and sum ``l``.
  A mask that is exactly causal for the batch in hand (Hugging Face's mask builder on rows with
  no padding and one document: the map says so, :func:`~autosp.ops.live_tiles.exactly_causal`)
  runs as one call of the table's causal kernel with ``is_causal`` over the whole sequence: no tiles.
* :func:`tiled_attention_backward` - each computed tile recomputed, in the fused kernel's
  backward, or interpreted (``p = exp(z - m) / l``) with the derivative ``dz/ds`` of the program,
  which is element-wise in ``s`` (scaling, soft-capping ``tanh``, masks added or filled in).
  Leaves get no gradient (the pass keeps the dense path for a mask or bias that needs one).

Nothing larger than one tile of ``[B, H, tile, tile]`` exists at a time, forward or backward
(runs of tiles without a bias: their keys, no scores).
Rows whose every key is masked are what dense attention makes of them (see
:mod:`autosp.ops.tile_kernels`). The ops compute in fp32 and return the output in the program's
``out_dtype`` (fp64 inputs: in fp64).

The ops live in their own namespace (``autosp_attn``): the memory report and SAC count every
``autosp::`` op as a collective; :mod:`~autosp.passes.accounting` counts these as
attention. The ring level of sequence parallelism runs the same tile kernels on the blocks of
each ring step (:mod:`autosp.ops.ring_attention`).
"""

from __future__ import annotations

import hashlib
import math
import pathlib

import torch

from autosp.ops import kernels
from autosp.ops.live_tiles import CAUSAL, FILL, LIVE, LIVE_NO_BIAS, PROBE_TILES, is_causal_map, live_map, live_tiles, probe_bytes
from autosp.ops.score_program import MASKED, TANGENT_RULES, ScoreProgram, is_known_call
from autosp.ops.tile_kernels import (
    TILE_COUNTS, acc_dtype, backward_rows, causal_backward, causal_forward, finish_rows, forward_rows, heads_inside, tiles,
)

__all__ = [
    "attend", "tiled_attention", "tiled_attention_backward", "live_tiles", "live_map", "ScoreProgram", "MASKED", "DEFAULT_TILE",
    "TILE_COUNTS", "workspace_bytes", "probe_bytes", "KERNEL_VERSION", "TANGENT_RULES", "is_known_call", "LIVE", "LIVE_NO_BIAS",
    "CAUSAL", "FILL", "PROBE_TILES", "default_tile",
]

#: query rows and key columns per tile on CPU (one tile of fp32 scores for 8 heads: 8 MiB)
DEFAULT_TILE = 512
#: ... on CUDA, where a tile is a call of a fused kernel (a tile's bias: 2 MiB in bf16) and
#: consecutive tiles without a bias are one call: fewer, larger calls
CUDA_TILE = 1024


def default_tile(device: torch.device) -> int:
    """Rows and columns per tile when ``tiled_attention=True``: :data:`DEFAULT_TILE` on CPU,
    :data:`CUDA_TILE` on CUDA."""
    return CUDA_TILE if device.type == "cuda" else DEFAULT_TILE

#: the hash of the kernel's files, part of every score program: a graph compiled (and cached by
#: inductor) for another version of the kernel - with other output layouts, say - is not reused
KERNEL_VERSION = hashlib.sha256(b"".join(
    (pathlib.Path(__file__).parent / name).read_bytes()
    for name in ("score_program.py", "live_tiles.py", "tile_kernels.py", "tiled_attention.py", "ring_attention.py", "kernels.py")
)).hexdigest()[:16]


def workspace_bytes(q_shape: tuple, kv_shape: tuple, dtype: torch.dtype, tile: int, backward: bool) -> int:
    """Bytes :func:`tiled_attention` (``backward``: its backward) allocates while it runs, beyond
    its inputs and outputs (what a memory model adds at the op): a few ``[B, Hq, tile, tile]``
    tiles (scores, logits, probabilities, their gradient) and one query block's running sums, in
    the compute dtype (fp32, fp64 for fp64 inputs); backward also the fp32 accumulators of the
    key and value gradients over the whole sequence when the inputs are in a lower precision."""
    B, Hq, S, D = q_shape
    item = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    t = min(tile, int(S))
    tiles_ = (6 if backward else 4) * B * Hq * t * t * item
    block = 3 * B * Hq * t * D * item
    acc = 2 * math.prod(kv_shape) * item if backward and item != torch.empty((), dtype=dtype).element_size() else 0
    return tiles_ + block + acc


def in_layout(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype and strides of ``buf``, a fresh tensor laid out as the fake kernel
    declares: ``x`` itself when it has them, else ``x`` copied into ``buf``. Every path of an op
    returns what its fake kernel declares (Inductor checks the strides of a custom op's outputs);
    the fused kernel writes its output in its inputs' layout but its log-sum-exp as ``[B, S, H]``."""
    if x.dtype == buf.dtype and x.stride() == buf.stride():
        return x
    return buf.copy_(x)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"tiled_attention expects [B, H, S, D] q, k, v; got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"tiled_attention: heads q {q.shape[1]}, k {k.shape[1]}, v {v.shape[1]} do not group")


def _causal_kernel(prog: ScoreProgram, rows: list[list[int]], q: torch.Tensor, v: torch.Tensor):
    """The table's kernel for a map marked exactly causal, or ``None`` (tiles): an additive program
    whose inputs a fused causal kernel takes."""
    if not is_causal_map(rows) or prog.additive is None:
        return None
    kernel = kernels.choose("causal", q, v)
    return None if kernel == "tiles" else kernel


@torch.library.custom_op("autosp_attn::tiled_attention", mutates_args=())
def tiled_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list[torch.Tensor], live: torch.Tensor, program: str, tile: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, m, l)``: ``softmax(z) @ v`` with ``z`` the score program's logits of ``q @ k^T``
    (q ``[B, Hq, Sq, D]``; k, v ``[B, Hk, S, D]`` with ``Hq`` a multiple of ``Hk``: query head
    ``i`` reads KV head ``i // (Hq/Hk)``), computed ``tile`` rows by ``tile`` columns at a time,
    over the tiles :func:`live_tiles` marks (``live``); ``m``, ``l`` ``[B, Hq, Sq]`` (fp32) are
    each row's max logit and softmax denominator (see the module docstring)."""
    check_qkv(q, k, v)
    prog = ScoreProgram.parse(program)
    B, Hq, Sq, _ = q.shape
    out = heads_inside(q, (B, Hq, Sq, v.shape[-1]), prog.out_dtype)
    m_all = torch.empty((B, Hq, Sq), dtype=acc_dtype(q), device=q.device)
    l_all = torch.empty((B, Hq, Sq), dtype=acc_dtype(q), device=q.device)
    rows = live.tolist()  # a host tensor: no read of the device
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        kernel = _causal_kernel(prog, rows, q, v)
        if kernel is not None:  # exactly causal: one call of the table's causal kernel, no tiles
            m, l, res = causal_forward(prog, kernel, q, k, v)
            return in_layout(res.to(prog.out_dtype), out), in_layout(m, m_all), in_layout(l, l_all)
        for i, (q0, q1) in enumerate(tiles(Sq, tile)):
            res, m, l = finish_rows(forward_rows(prog, q, k, v, leaves, q0, q1, tile, rows[i]))
            out[:, :, q0:q1] = res.to(out.dtype)
            m_all[:, :, q0:q1] = m
            l_all[:, :, q0:q1] = l
    return out, m_all, l_all


@tiled_attention.register_fake
def _(q, k, v, leaves, live, program, tile):
    prog = ScoreProgram.parse(program)
    B, Hq, Sq, _ = q.shape
    dtype = acc_dtype(q)
    return (
        heads_inside(q, (B, Hq, Sq, v.shape[-1]), prog.out_dtype),
        q.new_empty((B, Hq, Sq), dtype=dtype),
        q.new_empty((B, Hq, Sq), dtype=dtype),
    )


@torch.library.custom_op("autosp_attn::tiled_attention_backward", mutates_args=())
def tiled_attention_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, m: torch.Tensor,
    l: torch.Tensor, live: torch.Tensor, leaves: list[torch.Tensor], program: str, tile: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`tiled_attention`: the tiles the forward computed (``live``), recomputed."""
    prog = ScoreProgram.parse(program)
    Sq = q.shape[2]
    dtype = acc_dtype(q)
    dq = heads_inside(q, tuple(q.shape))
    rows = live.tolist()
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        kernel = _causal_kernel(prog, rows, q, v)
        if kernel is not None:
            grads = causal_backward(prog, kernel, grad_out, q, k, v, out, m, l)
            bufs = (dq, heads_inside(k, tuple(k.shape)), heads_inside(v, tuple(v.shape)))
            return tuple(in_layout(g, buf) for g, buf in zip(grads, bufs))  # the layouts the fake declares
        dk = heads_inside(k, tuple(k.shape), dtype, zero=True)
        dv = heads_inside(v, tuple(v.shape), dtype, zero=True)
        delta = (grad_out.to(dtype) * out.to(dtype)).sum(-1)  # [B, Hq, Sq]
        for i, (q0, q1) in enumerate(tiles(Sq, tile)):
            dq_blk = backward_rows(prog, grad_out, q, out, m, l, delta, k, v, leaves, q0, q1, tile, rows[i], dk, dv)
            dq[:, :, q0:q1] = 0.0 if dq_blk is None else dq_blk.to(q.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype)  # .to keeps the layout


@tiled_attention_backward.register_fake
def _(grad_out, q, k, v, out, m, l, live, leaves, program, tile):
    return heads_inside(q, tuple(q.shape)), heads_inside(k, tuple(k.shape)), heads_inside(v, tuple(v.shape))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, leaves, live, program, tile = inputs
    out, m, l = output
    ctx.program, ctx.tile, ctx.n_leaves = program, tile, len(leaves)
    ctx.save_for_backward(q, k, v, out, m, l, live, *leaves)


def _backward(ctx, grad_out, _grad_m, _grad_l):
    q, k, v, out, m, l, live, *leaves = ctx.saved_tensors
    dq, dk, dv = tiled_attention_backward(grad_out.contiguous(), q, k, v, out, m, l, live, leaves, ctx.program, ctx.tile)
    return dq, dk, dv, [None] * ctx.n_leaves, None, None, None


tiled_attention.register_autograd(_backward, setup_context=_setup_context)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list[torch.Tensor], program: str, tile: int) -> torch.Tensor:
    """:func:`tiled_attention`'s output over the tiles :func:`live_tiles` finds (differentiable)."""
    live = live_tiles(leaves, program, tile, q.shape[2], k.shape[2])
    return tiled_attention(q, k, v, leaves, live, program, tile)[0]
