"""Ring attention: the second level of sequence parallelism, under Ulysses.

An SP group of ``ulysses * ring`` ranks (:class:`~autosp.layout.AttentionLayout`) splits
attention twice: Ulysses' exchange (:func:`~autosp.ops.collectives.ring_seq_gather`) leaves each
rank its ``H / ulysses`` heads for the positions of its *ring segment* - two chunks of the
sequence, head and tail (:func:`~autosp.layout.ring_segment`) - and :func:`ring_attention`
computes attention for those queries over every key in ``ring`` steps: at step ``t`` a rank holds
the key/value block of ring rank ``r - t`` (its own at step 0), computes its queries against it
with the tile kernels (:mod:`.tile_kernels`: the score program evaluated on the positions of the
queries and keys in hand, fully masked tiles and blocks skipped), and passes the block on to ring
rank ``r + 1`` while it computes. Each block runs in the kernel the kernel table names for the
device (:mod:`.kernels`, through the tile kernels), and which of its tiles to compute comes from
maps made once per mask and step (:func:`ring_live_tiles`, on the host: no step reads the device).
The blocks' partial softmaxes merge exactly by log-sum-exp in fp32
(:func:`~autosp.ops.tile_kernels.merge`), which never overflows: every rescaling is
``exp(m_old - m_new) <= 1``.

The backward (:func:`ring_attention_backward`) passes the key/value blocks around again, with
their gradient accumulators: at step ``t`` a rank adds what its queries contribute to block
``r - t``'s ``dK``/``dV`` - recomputing each tile from the block in hand, never step 0's, with the
rows' merged output and log-sum-exp, as the fused kernels' backward ops take them - and
hands block and accumulators on; after ``ring`` steps each accumulator is back with the rank
that owns its block, complete. Per rank and attention call: ``ring - 1`` blocks of K and V sent
in forward, ``ring - 1`` blocks of K and V and ``ring`` of their fp32 gradients in backward.

The ring is a ring of point-to-point sends and receives between the ranks of the same Ulysses
rank in the SP group (strided SP ranks), not an all-gather of K/V: the bytes sent are the same
(every rank receives every other block once), but a rank holds two blocks at a time (the one in
hand and the one arriving) instead of all ``ring`` of them.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from autosp.layout import ring_segment, ring_segment_length
from autosp.ops.collectives import SENT_BYTES
from autosp.ops.kernels import to_host
from autosp.ops.live_tiles import keyless_rows, live_map, mark_fill
from autosp.ops.score_program import ScoreProgram
from autosp.ops.tile_kernels import acc_dtype, backward_rows, finish_rows, forward_rows, heads_inside, merge, tiles

__all__ = [
    "ring_attention", "ring_attention_backward", "ring_live_tiles", "ring_maps", "ring_forward", "ring_backward", "RingPeers",
    "ring_steps", "ring_workspace_bytes",
]


class RingPeers:
    """The ring of SP rank ``rank`` in the SP group ``group_name`` laid out as ``ulysses x ring``:
    its ring rank, and the global ranks it sends blocks to (``next``) and receives them from
    (``prev``) - the SP ranks of the same Ulysses rank, strided by ``ulysses``."""

    def __init__(self, group_name: str, rank: int, ring: int):
        self.group = _resolve_process_group(group_name)
        ulysses = dist.get_world_size(self.group) // ring
        self.ring, self.ring_rank = ring, rank // ulysses
        column = rank % ulysses
        self.next = dist.get_global_rank(self.group, ((self.ring_rank + 1) % ring) * ulysses + column)
        self.prev = dist.get_global_rank(self.group, ((self.ring_rank - 1) % ring) * ulysses + column)

    def shift(self, tensors: list[torch.Tensor], shapes: list[list[int]]) -> Callable[[], list[torch.Tensor]]:
        """Send ``tensors`` to the next rank and receive tensors of ``shapes`` from the previous
        one; returns the wait that yields them (the transfer runs meanwhile)."""
        recv = [torch.empty(shape, dtype=t.dtype, device=t.device) for t, shape in zip(tensors, shapes)]
        SENT_BYTES["ring"] += sum(t.numel() * t.element_size() for t in tensors)
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, buf, self.prev, self.group) for buf in recv]
        requests = dist.batch_isend_irecv(ops)

        def wait() -> list[torch.Tensor]:
            for request in requests:
                request.wait()
            return recv

        return wait


def _chunks(segment: list) -> list[tuple[int, int, int]]:
    """``(position, index, length)`` of each chunk of a ring segment: where it starts in the
    sequence and in the segment's tensors."""
    out, index = [], 0
    for a, b in segment:
        out.append((a, index, b - a))
        index += b - a
    return out


