"""The ring level's kernel against dense attention (fp64, forward and backward), in one process:
every ring rank's steps run in turn with the blocks handed over directly, so the masks, the
head-tail split, the merges and the backward's travelling gradients are checked without process
groups (tests/test_ring.py runs the same with real sends and receives)."""

import math

import pytest
import torch
import torch.nn.functional as F
from test_tiled_attention import B, causal_docs_padding, dense, grads, ins, positions, program, qkv

from autosp.layout import ring_segment
from autosp.ops.ring_attention import ring_backward, ring_forward, ring_maps, ring_steps
from autosp.ops.score_program import ScoreProgram
from autosp.ops.tile_kernels import TILE_COUNTS

S = 37  # not divisible by 2 * ring for ring = 2, 3, 4


def _take(x, segment):
    return torch.cat([x[:, :, a:b] for a, b in segment], 2)


def _put(full, x, segment):
    i = 0
    for a, b in segment:
        full[:, :, a:b] = x[:, :, i : i + b - a]
        i += b - a


class EmulatedRing(torch.autograd.Function):
    """Attention over the whole sequence as ``ring`` ranks compute it: each rank's queries are its
    ring segment, its steps read the other ranks' blocks. ``stale_backward``: the backward reads
    the rank's own block at every step (the bug a ring must not have) - the negative control."""

    @staticmethod
    def forward(ctx, q, k, v, leaves, text, tile, ring, zigzag, stale_backward=False):
        prog = ScoreProgram.parse(text)
        seq = q.shape[2]
        segments = [ring_segment(seq, ring, r, zigzag) for r in range(ring)]
        out = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=q.dtype)
        ms, ls = [], []
        for r in range(ring):
            steps = ring_steps(seq, ring, r, zigzag)

            def next_block(t, kb, vb, steps=steps):
                if t == ring - 1:
                    return None
                src = steps[t + 1][0]
                return lambda: (_take(k, segments[src]), _take(v, segments[src]))

            maps = [x.tolist() for x in ring_maps(prog, leaves, tile, seq, steps)]
            res, m, l = ring_forward(prog, _take(q, segments[r]), _take(k, segments[r]), _take(v, segments[r]), leaves, tile, steps, next_block, maps)
            _put(out, res, segments[r])
            ms.append(m)
            ls.append(l)
        ctx.save_for_backward(q, k, v, out)
        ctx.args = (leaves, prog, tile, ring, zigzag, segments, ms, ls, stale_backward)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out = ctx.saved_tensors
        leaves, prog, tile, ring, zigzag, segments, ms, ls, stale = ctx.args
        seq = q.shape[2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for r in range(ring):
            steps = ring_steps(seq, ring, r, zigzag)

            def pass_on(t, kb, vb, gk, gv, steps=steps, r=r):
                src = steps[t][0]
                full_k, full_v = torch.zeros_like(k), torch.zeros_like(v)
                _put(full_k, gk, segments[src])
                _put(full_v, gv, segments[src])
                dk.add_(full_k)
                dv.add_(full_v)
                nxt = r if stale else steps[(t + 1) % ring][0]
                kb, vb = _take(k, segments[nxt]), _take(v, segments[nxt])
                return kb, vb, torch.zeros_like(kb), torch.zeros_like(vb)

            g, qs = _take(grad_out, segments[r]), _take(q, segments[r])
            o = _take(out, segments[r])
            maps = [x.tolist() for x in ring_maps(prog, leaves, tile, seq, steps)]
            gq, _, _ = ring_backward(prog, g, qs, o, ms[r], ls[r], _take(k, segments[r]), _take(v, segments[r]), leaves, tile, steps, pass_on, maps)
            _put(dq, gq, segments[r])
        return dq, dk, dv, None, None, None, None, None, None


def ring(q, k, v, leaves, text, tile, ring_size, zigzag=True, stale_backward=False):
    return EmulatedRing.apply(q, k, v, leaves, text, tile, ring_size, zigzag, stale_backward)


def check(out, ref, inputs, tol=1e-12):
    assert (out - ref).abs().max() < tol
    for a, b in zip(grads(out, inputs), grads(ref, inputs)):
        assert (a - b).abs().max() < tol


@pytest.mark.parametrize("ring_size,tile,zigzag", [
    (2, 5, True), pytest.param(3, 4, True, marks=pytest.mark.slow), pytest.param(4, 3, True, marks=pytest.mark.slow), (2, 8, False),
])
def test_ring_matches_sdpa_with_documents_and_padding(ring_size, tile, zigzag):
    """Causal over packed documents with key padding (bool: the fused path), GQA, 37 positions."""
    q, k, v = qkv(seq=S)
    text, leaves, keep = causal_docs_padding(S)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    check(ring(q, k, v, leaves, text, tile, ring_size, zigzag), ref, (q, k, v))
    # negative control: without the document term the ring computes another attention
    text_nodocs, _, _ = causal_docs_padding(S, with_docs=False)
    assert (ring(q, k, v, leaves, text_nodocs, tile, ring_size, zigzag) - ref).abs().max() > 1e-2


def test_a_backward_reading_step_zeros_block_is_caught():
    """The negative control of the backward: one that recomputes every step from the rank's own
    block (step 0's) - which a ring of equal blocks runs without an error - gives other gradients
    (40 positions: both ranks' blocks are 20 long)."""
    q, k, v = qkv(seq=40)
    text, leaves, keep = causal_docs_padding(40)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    check(ring(q, k, v, leaves, text, 8, 2), ref, (q, k, v))
    stale = grads(ring(q, k, v, leaves, text, 8, 2, stale_backward=True), (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    assert max(float((a - b).abs().max()) for a, b in zip(stale, grads(ref, (q, k, v)))) > 1e-3


def test_ring_rows_with_no_key_and_soft_capping():
    """Rows whose every key is masked, on several ranks: a finite fill (a softmax over the fill
    values, over every rank's keys) and -inf (0, no gradient); soft-capping with ALiBi per head
    (the interpreted path)."""
    q, k, v = qkv(seq=S)
    pos, _, _ = positions(S)
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[0, :12] = False  # left padding past the first chunk: rows 0..11 of row 0 see no key
    keep = (pos[None, :] <= pos[:, None]) & pad[:, None, None, :]
    leaves = [pos[:, None], pos[None, :], pad[:, None, None, :]]
    axes = [[-2, None], [None, -1], [None, -1]]
    fmin = torch.finfo(torch.float32).min
    mask_steps = [ins("operator", "le", {"l": 1}, {"l": 0}), ins("operator", "and_", {"r": 0}, {"l": 2})]
    finite = program(mask_steps + [ins("torch", "where", {"r": 1}, 0.0, fmin), ins("operator", "mul", {"s": 0}, 0.25, s=True),
                                   ins("operator", "add", {"r": 3}, {"r": 2}, s=True)], axes)
    check(ring(q, k, v, leaves, finite, 4, 3), dense(q, k, v, lambda s: s * 0.25 + torch.where(keep, 0.0, fmin)), (q, k, v))
    inf = program(mask_steps + [ins("operator", "mul", {"s": 0}, 0.25, s=True), ins("torch", "where", {"r": 1}, {"r": 2}, -math.inf, s=True)], axes)
    check(ring(q, k, v, leaves, inf, 4, 3), F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.25, enable_gqa=True), (q, k, v))
    heads = q.shape[1]
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(heads)], dtype=torch.float64)
    leaves = [pos[:, None], pos[None, :], slopes[:, None, None]]
    axes = [[-2, None], [None, -1], [None, None]]
    steps = [ins("operator", "sub", {"l": 0}, {"l": 1}), ins("torch", "abs", {"r": 0}), ins("operator", "mul", {"r": 1}, {"l": 2}),
             ins("operator", "neg", {"r": 2}), ins("operator", "ge", {"l": 0}, {"l": 1}), ins("torch", "where", {"r": 4}, 0.0, -math.inf),
             ins("operator", "add", {"r": 3}, {"r": 5}), ins("operator", "mul", {"s": 0}, 0.35 / 5.0, s=True),
             ins("torch", "tanh", {"r": 7}, s=True), ins("operator", "mul", {"r": 8}, 5.0, s=True), ins("operator", "add", {"r": 9}, {"r": 6}, s=True)]
    bias = -slopes[:, None, None] * (pos[:, None] - pos[None, :]).abs() + torch.where(pos[:, None] >= pos[None, :], 0.0, -math.inf)
    check(ring(q, k, v, leaves, program(steps, axes), 5, 2), dense(q, k, v, lambda s: torch.tanh(s * 0.35 / 5.0) * 5.0 + bias), (q, k, v))


