"""Differentiable sequence-parallel collectives as ``torch.library`` custom ops.

Each op takes the process group *by name* (``group.group_name``) and its size as plain
arguments, so graphs that call them can be built and traced (fake kernels) with no process
group at all, and the FX graph cache keys stay free of Python objects.

Backward of every op is its exact adjoint, which is what makes the SP rewrite produce the
same gradients as one device (see ``docs/design.md``):

====================  ==========================  ===============================
op                    forward                     backward
====================  ==========================  ===============================
``seq_gather``        ``[P, .., S_r, ..]`` ->     ``seq_scatter``
                      ``[.., S, ..]``
``seq_scatter``       ``[.., S, ..]`` ->          ``seq_gather``
                      ``[P, .., S_r, ..]``
``ring_seq_gather``   ``[U, .., S_r, ..]`` ->     ``ring_seq_scatter``
                      ``[.., S/R, ..]``
``ring_seq_scatter``  ``[.., S/R, ..]`` ->        ``ring_seq_gather``
                      ``[U, .., S_r, ..]``
``all_reduce``        sum over the group          ``all_reduce`` (sum)
``group_ratio``       ``sum(num) / sum(den)``     ``group_ratio_backward``: both
                      over the group              partials, summed over the group
``all_gather``        concat along ``dim``        ``reduce_scatter`` along ``dim``
``reduce_scatter``    sum then split ``dim``      ``all_gather`` along ``dim``
====================  ==========================  ===============================
"""

from __future__ import annotations

import math
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from autosp._compat import all_gather_single, reduce_scatter_single
from autosp.layout import ring_segment, ring_segment_length, seq_split_sizes

__all__ = ["seq_gather", "seq_scatter", "ring_seq_gather", "ring_seq_scatter", "all_reduce", "group_ratio", "group_ratio_backward", "all_gather", "reduce_scatter"]

_NS = "autosp"

#: bytes this process sent to other ranks so far (its own pieces excluded): ``"exchange"``, the
#: all-to-alls around attention (Ulysses' and the ring layout's) and other sequence mixers; ``"ring"``, the key/value blocks
#: and their gradients passed around a ring (:mod:`autosp.ops.ring_attention`); ``"halo"``, the
#: left context of sequence-sharded convolutions and its gradient (:func:`seq_pass`); ``"gather"``,
#: all-gathers of a sequence and their reduce-scatters (e.g. Mamba-2's one group of ``B``/``C``,
#: which every head reads). Read by the benchmarks and the tests.
SENT_BYTES = {"exchange": 0, "ring": 0, "halo": 0, "gather": 0}


def _group(group_name: str) -> dist.ProcessGroup:
    return _resolve_process_group(group_name)


# --------------------------------------------------------------------------- seq_gather / seq_scatter
@torch.library.custom_op(f"{_NS}::seq_gather", mutates_args=())
def seq_gather(send: torch.Tensor, seq_dim: int, group_name: str, seq_len: int, rank: int) -> torch.Tensor:
    """``send`` is ``[P, *piece]``: ``send[j]`` (this rank's tokens, head group ``j``) goes to
    rank ``j``. The result is the pieces received (rank ``j``'s tokens, this rank's head group)
    joined along ``seq_dim`` of the piece: ``seq_len`` tokens, split over the ranks as
    :func:`~autosp.layout.seq_split_sizes` says. ``rank`` is this rank's index in the group.

    With :func:`seq_scatter` (its adjoint) it is Ulysses' all-to-all with the even side as
    ordinary tensor ops: the SP pass lays out ``send`` (and :func:`seq_scatter`'s result) with
    ``unflatten``/``permute``/``flatten``, which the compiler fuses into neighbouring kernels.
    When no dim of the piece before ``seq_dim`` is larger than 1 (the pass puts the sequence
    outside the heads, so this holds for batch size 1), the pieces received already lie end to
    end and the result is the receive buffer itself.
    """
    group_size = send.shape[0]
    sizes = seq_split_sizes(seq_len, group_size)
    send = send.contiguous()
    shapes = []
    for n in sizes:
        shape = list(send.shape[1:])
        shape[seq_dim] = n
        shapes.append(shape)
    recv_counts = [math.prod(shape) for shape in shapes]
    recv = send.new_empty(sum(recv_counts))
    SENT_BYTES["exchange"] += (send.numel() - send[rank].numel()) * send.element_size()
    dist.all_to_all_single(
        recv, send.view(-1), output_split_sizes=recv_counts, input_split_sizes=[send[0].numel()] * group_size,
        group=_group(group_name),
    )
    if math.prod(send.shape[1 : 1 + seq_dim]) == 1:  # the sequence is the outermost dim: the pieces lie end to end
        out_shape = list(shapes[0])
        out_shape[seq_dim] = seq_len
        return recv.view(out_shape)
    return torch.cat([r.view(shape) for r, shape in zip(recv.split(recv_counts), shapes)], dim=seq_dim)


