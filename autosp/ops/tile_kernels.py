"""The tile kernels: attention of a block of query rows over a block of keys, one tile at a time.

Every function here works on one block of query rows ``[q0, q1)`` of ``q`` against the keys and
values ``k``, ``v`` it is given, over the key tiles a live-tile row (:mod:`.live_tiles`) marks.
The rows and columns are spans of the sequence: ``q_off`` and ``k_off`` are the positions of
``q``'s row 0 and ``k``'s column 0, so the same kernels serve the whole sequence
(:mod:`.tiled_attention`) and one part of it against another (a ring step,
:mod:`.ring_attention`). A block's result is an online-softmax *state* ``(m, l, acc)``: per query
row the running max logit and softmax denominator (fp32) and the unnormalised output. States of
the same rows over different keys :func:`merge` exactly (log-sum-exp rescaling), which is how a
block of rows accumulates its key tiles and a ring rank its steps.

Two ways to compute a tile: *interpreted* (the score program evaluated in PyTorch, any program,
with its derivative ``dz/ds`` in backward) and *fused* (an additive program, ``s * scale + bias``,
on CPU: each tile in PyTorch's fused flash kernel with the bias as its mask).

Rows with no unmasked key follow dense attention: with ``-inf`` (or a bool mask) output 0 and no
gradient; with a finite fill such as ``finfo.min`` a softmax over the fill values, which reads
every key - so a block of rows where one such row has no key yet (``alive``: rows that found one
over earlier keys) is computed over every tile of the keys in hand, forward and backward.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from autosp.ops.live_tiles import LIVE_NO_BIAS
from autosp.ops.score_program import MASKED, ScoreProgram, tile_positions

__all__ = [
    "forward_rows", "backward_rows", "finish_rows", "merge", "fused", "tiles", "heads_inside", "acc_dtype", "causal_forward",
    "causal_backward", "TILE_COUNTS",
]

#: tiles the forward computed and skipped in this process so far, and the attention calls it ran as
#: plain causal attention instead (no tiles; read by the tests and benchmarks)
TILE_COUNTS = {"computed": 0, "skipped": 0, "causal": 0}

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

#: ``(m, l, acc)``: per query row the max logit, the softmax denominator and the unnormalised output
State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def tiles(n: int, t: int) -> list[tuple[int, int]]:
    return [(i, min(i + t, n)) for i in range(0, n, t)]


def grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, t, D]`` -> ``[B, Hk, (Hq/Hk)*t, D]``: query head ``i`` next to KV head ``i // (Hq/Hk)``."""
    B, Hq, t, D = x.shape
    return x.reshape(B, kv_heads, (Hq // kv_heads) * t, D)


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """What the kernel computes in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def heads_inside(like: torch.Tensor, shape: tuple, dtype: Optional[torch.dtype] = None, zero: bool = False) -> torch.Tensor:
    """A new ``[B, H, S, D]`` tensor laid out as ``[B, S, H, D]`` (a transposed view), as the SP
    pass's exchanges read attention's inputs and outputs: its transpose is contiguous."""
    B, H, S, D = shape
    make = like.new_zeros if zero else like.new_empty
    return make((B, S, H, D), dtype=dtype or like.dtype).transpose(1, 2)


def fused(prog: ScoreProgram, q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the tiles run in PyTorch's fused CPU attention kernel: an additive program on CPU
    tensors (the kernel takes the bias as its mask and returns the log-sum-exp) whose values have
    the queries' head size (not DeepSeek's MLA, say)."""
    return prog.additive is not None and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]


def _key_tiles(prog, leaves, q0, q1, kv_len, tile, cols, device, q_off, k_off):
    """Key tiles ``cols`` of query rows ``[q0, q1)``: ``j``, ``[k0, k1)`` (columns of ``k``), the
    leaves cut to the tile and its positions (absolute: ``q_off``/``k_off`` added)."""
    for j in cols:
        k0, k1 = j * tile, min((j + 1) * tile, kv_len)
        a0, a1, b0, b1 = q_off + q0, q_off + q1, k_off + k0, k_off + k1
        yield j, k0, k1, prog.leaf_tiles(leaves, a0, a1, b0, b1), tile_positions(prog, a0, a1, b0, b1, device)


def _interpreted_forward(prog, qg, k, v, leaves, q0, q1, tile, cols, shape, q_off, k_off) -> State:
    """Online softmax of query rows ``[q0, q1)`` (``qg``: grouped, in the compute dtype) over the
    key tiles ``cols``, the program interpreted."""
    B, Hq, Hk, S, Dv = shape
    tq = q1 - q0
    dtype = qg.dtype
    m = torch.full((B, Hq, tq), -math.inf, dtype=dtype, device=qg.device)
    l = torch.zeros((B, Hq, tq), dtype=dtype, device=qg.device)
    acc = torch.zeros((B, Hq, tq, Dv), dtype=dtype, device=qg.device)
    for _, k0, k1, leaves_t, positions in _key_tiles(prog, leaves, q0, q1, S, tile, cols, qg.device, q_off, k_off):
        tk = k1 - k0
        kb = k[:, :, k0:k1].to(dtype)
        s = (qg @ kb.transpose(-1, -2)).view(B, Hq, tq, tk)  # [B, Hq, tq, tk]
        z = prog.evaluate(s, leaves_t, positions).to(dtype).expand(B, Hq, tq, tk)
        m_new = torch.maximum(m, z.amax(-1))
        m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
        p = torch.exp(z - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        l = l * alpha + p.sum(-1)
        pv = (p.reshape(B, Hk, -1, tk) @ v[:, :, k0:k1].to(dtype)).view(B, Hq, tq, Dv)
        acc = acc * alpha[..., None] + pv
        m = m_new
    return m, l, acc


def _fused_forward(prog, q_blk, k, v, leaves, q0, q1, tile, cols, no_bias, dtype, q_off, k_off) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows ``[q0, q1)`` over the key tiles ``cols``, each tile in the fused kernel with its
    bias as the mask (none for the tiles in ``no_bias``), merged by their log-sum-exps:
    ``(lse, out)``. A row with no unmasked key in a tile gets ``-inf`` there (the kernel reports 0)."""
    B, Hq, tq, _ = q_blk.shape
    out = torch.zeros((B, Hq, tq, v.shape[-1]), dtype=dtype, device=q_blk.device)
    lse = torch.full((B, Hq, tq), -math.inf, dtype=dtype, device=q_blk.device)
    scale = prog.additive[0]
    for j, k0, k1, leaves_t, positions in _key_tiles(prog, leaves, q0, q1, k.shape[2], tile, cols, q_blk.device, q_off, k_off):
        bias = None if j in no_bias else prog.bias(leaves_t, positions, q_blk.dtype)
        o, l = _FLASH(q_blk, k[:, :, k0:k1], v[:, :, k0:k1], attn_mask=bias, scale=scale)
        l = l.to(dtype)
        if bias is not None:
            l = torch.where((bias > MASKED).any(-1), l, -math.inf)
        new = torch.logaddexp(lse, l)
        safe = new.masked_fill(new == -math.inf, 0.0)
        out = out * torch.exp(lse - safe)[..., None] + o.to(dtype) * torch.exp(l - safe)[..., None]
        lse = new
    return lse, out


def forward_rows(
    prog: ScoreProgram, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list, q0: int, q1: int, tile: int,
    row: list[int], q_off: int = 0, k_off: int = 0, alive: Optional[torch.Tensor] = None,
) -> Optional[State]:
    """The state of query rows ``[q0, q1)`` of ``q`` over the keys ``k``, ``v`` (every column of
    them), computing the tiles ``row`` marks live (fused where the program allows) - or every tile
    when a row is left with no key (and was not ``alive`` before, ``[B, Hq, q1-q0]`` bool).
    ``None`` when no tile is live and every row is ``alive``: these keys change nothing."""
    B, Hq = q.shape[:2]
    Hk, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    every = list(range(len(row)))
    cols = [j for j, x in enumerate(row) if x]
    if not cols and alive is not None and bool(alive.all()):
        TILE_COUNTS["skipped"] += len(row)
        return None

    def keyless(m: torch.Tensor) -> bool:
        dead = m <= MASKED
        return bool((dead if alive is None else dead & ~alive).any())

    dtype = acc_dtype(q)
    m = None
    if fused(prog, q, v):
        no_bias = {j for j, x in enumerate(row) if x == LIVE_NO_BIAS}
        m, acc = _fused_forward(prog, q[:, :, q0:q1], k, v, leaves, q0, q1, tile, cols, no_bias, dtype, q_off, k_off)
        l = torch.ones_like(m)
    if m is None or keyless(m):  # a row with no key left: every tile, as dense attention
        qg = grouped(q[:, :, q0:q1].to(dtype), Hk)
        cols = cols if m is None else every
        m, l, acc = _interpreted_forward(prog, qg, k, v, leaves, q0, q1, tile, cols, (B, Hq, Hk, S, Dv), q_off, k_off)
        if len(cols) < len(every) and keyless(m):
            cols = every
            m, l, acc = _interpreted_forward(prog, qg, k, v, leaves, q0, q1, tile, cols, (B, Hq, Hk, S, Dv), q_off, k_off)
    TILE_COUNTS["computed"] += len(cols)
    TILE_COUNTS["skipped"] += len(row) - len(cols)
    return m, l, acc


def merge(a: Optional[State], b: Optional[State]) -> Optional[State]:
    """The state of the same rows over the keys of ``a`` and of ``b`` together (exact: each
    rescaled to the larger max)."""
    if a is None or b is None:
        return b if a is None else a
    (m1, l1, o1), (m2, l2, o2) = a, b
    m = torch.maximum(m1, m2)
    safe = m.masked_fill(m == -math.inf, 0.0)
    a1, a2 = torch.exp(m1 - safe), torch.exp(m2 - safe)
    return m, l1 * a1 + l2 * a2, o1 * a1[..., None] + o2 * a2[..., None]


def finish_rows(state: State) -> State:
    """``(out, m, l)`` of a final state: the output normalised; rows whose every logit is ``-inf``
    (a bool mask) get output 0 and ``m = inf``, so that backward reads ``p = 0`` (SDPA's rule)."""
    m, l, acc = state
    dead = m == -math.inf
    res = acc / l[..., None]
    if bool(dead.any()):
        res = res.masked_fill(dead[..., None], 0.0)
        m = m.masked_fill(dead, math.inf)
        l = l.masked_fill(dead, 1.0)
    return res, m, l


def _fused_backward(prog, grad_blk, q_blk, out_blk, lse, k, v, leaves, q0, q1, tile, cols, no_bias, dk, dv, q_off, k_off):
    """The gradients of query rows ``[q0, q1)`` (returned) and their key tiles ``cols`` (added to
    ``dk``, ``dv``): each tile's backward in the fused kernel, with the rows' global output and
    log-sum-exp."""
    scale = prog.additive[0]
    dq = torch.zeros(q_blk.shape, dtype=dk.dtype, device=q_blk.device)
    for j, k0, k1, leaves_t, positions in _key_tiles(prog, leaves, q0, q1, k.shape[2], tile, cols, q_blk.device, q_off, k_off):
        bias = None if j in no_bias else prog.bias(leaves_t, positions, q_blk.dtype)
        gq, gk, gv = _FLASH_BACKWARD(grad_blk, q_blk, k[:, :, k0:k1], v[:, :, k0:k1], out_blk, lse, 0.0, False, attn_mask=bias, scale=scale)
        dq += gq
        dk[:, :, k0:k1] += gk
        dv[:, :, k0:k1] += gv
    return dq


def backward_rows(
    prog: ScoreProgram, grad_out: torch.Tensor, q: torch.Tensor, out: torch.Tensor, m: torch.Tensor, l: torch.Tensor,
    delta: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list, q0: int, q1: int, tile: int, row: list[int],
    dk: torch.Tensor, dv: torch.Tensor, q_off: int = 0, k_off: int = 0,
) -> Optional[torch.Tensor]:
    """The gradient of query rows ``[q0, q1)`` (returned, ``[B, Hq, q1-q0, D]`` in the compute
    dtype; ``None``: no tile to compute) from the keys ``k``, ``v``, whose gradients are added to
    ``dk``, ``dv`` (compute dtype). ``out``, ``m``, ``l`` (and ``delta = rowsum(grad_out * out)``)
    are the rows' final values over every key. The tiles the forward computed are recomputed: the
    live ones, or every tile for a block where a row's softmax ran over fill values."""
    B, Hq, _, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    dtype = dk.dtype
    tq = q1 - q0
    mb, inv_l, deltab = m[:, :, q0:q1, None], 1.0 / l[:, :, q0:q1, None], delta[:, :, q0:q1, None]
    if bool(((mb <= MASKED) & (mb > -math.inf)).any()):  # its softmax over the fill values read every tile
        cols = list(range(len(row)))
    else:  # (rows whose every logit is -inf have no gradient: p = 0 wherever they are read)
        cols = [j for j, x in enumerate(row) if x]
        if not cols:
            return None
        if fused(prog, q, v):
            lse = (m[:, :, q0:q1] + torch.log(l[:, :, q0:q1])).to(m.dtype)
            no_bias = {j for j, x in enumerate(row) if x == LIVE_NO_BIAS}
            return _fused_backward(
                prog, grad_out[:, :, q0:q1].to(q.dtype), q[:, :, q0:q1], out[:, :, q0:q1].to(q.dtype), lse, k, v, leaves,
                q0, q1, tile, cols, no_bias, dk, dv, q_off, k_off,
            )
    qg = grouped(q[:, :, q0:q1].to(dtype), Hk)  # [B, Hk, r*tq, D]
    dog = grouped(grad_out[:, :, q0:q1].to(dtype), Hk)  # [B, Hk, r*tq, Dv]
    dqg = torch.zeros_like(qg)
    for _, k0, k1, leaves_t, positions in _key_tiles(prog, leaves, q0, q1, S, tile, cols, q.device, q_off, k_off):
        tk = k1 - k0
        kb, vb = k[:, :, k0:k1].to(dtype), v[:, :, k0:k1].to(dtype)
        s = (qg @ kb.transpose(-1, -2)).view(B, Hq, tq, tk)
        z, dz_ds = prog.evaluate(s, leaves_t, positions, tangent=True)
        p = torch.exp(z.to(dtype) - mb) * inv_l  # [B, Hq, tq, tk]
        pg = p.reshape(B, Hk, -1, tk)
        dv[:, :, k0:k1] += pg.transpose(-1, -2) @ dog
        dp = (dog @ vb.transpose(-1, -2)).view(B, Hq, tq, tk)
        ds = (p * (dp - deltab) * dz_ds).reshape(B, Hk, -1, tk)  # dL/ds = dL/dz * dz/ds
        dqg += ds @ kb
        dk[:, :, k0:k1] += ds.transpose(-1, -2) @ qg
    return dqg.view(B, Hq, tq, D)


def causal_forward(prog: ScoreProgram, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> State:
    """The final state of every row of a mask that is exactly causal (see
    :func:`~autosp.ops.live_tiles.exactly_causal`): PyTorch's fused attention kernel over the
    whole sequence with ``is_causal`` (no tiles, no mask), ``(m, l, acc)`` = ``(lse, 1, out)``
    (``out`` normalised already, in the inputs' dtype and the kernel's layout)."""
    out, lse = _FLASH(q, k, v, 0.0, True, scale=prog.additive[0])
    TILE_COUNTS["causal"] += 1
    lse = lse.to(acc_dtype(q))
    return lse, torch.ones_like(lse), out


def causal_backward(
    prog: ScoreProgram, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    m: torch.Tensor, l: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`causal_forward`: the fused kernel's backward, ``is_causal``."""
    lse = (m + torch.log(l)).to(torch.float32 if q.dtype != torch.float64 else q.dtype)
    return _FLASH_BACKWARD(grad_out.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, True, scale=prog.additive[0])
