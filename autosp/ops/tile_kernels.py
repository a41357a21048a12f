"""The tile kernels: attention of a block of query rows over a block of keys, one tile at a time.

Every function here works on one block of query rows ``[q0, q1)`` of ``q`` against the keys and
values ``k``, ``v`` it is given, over the key tiles a row of a live-tile map (:mod:`.live_tiles`,
a host tensor: no decision here reads the device) marks. The rows and columns are spans of the
sequence: ``q_off`` and ``k_off`` are the positions of ``q``'s row 0 and ``k``'s column 0, so the
same kernels serve the whole sequence (:mod:`.tiled_attention`) and one part of it against another
(a ring step, :mod:`.ring_attention`). A block's result is an online-softmax *state* ``(m, l, acc)``:
per query row the running max logit (or log-sum-exp) and softmax denominator (fp32) and the
unnormalised output. States of the same rows over different keys :func:`merge` exactly.

Two ways to compute: *fused* (an additive program, ``s * scale + bias``: the kernel table's
kernel for the device, :mod:`.kernels` - consecutive tiles with no bias in one call, each tile with
a bias in one call with the tile's bias) and *interpreted* (the score program evaluated in PyTorch,
any program, with its derivative ``dz/ds`` in backward: the table's listed fallback).

Rows with no unmasked key follow dense attention: with ``-inf`` (or a bool mask) output 0 and no
gradient; with a finite fill such as ``finfo.min`` a softmax over the fill values, which reads
every key - the map marks every tile of a block holding such a row :data:`~.live_tiles.FILL`
(computed, its fill values counted), so the tiles it skips never matter.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from autosp.ops import kernels
from autosp.ops.live_tiles import FILL, LIVE_NO_BIAS
from autosp.ops.score_program import ScoreProgram, tile_positions

__all__ = [
    "forward_rows", "backward_rows", "finish_rows", "merge", "fused_kernels", "tiles", "heads_inside", "acc_dtype", "causal_forward",
    "causal_backward", "TILE_COUNTS",
]

#: tiles the forward computed and skipped in this process so far, and the attention calls it ran as
#: plain causal attention instead (no tiles; read by the tests and benchmarks)
TILE_COUNTS = {"computed": 0, "skipped": 0, "causal": 0}

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


def fused_kernels(prog: ScoreProgram, q: torch.Tensor, v: torch.Tensor) -> Optional[tuple[str, str]]:
    """``(kernel for tiles without a bias, kernel for tiles with one)`` from the kernel table when the
    program's tiles run fused (an additive program whose inputs both kernels take), else ``None``:
    the interpreted tiles (the table's fallback; on CUDA a warning names the case once)."""
    if prog.additive is None:
        kernels.choose("score", q, v)
        return None
    block, bias = kernels.choose("block", q, v), kernels.choose("bias", q, v)
    return None if "tiles" in (block, bias) else (block, bias)


def _fused_for_row(prog: ScoreProgram, q: torch.Tensor, v: torch.Tensor, row: list[int]) -> Optional[tuple[str, str]]:
    """:func:`fused_kernels` for a block of rows, but ``None`` (interpreted) where the map marks
    tiles :data:`~.live_tiles.FILL`: a row with no key under a finite fill reads the fill values of
    every key, and a log-sum-exp near ``-3.4e38`` cannot carry the ``log(n)`` of their count (below
    its precision): the interpreted tiles keep the max and the sum apart."""
    if FILL in row:
        kernels.choose("keyless", q, v)
        return None
    return fused_kernels(prog, q, v)


def _runs(row: list[int], tile: int, kv_len: int) -> list[tuple[bool, int, int, int]]:
    """The computed columns of a map row as calls: ``(with_bias, j, k0, k1)`` - consecutive tiles
    with no bias merged into one call, every other computed tile a call of its own."""
    out: list[tuple[bool, int, int, int]] = []
    for j, x in enumerate(row):
        if not x:
            continue
        k0, k1 = j * tile, min((j + 1) * tile, kv_len)
        if x == LIVE_NO_BIAS and out and not out[-1][0] and out[-1][3] == k0:
            out[-1] = (False, out[-1][1], out[-1][2], k1)
        else:
            out.append((x != LIVE_NO_BIAS, j, k0, k1))
    return out


def _bias(prog: ScoreProgram, leaves: list, a0: int, a1: int, b0: int, b1: int, dtype: torch.dtype, device) -> Optional[torch.Tensor]:
    """The additive bias of query rows ``[a0, a1)`` over keys ``[b0, b1)`` (absolute positions)."""
    return prog.bias(prog.leaf_tiles(leaves, a0, a1, b0, b1), tile_positions(prog, a0, a1, b0, b1, device), dtype)


def _interpreted_forward(prog, qg, k, v, leaves, q0, q1, tile, cols, shape, q_off, k_off) -> State:
    """Online softmax of query rows ``[q0, q1)`` (``qg``: grouped, in the compute dtype) over the
    key tiles ``cols``, the program interpreted."""
    B, Hq, Hk, S, Dv = shape
    tq = q1 - q0
    dtype = qg.dtype
    m = torch.full((B, Hq, tq), -math.inf, dtype=dtype, device=qg.device)
    l = torch.zeros((B, Hq, tq), dtype=dtype, device=qg.device)
    acc = torch.zeros((B, Hq, tq, Dv), dtype=dtype, device=qg.device)
    for j in cols:
        k0, k1 = j * tile, min((j + 1) * tile, S)
        a0, a1, b0, b1 = q_off + q0, q_off + q1, k_off + k0, k_off + k1
        tk = k1 - k0
        kb = k[:, :, k0:k1].to(dtype)
        s = (qg @ kb.transpose(-1, -2)).view(B, Hq, tq, tk)  # [B, Hq, tq, tk]
        leaves_t, positions = prog.leaf_tiles(leaves, a0, a1, b0, b1), tile_positions(prog, a0, a1, b0, b1, qg.device)
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


def _fused_forward(prog, pair, q_blk, k, v, leaves, q0, q1, tile, row, dtype, q_off, k_off) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows ``[q0, q1)`` over the computed tiles of ``row`` in the table's kernels (``pair``:
    for tiles without and with a bias), merged by their log-sum-exps: ``(lse, out)``."""
    B, Hq, tq, _ = q_blk.shape
    out = torch.zeros((B, Hq, tq, v.shape[-1]), dtype=dtype, device=q_blk.device)
    lse = torch.full((B, Hq, tq), -math.inf, dtype=dtype, device=q_blk.device)
    scale = prog.additive[0]
    for with_bias, _, k0, k1 in _runs(row, tile, k.shape[2]):
        a0, b0 = q_off + q0, k_off + k0
        bias = _bias(prog, leaves, a0, q_off + q1, b0, k_off + k1, q_blk.dtype, q_blk.device) if with_bias else None
        case = "bias" if bias is not None else "block"
        o, l = kernels.forward(case, pair[case == "bias"], q_blk, k[:, :, k0:k1], v[:, :, k0:k1], bias, scale)
        new = torch.logaddexp(lse, l.to(dtype))
        safe = new.masked_fill(new == -math.inf, 0.0)
        out = out * torch.exp(lse - safe)[..., None] + o.to(dtype) * torch.exp(l.to(dtype) - safe)[..., None]
        lse = new
    return lse, out


def forward_rows(
    prog: ScoreProgram, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list, q0: int, q1: int, tile: int,
    row: list[int], q_off: int = 0, k_off: int = 0,
) -> Optional[State]:
    """The state of query rows ``[q0, q1)`` of ``q`` over the keys ``k``, ``v`` (every column of
    them), computing the tiles ``row`` marks (a map row, host ints; fused where the table allows).
    ``None`` when ``row`` marks no tile: these keys change nothing for these rows."""
    B, Hq = q.shape[:2]
    Hk, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    cols = [j for j, x in enumerate(row) if x]
    TILE_COUNTS["computed"] += len(cols)
    TILE_COUNTS["skipped"] += len(row) - len(cols)
    if not cols:
        return None
    dtype = acc_dtype(q)
    pair = _fused_for_row(prog, q, v, row)
    if pair is not None:
        m, acc = _fused_forward(prog, pair, q[:, :, q0:q1], k, v, leaves, q0, q1, tile, row, dtype, q_off, k_off)
        return m, torch.ones_like(m), acc
    kernels.count("score" if prog.additive is None else "keyless" if FILL in row else "bias", "tiles")
    qg = grouped(q[:, :, q0:q1].to(dtype), Hk)
    return _interpreted_forward(prog, qg, k, v, leaves, q0, q1, tile, cols, (B, Hq, Hk, S, Dv), q_off, k_off)


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
    (a bool mask) get output 0 and ``m = inf``, so that backward reads ``p = 0`` (SDPA's rule).
    No branch on the data: nothing here reads the device."""
    m, l, acc = state
    dead = m == -math.inf
    res = (acc / l.masked_fill(dead, 1.0)[..., None]).masked_fill(dead[..., None], 0.0)
    return res, m.masked_fill(dead, math.inf), l.masked_fill(dead, 1.0)