@seq_gather.register_fake
def _(send, seq_dim, group_name, seq_len, rank):
    shape = list(send.shape[1:])
    shape[seq_dim] = seq_len
    return send.new_empty(shape)


@torch.library.custom_op(f"{_NS}::seq_scatter", mutates_args=())
def seq_scatter(x: torch.Tensor, seq_dim: int, group_name: str, group_size: int, seq_len: int, rank: int) -> torch.Tensor:
    """The adjoint of :func:`seq_gather`: ``x`` holds all ``seq_len`` tokens (along ``seq_dim``)
    of this rank's head group; rank ``j``'s tokens go to rank ``j``. The result is ``[P, *piece]``:
    ``result[j]`` is this rank's tokens of rank ``j``'s head group. A contiguous ``x`` with no
    dim before ``seq_dim`` larger than 1 is sent as it is; otherwise its pieces are copied into
    the send buffer."""
    sizes = seq_split_sizes(seq_len, group_size)
    parts = x.split(sizes, dim=seq_dim)
    send_counts = [p.numel() for p in parts]
    if math.prod(x.shape[:seq_dim]) == 1 and x.is_contiguous():  # the pieces lie end to end: send x as it is
        send = x.view(-1)
    else:
        send = x.new_empty(sum(send_counts))
        for p, buf in zip(parts, send.split(send_counts)):  # one copy into the send buffer
            buf.view(p.shape).copy_(p)
    recv = x.new_empty((group_size, *parts[rank].shape))
    SENT_BYTES["exchange"] += (sum(send_counts) - send_counts[rank]) * x.element_size()
    dist.all_to_all_single(
        recv.view(-1), send, output_split_sizes=[recv[0].numel()] * group_size, input_split_sizes=send_counts,
        group=_group(group_name),
    )
    return recv


@seq_scatter.register_fake
def _(x, seq_dim, group_name, group_size, seq_len, rank):
    shape = list(x.shape)
    shape[seq_dim] = seq_split_sizes(seq_len, group_size)[rank]
    return x.new_empty((group_size, *shape))


def _seq_gather_backward(ctx, grad):
    return seq_scatter(grad, ctx.seq_dim, ctx.group_name, ctx.group_size, ctx.seq_len, ctx.rank), None, None, None, None


def _seq_gather_setup(ctx, inputs, output):
    send, ctx.seq_dim, ctx.group_name, ctx.seq_len, ctx.rank = inputs
    ctx.group_size = send.shape[0]


def _seq_scatter_backward(ctx, grad):
    return seq_gather(grad, ctx.seq_dim, ctx.group_name, ctx.seq_len, ctx.rank), None, None, None, None, None


def _seq_scatter_setup(ctx, inputs, output):
    _, ctx.seq_dim, ctx.group_name, _, ctx.seq_len, ctx.rank = inputs


seq_gather.register_autograd(_seq_gather_backward, setup_context=_seq_gather_setup)
seq_scatter.register_autograd(_seq_scatter_backward, setup_context=_seq_scatter_setup)


# --------------------------------------------------------------------------- ring_seq_gather / ring_seq_scatter
def _overlap(lo: int, hi: int, spans: list) -> list[tuple[int, int]]:
    """The parts of positions ``[lo, hi)`` inside ``spans`` (each ``(start, stop)``), in order."""
    return [(max(lo, a), min(hi, b)) for a, b in spans if min(hi, b) > max(lo, a)]


