"""Ulysses with a ring level under it (USP): heads split over ``ulysses`` contiguous SP ranks,
positions over ``ring`` strided ones.

For an SP group laid out as ``ulysses x ring`` (:class:`~autosp.layout.AttentionLayout`), the
exchange (:func:`~autosp.ops.collectives.ring_seq_gather`, one all-to-all over the SP group)
turns a rank's positions with every head into its ``h / ulysses`` heads for the positions of its
ring segment - two chunks of the sequence, head and tail, so that a causal mask gives every ring
rank the same work (:func:`~autosp.layout.ring_segment`) - and
:func:`~autosp.ops.ring_attention.ring_attention` computes attention for those queries over
every key, passing key/value blocks around the ring. The model never sees the head-tail order:
it exists only between the exchanges, and the mask is evaluated on the positions of the blocks
in hand.

Every attention runs in the ring kernel, as a score program (:meth:`attend`): ``is_causal`` and
unmasked SDPA become the programs they are; a mask that is data rather than a function of
positions cannot be split over the ring and is refused with the layouts that would work.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from autosp.errors import AutoSPError
from autosp.layout import attention_layouts
from autosp.ops import ring_attention as _ring_ops  # noqa: F401  (registers autosp_attn::ring_attention)
from autosp.passes.attention_schemes.base import register_scheme
from autosp.passes.attention_schemes.ulysses import Ulysses
from autosp.ops.tiled_attention import default_tile
from autosp.passes.sp_rules.score_program import leaf_values

__all__ = ["Ring", "RING_SEQ_GATHER", "RING_SEQ_SCATTER", "RING_ATTENTION", "RING_LIVE_TILES"]

RING_SEQ_GATHER = torch.ops.autosp.ring_seq_gather.default
RING_SEQ_SCATTER = torch.ops.autosp.ring_seq_scatter.default
RING_ATTENTION = torch.ops.autosp_attn.ring_attention.default
RING_LIVE_TILES = torch.ops.autosp_attn.ring_live_tiles.default


class Ring(Ulysses):
    """Ulysses over ``sp_size / rw.ring`` ranks, a ring over ``rw.ring`` (see the module docstring)."""

    name = "ring"
    owns_attention = True
    gather_op = RING_SEQ_GATHER
    scatter_op = RING_SEQ_SCATTER

    def head_split(self, rw: Any) -> int:
        return rw.sp_size // rw.ring

    def check_heads(self, rw: Any, where: fx.Node, heads: int, shape: list) -> None:
        ulysses = self.head_split(rw)
        if heads % ulysses:
            valid = [(layout.ulysses, layout.ring) for layout in attention_layouts(rw.sp_size, heads)]
            raise AutoSPError(
                f"{where.name}: the query has {heads} attention heads (shape {shape}), not divisible by the Ulysses degree "
                f"{ulysses} of sp_layout=({ulysses}, {rw.ring}). Layouts of sp_size={rw.sp_size} for this model: "
                f"sp_layout={valid} (leave sp_layout unset to choose one automatically)."
            )

    def _gather(self, rw: Any, send: fx.Node, head_dim: int) -> fx.Node:
        args = (send, head_dim, rw.group_name, rw.emit(rw.seq), rw.sp_rank, rw.ring, rw.zigzag)
        return rw.graph.call_function(RING_SEQ_GATHER, args)  # [.., S/ring, h/ulysses, D]: the ring segment

    def _scatter(self, rw: Any, tokens_out: fx.Node, head_dim: int) -> fx.Node:
        args = (tokens_out, head_dim, rw.group_name, rw.sp_size, rw.emit(rw.seq), rw.sp_rank, rw.ring, rw.zigzag)
        return rw.graph.call_function(RING_SEQ_SCATTER, args)  # [ulysses, .., S_r, h/ulysses, D]

    def attend(self, rw: Any, q: fx.Node, k: fx.Node, v: fx.Node, program: Any, heads: int, device: Any) -> fx.Node:
        """The ring kernel on this rank's heads for its ring segment (q ``[B, H/U, S/R, D]``; k, v
        ``[B, Hk', S/R, D]``), the leaves whole: its output ``[B, H/U, S/R, Dv]``."""
        leaves = leaf_values(rw, program, heads)
        rw.record_mask_inputs(list(program.leaves))
        tile = rw.attention_tile or default_tile(device)
        seq = rw.emit(rw.seq)
        key = ("ring", program.text, tuple(leaves), tile)
        if key not in rw.live_tiles:  # the maps of every step: once for the attention calls that share the mask
            ring_rank = rw.sp_rank // (rw.sp_size // rw.ring)
            rw.live_tiles[key] = rw.graph.call_function(RING_LIVE_TILES, (leaves, program.text, tile, seq, rw.ring, ring_rank, rw.zigzag))
        args = (q, k, v, leaves, rw.live_tiles[key], program.text, tile, seq, rw.group_name, rw.sp_rank, rw.ring, rw.zigzag)
        call = rw.graph.call_function(RING_ATTENTION, args)
        rw.stats.ring_attention += 1
        return rw.graph.call_function(operator.getitem, (call, 0))


register_scheme(Ring())