def ring_steps(seq_len: int, ring: int, ring_rank: int, zigzag: bool) -> list[tuple[int, list, list]]:
    """``(source ring rank, query chunks, key chunks)`` per step of ring rank ``ring_rank``: the
    block it holds at each step and the chunks (:func:`_chunks`) of its queries and of that block."""
    queries = _chunks(ring_segment(seq_len, ring, ring_rank, zigzag))
    return [
        (src, queries, _chunks(ring_segment(seq_len, ring, src, zigzag)))
        for src in ((ring_rank - t) % ring for t in range(ring))
    ]


def _block_shape(like: torch.Tensor, seq_len: int, ring: int, src: int, zigzag: bool) -> list[int]:
    B, H, _, D = like.shape
    return [B, H, ring_segment_length(seq_len, ring, src, zigzag), D]


def ring_workspace_bytes(kv_shape: tuple, dtype: torch.dtype, backward: bool) -> int:
    """Bytes :func:`ring_attention` (``backward``: its backward) holds beyond what the tile kernels
    allocate (:func:`~autosp.ops.tiled_attention.workspace_bytes`): the key/value block arriving
    while one is in hand, contiguous copies of the rank's own, and in backward the fp32 gradient
    accumulators of the block in hand and of the one arriving."""
    block = math.prod(kv_shape) * torch.empty((), dtype=dtype).element_size()
    if not backward:
        return 4 * block
    item = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    return 4 * block + 4 * math.prod(kv_shape) * item


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"ring_attention expects [B, H, S, D] q, k, v; got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2] or q.shape[2] != k.shape[2]:
        raise ValueError(f"ring_attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not group")


def _pairs(steps: list) -> list[tuple[int, int, int, int, int, int, int]]:
    """``(t, qpos, qi, qn, kpos, ki, kn)`` per step ``t`` and pair of a query chunk and a key chunk
    of its block: the order of :func:`ring_maps`' maps."""
    return [(t, *qc, *kc) for t, (_, queries, keys) in enumerate(steps) for qc in queries for kc in keys]


def ring_maps(prog: ScoreProgram, leaves: list, tile: int, seq_len: int, steps: list) -> list[torch.Tensor]:
    """The live-tile map of each pair of :func:`_pairs` (``leaves`` on the host, over every
    position): its query chunk's rows over its key chunk's columns, with :data:`~.live_tiles.FILL`
    on the blocks of rows that may have no key anywhere in the sequence (so that every key of
    every step is read for them)."""
    keyless = keyless_rows(prog, leaves, tile, *live_map(prog, leaves, tile, seq_len, seq_len, full=True), seq_len)
    maps = []
    for _, qpos, _, qn, kpos, _, kn in _pairs(steps):
        pair, _, finite = live_map(prog, leaves, tile, qn, kn, qpos, kpos, full=True)
        maps.append(mark_fill(pair, finite, keyless, qpos, qn, tile))
    return maps


