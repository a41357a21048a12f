"""DeepSpeed-Ulysses: all-to-all from the rank's positions with every head to every position with
the rank's heads, attention on those, and all-to-all back.

For ``P`` SP ranks and ``h`` heads, rank ``j`` computes attention for heads ``j*h/P .. (j+1)*h/P``
over the whole sequence; each attention costs four all-to-alls (q, k, v in and the output back;
three where k or v is one head every query head reads, gathered whole instead), each moving a
rank's ``1/P`` of the tensor. The exchanges are :func:`autosp.ops.collectives.seq_gather` and
:func:`~autosp.ops.collectives.seq_scatter` (op namespace ``autosp``), each with its exact adjoint.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from autosp.errors import AutoSPError
from autosp.layout import attention_layouts
from autosp.passes.attention_schemes.base import AttentionScheme, register_scheme
from autosp.passes.sp_rules.attention import emit_tiled_attention, exchanged_source

__all__ = ["Ulysses", "SEQ_GATHER", "SEQ_SCATTER", "valid_sp_sizes"]

SEQ_GATHER = torch.ops.autosp.seq_gather.default
SEQ_SCATTER = torch.ops.autosp.seq_scatter.default


class Ulysses(AttentionScheme):
    """Heads split over the SP group, positions whole (see the module docstring)."""

    name = "ulysses"
    op_namespaces = ("autosp",)
    gather_op = SEQ_GATHER
    scatter_op = SEQ_SCATTER

    def head_split(self, rw: Any) -> int:
        return rw.sp_size

    def check_heads(self, rw: Any, where: fx.Node, heads: int, shape: list) -> None:
        if heads % rw.sp_size:
            raise AutoSPError(
                f"{where.name}: the query has {heads} attention heads (shape {shape}), not divisible by "
                f"sp_size={rw.sp_size}. Ulysses splits the heads across the SP group; valid sp_size values for this "
                f"model: {valid_sp_sizes(heads)}, or a layout with a ring level: sp_layout={_ring_layouts(rw.sp_size, heads)} "
                "(leave sp_layout unset to choose one automatically)."
            )

    def heads_per_rank(self, rw: Any, heads: int) -> int:
        return heads // self.head_split(rw)

    def first_head(self, rw: Any, heads: int) -> int:
        return (rw.sp_rank % self.head_split(rw)) * self.heads_per_rank(rw, heads)

    def to_heads(self, rw: Any, x: fx.Node, heads: int, head_dim: int, seq_dim: int) -> fx.Node:
        """``[.., h, S_r, D]`` (this rank's tokens, all heads) -> ``[.., h/P, S, D]`` (all tokens,
        this rank's heads). The send buffer ``[P, .., S_r, h/P, D]`` (head group ``j`` for rank
        ``j``, tokens outside heads) is laid out with plain tensor ops the compiler can fuse into the
        producer; ``seq_gather`` exchanges and joins the pieces (of uneven length when ``P`` does not
        divide ``S``) into ``[.., S, h/P, D]``, and attention reads that through a transposed view.
        With the sequence outside the heads the pieces received lie end to end for ``B = 1``, so
        joining them copies nothing."""
        g, P = rw.graph, self.head_split(rw)
        send = g.call_function(torch.unflatten, (x, head_dim, (P, heads // P)))  # [.., P, h/P, S_r, D]
        lead = tuple(range(head_dim))
        send = g.call_function(torch.permute, (send, (head_dim, *lead, head_dim + 2, head_dim + 1, head_dim + 3)))
        send = g.call_method("contiguous", (send,))  # [P, .., S_r, h/P, D]
        full = self._gather(rw, send, head_dim)  # [.., S, h/P, D]
        rw.stats.all_to_all += 1
        return g.call_function(torch.transpose, (full, head_dim, seq_dim))  # [.., h/P, S, D]

    def _gather(self, rw: Any, send: fx.Node, head_dim: int) -> fx.Node:
        """The exchange of :meth:`to_heads`: ``[P, .., S_r, h/P, D]`` -> ``[.., S, h/P, D]``."""
        return rw.graph.call_function(SEQ_GATHER, (send, head_dim, rw.group_name, rw.emit(rw.seq), rw.sp_rank))

    def _scatter(self, rw: Any, tokens_out: fx.Node, head_dim: int) -> fx.Node:
        """The exchange of :meth:`to_sequence`: ``[.., S, h/P, D]`` -> ``[P, .., S_r, h/P, D]``."""
        return rw.graph.call_function(SEQ_SCATTER, (tokens_out, head_dim, rw.group_name, rw.sp_size, rw.emit(rw.seq), rw.sp_rank))

    def to_sequence(self, rw: Any, x: fx.Node, head_dim: int, seq_dim: int) -> fx.Node:
        """The inverse of :meth:`to_heads`: ``[.., h/P, S, D]`` -> ``[.., h, S_r, D]``. Attention's
        output is read as ``[.., S, h/P, D]`` (on CPU and in the flash kernels the memory layout it
        was written in when the inputs are transposed views, so the send needs no copy); the pieces
        received (``seq_scatter``) are put in head order with plain tensor ops the compiler can fuse
        into the consumer."""
        g = rw.graph
        tokens_out = g.call_function(torch.transpose, (x, head_dim, seq_dim))  # [.., S, h/P, D]
        recv = self._scatter(rw, tokens_out, head_dim)
        rw.stats.all_to_all += 1
        lead = tuple(range(1, head_dim + 1))  # recv: [P, .., S_r, h/P, D]
        out = g.call_function(torch.permute, (recv, (*lead, 0, head_dim + 2, head_dim + 1, head_dim + 3)))  # [.., P, h/P, S_r, D]
        return g.call_function(torch.flatten, (out, head_dim, head_dim + 1))  # [.., h, S_r, D]

    def attend(self, rw: Any, q: fx.Node, k: fx.Node, v: fx.Node, program: Any, heads: int, device: Any) -> fx.Node:
        """The tiled kernel over the whole sequence for this rank's heads (a mask the model
        builds from positions; plain attention stays SDPA, outside this method)."""
        return emit_tiled_attention(rw, q, k, v, program, heads, device)

    def reads_exchanged(self, a: object) -> bool:
        """``a`` is read from a ``seq_gather`` (through the transposed view :meth:`to_heads` emits
        and, for KV heads exchanged before the model's repeat, the repeat after it)."""
        a = exchanged_source(a)
        return isinstance(a, fx.Node) and a.target is torch.transpose and getattr(a.args[0], "target", None) is self.gather_op

    def writes_exchanged(self, u: fx.Node) -> bool:
        """``u`` feeds only a ``seq_scatter`` (through :meth:`to_sequence`'s transposed view)."""
        return u.target is torch.transpose and len(u.users) > 0 and all(v.target is self.scatter_op for v in u.users)


def valid_sp_sizes(heads: int) -> list[int]:
    return [d for d in range(1, heads + 1) if heads % d == 0]


def _ring_layouts(sp_size: int, heads: int) -> list[tuple[int, int]]:
    return [(layout.ulysses, layout.ring) for layout in attention_layouts(sp_size, heads)]


register_scheme(Ulysses())
