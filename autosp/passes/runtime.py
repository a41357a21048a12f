"""Plain functions that the SP pass calls from the rewritten graph.

They run (and are traced by AOT autograd) with local tensors and global SymInts. Keeping them
here, rather than emitting long chains of nodes, keeps the rewritten graph readable: one
``call_function`` per redistribution.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from autosp.ops import fused_loss

from autosp.ops import collectives as ops


def _is_static(v, k: int) -> bool:
    """``v`` is the plain int ``k`` (not a SymInt that may take other values)."""
    return isinstance(v, int) and v == k


def shard_slice(x: torch.Tensor, dim: int, outer, seq_len, inner, start, length) -> torch.Tensor:
    """Replicate -> Shard: keep sequence positions ``[start, start + length)`` of ``x``.

    ``x.shape[dim]`` is ``outer * seq_len * inner`` (global sizes).
    """
    if _is_static(outer, 1) and _is_static(inner, 1):
        return x.narrow(dim, start, length).contiguous()
    y = x.unflatten(dim, (outer, seq_len, inner))  # [.., outer, seq, inner, ..]
    return y.narrow(dim + 1, start, length).flatten(dim, dim + 2)  # [.., outer*length*inner, ..]


def window_of_random(like: torch.Tensor, kind: str, dtype: torch.dtype, global_shape, dim: int, outer, seq_len, inner, start, length) -> torch.Tensor:
    """This rank's window (as :func:`shard_slice`) of ``torch.rand``/``torch.randn`` drawn for
    the global shape: the same draw on every rank of the SP group, so the shards get
    independent numbers."""
    draw = torch.rand if kind == "rand" else torch.randn
    noise = draw(list(global_shape), dtype=dtype, device=like.device)
    return shard_slice(noise, dim, outer, seq_len, inner, start, length)


def dropout_with(x: torch.Tensor, uniform: torch.Tensor, p: float) -> torch.Tensor:
    """``F.dropout(x, p)`` with the given uniform noise: keep where ``uniform >= p``, scale by
    ``1 / (1 - p)``."""
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return torch.where(uniform >= p, x * scale, torch.zeros((), dtype=x.dtype, device=x.device))


def global_sizes(*dims):
    """``x.size()`` of a sharded tensor, with the global sequence length."""
    return tuple(dims)


def _pad_dim(x: torch.Tensor, dim: int, left, right) -> torch.Tensor:
    parts = []
    if not _is_static(left, 0):
        shape = list(x.shape)
        shape[dim] = left
        parts.append(x.new_zeros(shape))
    parts.append(x)
    if not _is_static(right, 0):
        shape = list(x.shape)
        shape[dim] = right
        parts.append(x.new_zeros(shape))
    return torch.cat(parts, dim=dim) if len(parts) > 1 else x


def shard_gather(
    x: torch.Tensor, dim: int, outer, inner, off: int, length, left_pad, right_pad, group_name: str, group_size: int
) -> torch.Tensor:
    """Shard -> Replicate: all-gather the sequence axis held in ``dim``.

    ``dim`` holds ``(outer, seq, inner)`` flattened. The local part is first padded to this
    rank's full base chunk (``left_pad``/``right_pad`` positions, non-zero only on the
    first/last rank of a tensor sliced on the sequence), then the chunks are gathered in
    rank order and the ``[off, off + length)`` window of the base sequence is cut out.
    """
    if _is_static(outer, 1) and _is_static(inner, 1):
        y = _pad_dim(x, dim, left_pad, right_pad)  # [.., c, ..]
        return ops.all_gather(y, dim, group_name, group_size).narrow(dim, off, length)  # [.., length, ..]
    y = x.unflatten(dim, (outer, -1, inner))  # [.., outer, len_r, inner, ..]
    y = _pad_dim(y, dim + 1, left_pad, right_pad)  # [.., outer, c, inner, ..]
    y = ops.all_gather(y, dim + 1, group_name, group_size)  # [.., outer, s, inner, ..]
    return y.narrow(dim + 1, off, length).flatten(dim, dim + 2)  # [.., outer*length*inner, ..]


def reduce_sum(x: torch.Tensor, dims, keepdim: bool, group_name: str, group_size: int, dtype=None) -> torch.Tensor:
    """Sum over dims that include the sharded sequence axis: local sum, then all-reduce."""
    local = x.sum(dim=dims, keepdim=keepdim, dtype=dtype) if dims is not None else x.sum(dtype=dtype)
    return ops.all_reduce(local, group_name, group_size)


def group_sum(x: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """``x`` (each rank's partial result) summed over the SP group."""
    return ops.all_reduce(x, group_name, group_size)


def add_over_group(kind: str, d: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """``d.scatter_add(dim, index, src)`` (``kind`` ``"scatter_add"``) or ``d.index_add(..)`` with
    ``index`` and ``src`` this rank's tokens: the ranks' partial sums added over the SP group, then to ``d``."""
    zeros = torch.zeros_like(d)
    part = zeros.scatter_add(dim, index, src) if kind == "scatter_add" else zeros.index_add(dim, index, src)
    return d + ops.all_reduce(part, group_name, group_size)


def reduce_mean(x: torch.Tensor, dims, keepdim: bool, count, group_name: str, group_size: int, dtype=None) -> torch.Tensor:
    """Mean over dims that include the sharded axis; ``count`` is the global number of elements."""
    return reduce_sum(x, dims, keepdim, group_name, group_size, dtype) / count


def token_loss(
    kind: str,
    input: torch.Tensor,
    target: torch.Tensor,
    weight: Optional[torch.Tensor],
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    group_name: str,
    group_size: int,
) -> torch.Tensor:
    """``cross_entropy``/``nll_loss`` (``kind``) over a sequence-sharded batch, combined over the SP group.

    ``mean`` is token-weighted exactly as on one device: the summed loss and the summed
    weight of the targets that are not ``ignore_index`` are all-reduced, then divided.
    """
    if kind == "cross_entropy":
        total = F.cross_entropy(
            input, target, weight=weight, ignore_index=ignore_index, reduction="sum", label_smoothing=label_smoothing
        )
    else:
        total = F.nll_loss(input, target, weight=weight, ignore_index=ignore_index, reduction="sum")
    return _combine(total, target, weight, ignore_index, reduction, group_name, group_size)


def linear_token_loss(
    h: torch.Tensor,
    proj: torch.Tensor,
    bias: Optional[torch.Tensor],
    logits_dtype: Optional[torch.dtype],
    with_grad: bool,
    target: torch.Tensor,
    weight: Optional[torch.Tensor],
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    chunk: int,
    group_name: str,
    group_size: int,
) -> torch.Tensor:
    """:func:`token_loss` of ``cross_entropy`` on ``linear(h, proj, bias)`` (cast to
    ``logits_dtype``), computed ``chunk`` tokens at a time (``0``: sized from the vocabulary) by
    :func:`autosp.ops.fused_loss.linear_cross_entropy`: the logits never exist whole."""
    rows = h.reshape(-1, h.shape[-1])
    chunk = chunk or fused_loss.auto_chunk_rows(proj.shape[0])
    total = fused_loss.linear_cross_entropy(
        rows, proj, bias, target, weight, ignore_index, label_smoothing, logits_dtype, chunk, with_grad
    )[0]
    return _combine(total, target, weight, ignore_index, reduction, group_name, group_size)


def _combine(total, target, weight, ignore_index, reduction, group_name, group_size) -> torch.Tensor:
    """The summed loss of this rank's tokens -> the loss of the whole sequence, over the SP group."""
    if reduction == "sum":
        return ops.all_reduce(total, group_name, group_size)
    valid = target != ignore_index
    if weight is None:
        denom = valid.sum().to(total.dtype)
    else:
        # ignore_index need not be a class (e.g. -100 or num_classes): look up a valid class there
        denom = (weight[target.masked_fill(~valid, 0)] * valid).sum().to(total.dtype)
    return ops.group_ratio(total, denom, group_name, group_size)[0]


def pack(*values: Any) -> tuple:
    """A tuple of the values: what a rule emits for an op returning several values, whose pieces
    it computed one by one (the graph reads them with ``getitem``)."""
    return values