def _ring_routes(seq_len: int, group_size: int, ring: int, zigzag: bool, rank: int):
    """Where the tokens go between the SP split and the ring's: ``(window, out, into)`` for SP rank
    ``rank``: its positions ``[start, stop)``; per SP rank ``d``, the spans of them ``d`` attends
    for (its ring segment, :func:`~autosp.layout.ring_segment`); per SP rank ``j``, the spans of
    ``j``'s positions this rank attends for. All in position order."""
    ulysses = group_size // ring
    sizes = seq_split_sizes(seq_len, group_size)
    starts = [sum(sizes[:j]) for j in range(group_size)]
    lo, hi = starts[rank], starts[rank] + sizes[rank]
    segments = [ring_segment(seq_len, ring, i, zigzag) for i in range(ring)]
    out = [_overlap(lo, hi, segments[d // ulysses]) for d in range(group_size)]
    into = [_overlap(starts[j], starts[j] + sizes[j], segments[rank // ulysses]) for j in range(group_size)]
    return (lo, hi), out, into


def _per_token(like: torch.Tensor, seq_dim: int) -> int:
    """Elements per position of a tensor whose positions run along ``seq_dim``."""
    return math.prod(n for i, n in enumerate(like.shape) if i != seq_dim)


def _piece_shape(like: torch.Tensor, seq_dim: int, n: int) -> list[int]:
    shape = list(like.shape)
    shape[seq_dim] = n
    return shape


@torch.library.custom_op(f"{_NS}::ring_seq_gather", mutates_args=())
def ring_seq_gather(send: torch.Tensor, seq_dim: int, group_name: str, seq_len: int, rank: int, ring: int, zigzag: bool) -> torch.Tensor:
    """Ulysses' exchange for an SP group laid out as ``ulysses x ring`` (``send`` is ``[U, *piece]``:
    ``send[u]``, this rank's tokens of head group ``u``, goes to the ranks of Ulysses rank ``u``).
    The result is this rank's head group for the positions of its ring segment
    (:func:`~autosp.layout.ring_segment`: two chunks of the sequence, head and tail with
    ``zigzag``), in position order along ``seq_dim`` of the piece. One all-to-all over the SP group:
    the positions a rank holds (:func:`~autosp.layout.seq_split_sizes`) are in one or two ring
    segments, and each part goes to the ranks attending for it. ``ring=1`` is :func:`seq_gather`."""
    ulysses = send.shape[0]
    group_size = ulysses * ring
    (lo, _), out, into = _ring_routes(seq_len, group_size, ring, zigzag, rank)
    parts = [send[d % ulysses].narrow(seq_dim, a - lo, b - a).reshape(-1) for d in range(group_size) for a, b in out[d]]
    per_token = _per_token(send[0], seq_dim)
    send_counts = [sum(b - a for a, b in out[d]) * per_token for d in range(group_size)]
    pieces = [b - a for j in range(group_size) for a, b in into[j]]
    recv = send.new_empty(sum(pieces) * per_token)
    flat = torch.cat(parts) if parts else send.new_empty(0)
    SENT_BYTES["exchange"] += (sum(send_counts) - send_counts[rank]) * send.element_size()
    dist.all_to_all_single(
        recv, flat, output_split_sizes=[sum(b - a for a, b in into[j]) * per_token for j in range(group_size)],
        input_split_sizes=send_counts, group=_group(group_name),
    )
    like = send[0]
    chunks = [r.view(_piece_shape(like, seq_dim, n)) for r, n in zip(recv.split([n * per_token for n in pieces]), pieces)]
    return torch.cat(chunks, dim=seq_dim)


@ring_seq_gather.register_fake
def _(send, seq_dim, group_name, seq_len, rank, ring, zigzag):
    shape = list(send.shape[1:])
    shape[seq_dim] = ring_segment_length(seq_len, ring, rank // send.shape[0], zigzag)
    return send.new_empty(shape)


@torch.library.custom_op(f"{_NS}::ring_seq_scatter", mutates_args=())
def ring_seq_scatter(
    x: torch.Tensor, seq_dim: int, group_name: str, group_size: int, seq_len: int, rank: int, ring: int, zigzag: bool
) -> torch.Tensor:
    """The adjoint of :func:`ring_seq_gather`: ``x`` holds this rank's head group for the positions
    of its ring segment (along ``seq_dim``); each position goes back to the SP rank holding it. The
    result is ``[U, *piece]``: ``result[u]`` is this rank's positions of head group ``u``."""
    ulysses = group_size // ring
    (lo, hi), out, into = _ring_routes(seq_len, group_size, ring, zigzag, rank)
    segment = ring_segment(seq_len, ring, rank // ulysses, zigzag)

    def local(p: int) -> int:  # a position of the segment -> its index in x
        (a0, b0), (a1, _) = segment
        return p - a0 if p < b0 else (b0 - a0) + (p - a1)

    per_token = _per_token(x, seq_dim)
    parts = [x.narrow(seq_dim, local(a), b - a).reshape(-1) for j in range(group_size) for a, b in into[j]]
    flat = torch.cat(parts) if parts else x.new_empty(0)
    result = x.new_empty((ulysses, *_piece_shape(x, seq_dim, hi - lo)))
    recv_counts = [sum(b - a for a, b in out[d]) * per_token for d in range(group_size)]
    recv = x.new_empty(sum(recv_counts))
    send_counts = [sum(b - a for a, b in into[j]) * per_token for j in range(group_size)]
    SENT_BYTES["exchange"] += (sum(send_counts) - send_counts[rank]) * x.element_size()
    dist.all_to_all_single(recv, flat, output_split_sizes=recv_counts, input_split_sizes=send_counts, group=_group(group_name))
    pieces = [(d, a, b) for d in range(group_size) for a, b in out[d]]
    for (d, a, b), r in zip(pieces, recv.split([(b - a) * per_token for _, a, b in pieces])):
        result[d % ulysses].narrow(seq_dim, a - lo, b - a).copy_(r.view(_piece_shape(x, seq_dim, b - a)))
    return result


@ring_seq_scatter.register_fake
def _(x, seq_dim, group_name, group_size, seq_len, rank, ring, zigzag):
    shape = list(x.shape)
    shape[seq_dim] = seq_split_sizes(seq_len, group_size)[rank]
    return x.new_empty((group_size // ring, *shape))


def _ring_seq_gather_setup(ctx, inputs, output):
    send, ctx.seq_dim, ctx.group_name, ctx.seq_len, ctx.rank, ctx.ring, ctx.zigzag = inputs
    ctx.group_size = send.shape[0] * ctx.ring


def _ring_seq_gather_backward(ctx, grad):
    back = ring_seq_scatter(grad, ctx.seq_dim, ctx.group_name, ctx.group_size, ctx.seq_len, ctx.rank, ctx.ring, ctx.zigzag)
    return back, None, None, None, None, None, None


def _ring_seq_scatter_setup(ctx, inputs, output):
    _, ctx.seq_dim, ctx.group_name, _, ctx.seq_len, ctx.rank, ctx.ring, ctx.zigzag = inputs


def _ring_seq_scatter_backward(ctx, grad):
    back = ring_seq_gather(grad, ctx.seq_dim, ctx.group_name, ctx.seq_len, ctx.rank, ctx.ring, ctx.zigzag)
    return back, None, None, None, None, None, None, None


ring_seq_gather.register_autograd(_ring_seq_gather_backward, setup_context=_ring_seq_gather_setup)
ring_seq_scatter.register_autograd(_ring_seq_scatter_backward, setup_context=_ring_seq_scatter_setup)


# --------------------------------------------------------------------------- all_reduce
@torch.library.custom_op(f"{_NS}::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """Sum ``x`` over the group; every rank gets the total."""
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=_group(group_name))
    return out


@all_reduce.register_fake
def _(x, group_name, group_size):
    return x.new_empty(x.shape)  # contiguous, whatever x's layout (as the kernel returns it)


def _all_reduce_backward(ctx, grad):
    return all_reduce(grad, ctx.group_name, ctx.group_size), None, None


def _all_reduce_setup(ctx, inputs, output):
    _, ctx.group_name, ctx.group_size = inputs


all_reduce.register_autograd(_all_reduce_backward, setup_context=_all_reduce_setup)


# --------------------------------------------------------------------------- group_ratio
@torch.library.custom_op(f"{_NS}::group_ratio", mutates_args=())
def group_ratio(num: torch.Tensor, den: torch.Tensor, group_name: str, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N / D, [N, D])`` with ``N``, ``D`` the sums of the scalars ``num`` and ``den`` (same
    dtype) over the group: a token-weighted mean over the sequence shards, with one all-reduce.

    What it computes is ``all_reduce(stack([num, den]))`` and a division - graph ops would do
    the same - but as one op it leaves the compiler no small kernels to generate and compile
    around the collective (in both directions). ``[N, D]`` is what backward reads."""
    both = torch.stack([num, den])
    dist.all_reduce(both, op=dist.ReduceOp.SUM, group=_group(group_name))
    return both[0] / both[1], both


@group_ratio.register_fake
def _(num, den, group_name, group_size):
    return num.new_empty(()), num.new_empty((2,))


def _group_ratio_setup(ctx, inputs, output):
    _, _, ctx.group_name, ctx.group_size = inputs
    ctx.save_for_backward(output[1])


@torch.library.custom_op(f"{_NS}::group_ratio_backward", mutates_args=())
def group_ratio_backward(grad: torch.Tensor, both: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """The gradients ``[d num, d den]`` of :func:`group_ratio`, given ``grad`` of ``N / D`` and
    ``both = [N, D]``: ``1/D`` and ``-N/D^2`` (as autograd differentiates a division) times
    ``grad``, each summed over the group like the gradient of an all-reduce. One op, so that
    the compiler generates no kernel for it either."""
    total, count = both[0], both[1]
    grads = torch.stack([grad / count, -grad * (total / count) / count])
    dist.all_reduce(grads, op=dist.ReduceOp.SUM, group=_group(group_name))
    return grads


@group_ratio_backward.register_fake
def _(grad, both, group_name, group_size):
    return both.new_empty((2,))


def _group_ratio_backward(ctx, grad, _grad_both):
    (both,) = ctx.saved_tensors
    grads = group_ratio_backward(grad, both, ctx.group_name, ctx.group_size)
    return grads[0], grads[1], None, None


group_ratio.register_autograd(_group_ratio_backward, setup_context=_group_ratio_setup)


# --------------------------------------------------------------------------- all_gather
@torch.library.custom_op(f"{_NS}::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, group_name: str, group_size: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    moved = x.movedim(dim, 0).contiguous()  # [n, ...]
    gathered = moved.new_empty((group_size * moved.shape[0],) + tuple(moved.shape[1:]))  # [P*n, ...]
    SENT_BYTES["gather"] += (group_size - 1) * moved.numel() * moved.element_size()
    all_gather_single(gathered, moved, group=_group(group_name))
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
    SENT_BYTES["gather"] += (group_size - 1) * out.numel() * out.element_size()
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


# --------------------------------------------------------------------------- seq_pass
@torch.library.custom_op(f"{_NS}::seq_pass", mutates_args=())
def seq_pass(x: torch.Tensor, forward: bool, group_name: str, group_size: int, rank: int) -> torch.Tensor:
    """Send ``x`` to the next rank of the group (``forward``) or to the previous one, and return
    what the rank on the other side sent: zeros on the first rank (``forward``) or on the last.
    Every rank's ``x`` has the same shape. A sequence-sharded causal convolution reads the last
    positions of the previous rank's shard this way (:mod:`autosp.passes.sp_rules.convolution`);
    its gradient goes back the other way. Bytes sent: ``x`` once, independent of the length."""
    x = x.contiguous()
    to = rank + 1 if forward else rank - 1
    source = rank - 1 if forward else rank + 1
    n = x.numel()
    send_counts = [n if j == to else 0 for j in range(group_size)]
    recv_counts = [n if j == source else 0 for j in range(group_size)]
    out = torch.zeros_like(x)
    send = x.view(-1) if 0 <= to < group_size else x.new_empty(0)
    SENT_BYTES["halo"] += send.numel() * x.element_size()
    recv = x.new_empty(sum(recv_counts))
    dist.all_to_all_single(recv, send, output_split_sizes=recv_counts, input_split_sizes=send_counts, group=_group(group_name))
    if 0 <= source < group_size:
        out.view(-1).copy_(recv)
    return out


@seq_pass.register_fake
def _(x, forward, group_name, group_size, rank):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _seq_pass_backward(ctx, grad):
    return seq_pass(grad, not ctx.forward, ctx.group_name, ctx.group_size, ctx.rank), None, None, None, None


def _seq_pass_setup(ctx, inputs, output):
    _, ctx.forward, ctx.group_name, ctx.group_size, ctx.rank = inputs


seq_pass.register_autograd(_seq_pass_backward, setup_context=_seq_pass_setup)


# --------------------------------------------------------------------------- pack_heads
def heads_order(head: int, seq: int, ndim: int) -> list[int]:
    """``[lead.., head, seq, trail..]``: the dims other than both, before the later of them, lead."""
    lead = [d for d in range(ndim) if d not in (head, seq) and d < max(head, seq)]
    return [*lead, head, seq, *(d for d in range(ndim) if d > max(head, seq))]


def heads_layout(x_shape: list, head: int, seq: int, group_size: int) -> tuple[list[int], list[int]]:
    """``(order, send shape)`` of :func:`pack_heads` for an input of ``x_shape``."""
    order = heads_order(head, seq, len(x_shape))
    n_lead = order.index(head)
    trail = math.prod(x_shape[d] for d in order[n_lead + 2 :])
    h = x_shape[head]
    return order, [group_size, *(x_shape[d] for d in order[:n_lead]), x_shape[seq], h // group_size, trail]


@torch.library.custom_op(f"{_NS}::pack_heads", mutates_args=())
def pack_heads(x: torch.Tensor, head: int, seq: int, group_size: int) -> torch.Tensor:
    """The send buffer of an exchange from this rank's positions with every head to every position
    with a rank's heads, for ``x`` with its heads in dim ``head`` and its positions in dim ``seq``:
    ``[P, lead.., S_r, h/P, D]`` (``lead``: the dims before the later of the two, ``D``: those after
    it, flattened; head group ``j`` for rank ``j``), what :func:`seq_gather` sends. Its gradient is
    laid out as ``x`` is (contiguous), so the model's code before a sequence mixer sees gradients
    laid out as on one device."""
    order, shape = heads_layout(list(x.shape), head, seq, group_size)
    n_lead = order.index(head)
    y = x.permute(order).reshape(*(x.shape[d] for d in order[: n_lead + 2]), -1)  # [lead.., h, S_r, D]
    y = y.unflatten(n_lead, (group_size, -1))  # [lead.., P, h/P, S_r, D]
    y = y.permute(n_lead, *range(n_lead), n_lead + 2, n_lead + 1, n_lead + 3)  # [P, lead.., S_r, h/P, D]
    return y.contiguous().view(shape)


@pack_heads.register_fake
def _(x, head, seq, group_size):
    return x.new_empty(heads_layout(list(x.shape), head, seq, group_size)[1])


def _pack_heads_backward(ctx, grad):
    order = heads_order(ctx.head, ctx.seq, len(ctx.shape))
    n_lead = order.index(ctx.head)
    g = grad.permute(*range(1, n_lead + 1), 0, n_lead + 2, n_lead + 1, n_lead + 3)  # [lead.., P, h/P, S_r, D]
    g = g.reshape(*(ctx.shape[d] for d in order))  # in the order of x's dims in `order`
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return g.permute(inverse).contiguous(), None, None, None


def _pack_heads_setup(ctx, inputs, output):
    x, ctx.head, ctx.seq, _ = inputs
    ctx.shape = list(x.shape)


pack_heads.register_autograd(_pack_heads_backward, setup_context=_pack_heads_setup)