def _fused_backward(prog, pair, grad_blk, q_blk, out_blk, lse, k, v, leaves, q0, q1, tile, row, dk, dv, q_off, k_off):
    """The gradients of query rows ``[q0, q1)`` (returned) and their computed key tiles (added to
    ``dk``, ``dv``): each call's backward in the table's kernel, with the rows' final output and
    log-sum-exp."""
    scale = prog.additive[0]
    dq = torch.zeros(q_blk.shape, dtype=dk.dtype, device=q_blk.device)
    for with_bias, _, k0, k1 in _runs(row, tile, k.shape[2]):
        a0, b0 = q_off + q0, k_off + k0
        bias = _bias(prog, leaves, a0, q_off + q1, b0, k_off + k1, q_blk.dtype, q_blk.device) if with_bias else None
        case = "bias" if bias is not None else "block"
        gq, gk, gv = kernels.backward(case, pair[case == "bias"], grad_blk, q_blk, k[:, :, k0:k1], v[:, :, k0:k1], bias, out_blk, lse, scale)
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
    are the rows' final values over every key. The tiles the forward computed (``row``) are
    recomputed."""
    B, Hq, _, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    dtype = dk.dtype
    tq = q1 - q0
    cols = [j for j, x in enumerate(row) if x]
    if not cols:
        return None
    pair = _fused_for_row(prog, q, v, row)
    if pair is not None:
        lse = (m[:, :, q0:q1] + torch.log(l[:, :, q0:q1])).to(torch.float32 if q.dtype != torch.float64 else q.dtype)
        return _fused_backward(
            prog, pair, grad_out[:, :, q0:q1].to(q.dtype), q[:, :, q0:q1], out[:, :, q0:q1].to(q.dtype), lse, k, v, leaves,
            q0, q1, tile, row, dk, dv, q_off, k_off,
        )
    mb, inv_l, deltab = m[:, :, q0:q1, None], 1.0 / l[:, :, q0:q1, None], delta[:, :, q0:q1, None]
    qg = grouped(q[:, :, q0:q1].to(dtype), Hk)  # [B, Hk, r*tq, D]
    dog = grouped(grad_out[:, :, q0:q1].to(dtype), Hk)  # [B, Hk, r*tq, Dv]
    dqg = torch.zeros_like(qg)
    for j in cols:
        k0, k1 = j * tile, min((j + 1) * tile, S)
        a0, a1, b0, b1 = q_off + q0, q_off + q1, k_off + k0, k_off + k1
        tk = k1 - k0
        kb, vb = k[:, :, k0:k1].to(dtype), v[:, :, k0:k1].to(dtype)
        s = (qg @ kb.transpose(-1, -2)).view(B, Hq, tq, tk)
        leaves_t, positions = prog.leaf_tiles(leaves, a0, a1, b0, b1), tile_positions(prog, a0, a1, b0, b1, q.device)
        z, dz_ds = prog.evaluate(s, leaves_t, positions, tangent=True)
        p = torch.exp(z.to(dtype) - mb) * inv_l  # [B, Hq, tq, tk]
        pg = p.reshape(B, Hk, -1, tk)
        dv[:, :, k0:k1] += pg.transpose(-1, -2) @ dog
        dp = (dog @ vb.transpose(-1, -2)).view(B, Hq, tq, tk)
        ds = (p * (dp - deltab) * dz_ds).reshape(B, Hk, -1, tk)  # dL/ds = dL/dz * dz/ds
        dqg += ds @ kb
        dk[:, :, k0:k1] += ds.transpose(-1, -2) @ qg
    return dqg.view(B, Hq, tq, D)


def causal_forward(prog: ScoreProgram, kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> State:
    """The final state of every row of a mask that is exactly causal (see
    :func:`~autosp.ops.live_tiles.exactly_causal`): the table's ``causal`` kernel over the whole
    sequence with ``is_causal`` (no tiles, no mask), ``(m, l, acc)`` = ``(lse, 1, out)`` (``out``
    normalised already, in the inputs' dtype and the kernel's layout)."""
    out, lse = kernels.forward("causal", kernel, q, k, v, None, prog.additive[0])
    TILE_COUNTS["causal"] += 1
    lse = lse.to(acc_dtype(q))
    return lse, torch.ones_like(lse), out


def causal_backward(
    prog: ScoreProgram, kernel: str, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, m: torch.Tensor, l: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`causal_forward`: the kernel's backward, ``is_causal``."""
    lse = (m + torch.log(l)).to(torch.float32 if q.dtype != torch.float64 else q.dtype)
    return kernels.backward("causal", kernel, grad_out.to(q.dtype), q, k, v, None, out.to(q.dtype), lse, prog.additive[0])