def _map_shapes(steps: list, tile: int) -> list[tuple]:
    return [((qn + tile - 1) // tile, (kn + tile - 1) // tile) for _, _, _, qn, _, _, kn in _pairs(steps)]


def _unpack(maps: torch.Tensor, steps: list, tile: int) -> list[list[list[int]]]:
    """The maps of :func:`ring_live_tiles` (one host tensor) as lists, in :func:`_pairs`' order."""
    out, start = [], 0
    for nq, nk in _map_shapes(steps, tile):
        out.append(maps[start:start + nq * nk].view(nq, nk).tolist())
        start += nq * nk
    return out


def ring_forward(prog, q, k, v, leaves, tile, steps, next_block, maps):
    """The state of every query row over every step's block; ``next_block(t, k, v)`` starts the
    transfer of step ``t + 1``'s block and returns its wait (``None`` after the last step);
    ``maps``: per pair of :func:`_pairs`, its live-tile map as lists (host)."""
    B, Hq, L, _ = q.shape
    dtype = acc_dtype(q)
    m = torch.full((B, Hq, L), -math.inf, dtype=dtype, device=q.device)
    l = torch.zeros((B, Hq, L), dtype=dtype, device=q.device)
    acc = torch.zeros((B, Hq, L, v.shape[-1]), dtype=dtype, device=q.device)
    kb, vb = k, v
    pairs = iter(zip(_pairs(steps), maps))
    for t in range(len(steps)):
        arriving = next_block(t, kb, vb)
        for (_, qpos, qi, qn, kpos, ki, kn), rows_live in (next(pairs) for _ in range(len(steps[t][1]) * len(steps[t][2]))):
            if not any(any(r) for r in rows_live):
                continue  # a block the mask covers whole, for rows that have a key elsewhere
            qc, kc, vc = q[:, :, qi:qi + qn], kb[:, :, ki:ki + kn], vb[:, :, ki:ki + kn]
            for i, (q0, q1) in enumerate(tiles(qn, tile)):
                r0, r1 = qi + q0, qi + q1
                block = forward_rows(prog, qc, kc, vc, leaves, q0, q1, tile, rows_live[i], qpos, kpos)
                if block is not None:
                    state = (m[:, :, r0:r1], l[:, :, r0:r1], acc[:, :, r0:r1])
                    m[:, :, r0:r1], l[:, :, r0:r1], acc[:, :, r0:r1] = merge(state, block)
        if arriving is not None:
            kb, vb = arriving()
    return finish_rows((m, l, acc))


def ring_backward(prog, grad_out, q, out, m, l, k, v, leaves, tile, steps, pass_on, maps):
    """``dq`` of every query row and each step's block's ``dk``, ``dv`` added to its accumulators;
    ``pass_on(t, kb, vb, dk, dv)`` hands block and accumulators to the next rank and returns the
    next step's (after the last step: this rank's own, complete); ``maps`` as for :func:`ring_forward`."""
    dtype = acc_dtype(q)
    delta = (grad_out.to(dtype) * out.to(dtype)).sum(-1)  # [B, Hq, L]
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    kb, vb = k, v
    dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
    pairs = iter(zip(_pairs(steps), maps))
    for t in range(len(steps)):
        for (_, qpos, qi, qn, kpos, ki, kn), rows_live in (next(pairs) for _ in range(len(steps[t][1]) * len(steps[t][2]))):
            if not any(any(r) for r in rows_live):
                continue
            args = (grad_out[:, :, qi:qi + qn], q[:, :, qi:qi + qn], out[:, :, qi:qi + qn], m[:, :, qi:qi + qn], l[:, :, qi:qi + qn])
            dkc, dvc = dk[:, :, ki:ki + kn], dv[:, :, ki:ki + kn]
            for i, (q0, q1) in enumerate(tiles(qn, tile)):
                dq_blk = backward_rows(
                    prog, *args, delta[:, :, qi:qi + qn], kb[:, :, ki:ki + kn], vb[:, :, ki:ki + kn], leaves, q0, q1, tile,
                    rows_live[i], dkc, dvc, qpos, kpos,
                )
                if dq_blk is not None:
                    dq[:, :, qi + q0:qi + q1] += dq_blk
        kb, vb, dk, dv = pass_on(t, kb, vb, dk, dv)
    return dq, dk, dv


def _ring_args(seq_len: int, group_name: str, rank: int, ring: int, zigzag: bool) -> tuple[RingPeers, list]:
    peers = RingPeers(group_name, rank, ring)
    return peers, ring_steps(seq_len, ring, peers.ring_rank, zigzag)


@torch.library.custom_op("autosp_attn::ring_live_tiles", mutates_args=())
def ring_live_tiles(leaves: list[torch.Tensor], program: str, tile: int, seq_len: int, ring: int, ring_rank: int, zigzag: bool) -> torch.Tensor:
    """The live-tile maps of every step of ring rank ``ring_rank`` (:func:`ring_maps`), packed in
    one ``int8`` tensor **on the host**: the leaves are copied there once
    (:func:`~autosp.ops.kernels.to_host`, the one read of the device this mask costs per step),
    for every ring attention that reads the same mask, forward and backward."""
    prog = ScoreProgram.parse(program)
    steps = ring_steps(seq_len, ring, ring_rank, zigzag)
    maps = ring_maps(prog, to_host(leaves), tile, seq_len, steps)
    return torch.cat([x.flatten() for x in maps]) if maps else torch.zeros(0, dtype=torch.int8)


@ring_live_tiles.register_fake
def _(leaves, program, tile, seq_len, ring, ring_rank, zigzag):
    n = sum(nq * nk for nq, nk in _map_shapes(ring_steps(seq_len, ring, ring_rank, zigzag), tile))
    return torch.empty((n,), dtype=torch.int8, device="cpu")


@torch.library.custom_op("autosp_attn::ring_attention", mutates_args=())
def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list[torch.Tensor], maps: torch.Tensor, program: str, tile: int,
    seq_len: int, group_name: str, rank: int, ring: int, zigzag: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, m, l)`` of this rank's queries over every key of the sequence (see the module
    docstring): q ``[B, Hq, L, D]``, k, v ``[B, Hk, L, D]`` hold the positions of this rank's ring
    segment (``seq_len`` positions in all; SP rank ``rank`` of the group ``group_name``, ``ring``
    ring ranks, ``zigzag``: head-tail segments), ``Hq`` a multiple of ``Hk``; ``program`` and
    ``leaves`` as for :func:`~autosp.ops.tiled_attention.tiled_attention` (leaves over every
    position), ``maps`` from :func:`ring_live_tiles`; ``m``, ``l`` ``[B, Hq, L]`` each row's max
    logit and softmax denominator."""
    _check(q, k, v)
    prog = ScoreProgram.parse(program)
    peers, steps = _ring_args(seq_len, group_name, rank, ring, zigzag)

    def next_block(t: int, kb: torch.Tensor, vb: torch.Tensor):
        if t == ring - 1:
            return None
        shape = _block_shape(k, seq_len, ring, steps[t + 1][0], zigzag)
        wait = peers.shift([kb, vb], [shape, shape])
        return lambda: tuple(wait())

    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        res, m, l = ring_forward(prog, q, k.contiguous(), v.contiguous(), leaves, tile, steps, next_block, _unpack(maps, steps, tile))
    B, Hq, L, _ = q.shape
    out = heads_inside(q, (B, Hq, L, v.shape[-1]), prog.out_dtype)
    out.copy_(res)
    return out, m, l


@ring_attention.register_fake
def _(q, k, v, leaves, maps, program, tile, seq_len, group_name, rank, ring, zigzag):
    prog = ScoreProgram.parse(program)
    B, Hq, L, _ = q.shape
    dtype = acc_dtype(q)
    return heads_inside(q, (B, Hq, L, v.shape[-1]), prog.out_dtype), q.new_empty((B, Hq, L), dtype=dtype), q.new_empty((B, Hq, L), dtype=dtype)


@torch.library.custom_op("autosp_attn::ring_attention_backward", mutates_args=())
def ring_attention_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, m: torch.Tensor,
    l: torch.Tensor, leaves: list[torch.Tensor], maps: torch.Tensor, program: str, tile: int, seq_len: int, group_name: str,
    rank: int, ring: int, zigzag: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`ring_attention` (see the module docstring)."""
    prog = ScoreProgram.parse(program)
    peers, steps = _ring_args(seq_len, group_name, rank, ring, zigzag)

    def pass_on(t, kb, vb, dk, dv):
        nxt = steps[(t + 1) % ring][0]  # after the last step: this rank's own block comes back
        kv_shape, grad_shape = _block_shape(k, seq_len, ring, nxt, zigzag), _block_shape(k, seq_len, ring, nxt, zigzag)
        if t == ring - 1:
            dk, dv = peers.shift([dk, dv], [grad_shape, grad_shape])()
            return None, None, dk, dv
        kb, vb, dk, dv = peers.shift([kb, vb, dk, dv], [kv_shape, kv_shape, grad_shape, grad_shape])()
        return kb, vb, dk, dv

    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        dq, dk, dv = ring_backward(
            prog, grad_out, q, out, m, l, k.contiguous(), v.contiguous(), leaves, tile, steps, pass_on, _unpack(maps, steps, tile)
        )
    return tuple(torch.empty_like(x).copy_(g) for x, g in ((q, dq), (k, dk), (v, dv)))  # the inputs' layouts, as the fake says


@ring_attention_backward.register_fake
def _(grad_out, q, k, v, out, m, l, leaves, maps, program, tile, seq_len, group_name, rank, ring, zigzag):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, leaves, maps, program, tile, seq_len, group_name, rank, ring, zigzag = inputs
    out, m, l = output
    ctx.args = (program, tile, seq_len, group_name, rank, ring, zigzag)
    ctx.n_leaves = len(leaves)
    ctx.save_for_backward(q, k, v, out, m, l, maps, *leaves)


def _autograd_backward(ctx, grad_out, _grad_m, _grad_l):
    q, k, v, out, m, l, maps, *leaves = ctx.saved_tensors
    dq, dk, dv = ring_attention_backward(grad_out.contiguous(), q, k, v, out, m, l, leaves, maps, *ctx.args)
    return dq, dk, dv, [None] * ctx.n_leaves, None, None, None, None, None, None, None, None


ring_attention.register_autograd(_autograd_backward, setup_context=_setup_context)