@pytest.mark.slow
def test_head_tail_split_balances_causal_work():
    """Under a causal mask each ring rank computes the same number of tiles with the head-tail
    split (within one tile row); the contiguous split - the control - gives the last rank many
    times the first's."""
    seq, tile, ring_size = 512, 16, 4
    q, k, v = qkv(seq=seq)
    pos = torch.arange(seq)
    text = program([ins("operator", "le", {"l": 1}, {"l": 0}), ins("operator", "mul", {"s": 0}, 0.3, s=True),
                    ins("torch", "where", {"r": 0}, {"r": 1}, -math.inf, s=True)], [[-2, None], [None, -1]])
    prog = ScoreProgram.parse(text)
    for zigzag in (True, False):
        counts = []
        for r in range(ring_size):
            steps = ring_steps(seq, ring_size, r, zigzag)
            segments = [ring_segment(seq, ring_size, i, zigzag) for i in range(ring_size)]

            def next_block(t, kb, vb, steps=steps, segments=segments):
                src = steps[t + 1][0] if t < ring_size - 1 else None
                return None if src is None else (lambda: (_take(k, segments[src]), _take(v, segments[src])))

            before = TILE_COUNTS["computed"]
            with torch.no_grad():
                leaves = [pos[:, None], pos[None, :]]
                maps = [x.tolist() for x in ring_maps(prog, leaves, tile, seq, steps)]
                ring_forward(prog, _take(q, segments[r]), _take(k, segments[r]), _take(v, segments[r]), leaves, tile, steps, next_block, maps)
            counts.append(TILE_COUNTS["computed"] - before)
        row = seq // (2 * ring_size) // tile  # tiles in one row of a chunk
        if zigzag:
            assert max(counts) - min(counts) <= row, counts
        else:
            assert counts[-1] > 3 * counts[0], counts
