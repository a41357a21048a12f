"""Differentiable sequence-parallel collectives as ``torch.library`` custom ops.

Each op takes the process group *by name* (``group.group_name``) and its size as plain
arguments, so graphs that call them can be built and traced (fake kernels) with no process
group at all, and the FX graph cache keys stay free of Python objects.

Backward of every op is its exact adjoint, which is what makes the SP rewrite produce the
same gradients as one device (see ``docs/design.md``):

==================  ==========================  ===============================
op                  forward                     backward
==================  ==========================  ===============================
``all_to_all``      scatter ``dim_a``,          ``all_to_all`` with the dims
                    gather ``dim_b``            swapped
``all_reduce``      sum over the group          ``all_reduce`` (sum)
``all_gather``      concat along ``dim``        ``reduce_scatter`` along ``dim``
``reduce_scatter``  sum then split ``dim``      ``all_gather`` along ``dim``
==================  ==========================  ===============================
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from lightning_autosp._compat import reduce_scatter_single
from lightning_autosp.layout import seq_split_sizes

__all__ = ["all_to_all", "all_reduce", "all_gather", "reduce_scatter"]

_NS = "autosp"


def _group(group_name: str) -> dist.ProcessGroup:
    return _resolve_process_group(group_name)


# --------------------------------------------------------------------------- all_to_all
@torch.library.custom_op(f"{_NS}::all_to_all", mutates_args=())
def all_to_all(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group_name: str,
    group_size: int,
    seq_len: Optional[int] = None,
    seq_dim: int = -1,
    rank: int = 0,
) -> torch.Tensor:
    """Split ``x`` into ``group_size`` chunks along ``scatter_dim``, send chunk ``j`` to rank
    ``j``, and concatenate the chunks received along ``gather_dim`` (rank order).

    Ulysses uses it as ``[B, H, S/P, D] -> [B, H/P, S, D]`` (scatter heads, gather sequence)
    before attention and the reverse after it. With ``seq_len`` given, the sequence dim
    ``seq_dim`` (``gather_dim`` before attention, ``scatter_dim`` after it) is split as
    :func:`~lightning_autosp.layout.seq_split_sizes` says, so lengths need not be divisible by ``group_size``;
    ``rank`` is this rank's index in the group.
    """
    pg = _group(group_name)
    if seq_len is None:
        chunks = x.chunk(group_size, dim=scatter_dim)  # P x [.., n/P, ..]
        send = torch.stack(chunks, dim=0).contiguous()  # [P, *chunk]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=pg)
        return torch.cat(recv.unbind(0), dim=gather_dim)  # [.., m*P, ..]
    sizes = seq_split_sizes(seq_len, group_size)
    if gather_dim == seq_dim:  # local tokens, all heads -> all tokens, our heads
        parts = x.chunk(group_size, dim=scatter_dim)  # P views [.., H/P, .., n_r, ..]
        shapes = []
        for n in sizes:
            shp = list(parts[0].shape)
            shp[gather_dim] = n
            shapes.append(shp)
    else:  # all tokens, our heads -> local tokens, all heads
        parts = x.split(sizes, dim=scatter_dim)  # P views [.., H/P, .., n_j, ..]
        shp = list(parts[rank].shape)
        shapes = [shp] * group_size
    send_counts = [p.numel() for p in parts]
    send = x.new_empty(sum(send_counts))
    for p, buf in zip(parts, send.split(send_counts)):  # one copy into the send buffer
        buf.view(p.shape).copy_(p)
    recv_counts = [math.prod(shp) for shp in shapes]
    recv = send.new_empty(sum(recv_counts))
    dist.all_to_all_single(
        recv, send, output_split_sizes=recv_counts, input_split_sizes=send_counts, group=pg
    )
    pieces = [r.view(shp) for r, shp in zip(recv.split(recv_counts), shapes)]
    return torch.cat(pieces, dim=gather_dim)


@all_to_all.register_fake
def _(x, scatter_dim, gather_dim, group_name, group_size, seq_len=None, seq_dim=-1, rank=0):
    shape = list(x.shape)
    if seq_len is None:
        shape[scatter_dim] = shape[scatter_dim] // group_size
        shape[gather_dim] = shape[gather_dim] * group_size
    elif gather_dim == seq_dim:
        shape[scatter_dim] = shape[scatter_dim] // group_size
        shape[gather_dim] = seq_len
    else:
        shape[scatter_dim] = seq_split_sizes(seq_len, group_size)[rank]
        shape[gather_dim] = shape[gather_dim] * group_size
    return x.new_empty(shape)


def _all_to_all_backward(ctx, grad):
    g = all_to_all(
        grad.contiguous(), ctx.gather_dim, ctx.scatter_dim, ctx.group_name, ctx.group_size, ctx.seq_len, ctx.seq_dim, ctx.rank
    )
    return g, None, None, None, None, None, None, None


def _all_to_all_setup(ctx, inputs, output):
    _, ctx.scatter_dim, ctx.gather_dim, ctx.group_name, ctx.group_size, ctx.seq_len, ctx.seq_dim, ctx.rank = inputs


all_to_all.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)


# --------------------------------------------------------------------------- all_reduce
@torch.library.custom_op(f"{_NS}::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """Sum ``x`` over the group; every rank gets the total."""
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=_group(group_name))
    return out


@all_reduce.register_fake
def _(x, group_name, group_size):
    return torch.empty_like(x)


def _all_reduce_backward(ctx, grad):
    return all_reduce(grad, ctx.group_name, ctx.group_size), None, None


def _all_reduce_setup(ctx, inputs, output):
    _, ctx.group_name, ctx.group_size = inputs


all_reduce.register_autograd(_all_reduce_backward, setup_context=_all_reduce_setup)


# --------------------------------------------------------------------------- all_gather
@torch.library.custom_op(f"{_NS}::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, group_name: str, group_size: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    moved = x.movedim(dim, 0).contiguous()  # [n, ...]
    gathered = moved.new_empty((group_size * moved.shape[0],) + tuple(moved.shape[1:]))  # [P*n, ...]
    dist.all_gather_into_tensor(gathered, moved, group=_group(group_name))
    return gathered.movedim(0, dim).contiguous()


@all_gather.register_fake
def _(x, dim, group_name, group_size):
    shape = list(x.shape)
    shape[dim] = shape[dim] * group_size
    return x.new_empty(shape)


def _all_gather_backward(ctx, grad):
    return reduce_scatter(grad.contiguous(), ctx.dim, ctx.group_name, ctx.group_size), None, None, None


def _all_gather_setup(ctx, inputs, output):
    _, ctx.dim, ctx.group_name, ctx.group_size = inputs


# --------------------------------------------------------------------------- reduce_scatter
@torch.library.custom_op(f"{_NS}::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, dim: int, group_name: str, group_size: int) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim``."""
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // group_size,) + tuple(moved.shape[1:]))
    reduce_scatter_single(out, moved, op=dist.ReduceOp.SUM, group=_group(group_name))
    return out.movedim(0, dim).contiguous()


@reduce_scatter.register_fake
def _(x, dim, group_name, group_size):
    shape = list(x.shape)
    shape[dim] = shape[dim] // group_size
    return x.new_empty(shape)


def _reduce_scatter_backward(ctx, grad):
    return all_gather(grad.contiguous(), ctx.dim, ctx.group_name, ctx.group_size), None, None, None


def _reduce_scatter_setup(ctx, inputs, output):
    _, ctx.dim, ctx.group_name, ctx.group_size = inputs


all_gather.register_autograd(_all_gather_backward, setup_context=_all_gather_setup)
reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_reduce_scatter_setup)
