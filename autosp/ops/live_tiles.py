"""The map of live tiles: which tiles of (query rows x key columns) a score program's mask may
leave unmasked.

:func:`live_map` evaluates the program once in interval arithmetic, on each leaf's bounds over
every tile of the grid (:data:`_INTERVAL_RULES`): ``O((rows / tile) * (columns / tile))`` work,
conservative, so exact (a tile it cannot prove masked is computed, and masked logits contribute
nothing). A program with an op it has no bounds for is evaluated element by element instead
(:func:`_probe_block`). The rows and columns are any two spans of the sequence
(``q_off``, ``k_off``: the positions of their first row and column): the whole sequence for
:func:`~autosp.ops.tiled_attention.tiled_attention`, one part against another for a ring step
(:mod:`autosp.ops.ring_attention`). The map depends on the mask alone: the SP pass emits
:func:`live_tiles` once for every attention that reads the same mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from autosp.ops.kernels import to_host
from autosp.ops.score_program import MASKED, ScoreProgram, _resolve, tile_positions

__all__ = [
    "live_map", "live_tiles", "exactly_causal", "is_causal_map", "keyless_rows", "mark_fill", "LIVE", "LIVE_NO_BIAS", "CAUSAL", "FILL",
    "PROBE_TILES", "probe_bytes",
]

#: key tiles the mask is evaluated over at once to find the ones it covers whole
PROBE_TILES = 8
#: the entries of :func:`live_tiles`' map: a tile to compute, one to compute without its bias (0 there),
#: a diagonal tile of a mask that is exactly causal (:func:`exactly_causal`), and a tile the mask
#: covers whole that is computed all the same, because a row of its block may have no unmasked key
#: at all (:func:`keyless_rows`: under a finite fill such a row's softmax runs over every key)
LIVE, LIVE_NO_BIAS, CAUSAL, FILL = 1, 2, 3, 4


def probe_bytes(batch: int, heads: int, seq_len: int, tile: int) -> int:
    """Bytes :func:`live_tiles` allocates while it runs: the mask of one query block over
    :data:`PROBE_TILES` key tiles, as fp32 logits (an upper bound: a mask without heads is smaller)."""
    t = min(tile, int(seq_len))
    return 2 * batch * heads * t * min(PROBE_TILES * t, int(seq_len)) * 4


_ZERO = torch.zeros(())


def _probe(prog: ScoreProgram, leaves: list, q0: int, q1: int, k0: int, k1: int, q_off: int = 0, k_off: int = 0) -> torch.Tensor:
    """The logits of query rows ``[q0, q1)`` over key columns ``[k0, k1)`` of ``leaves`` (which
    start at positions ``q_off``, ``k_off``) with ``s = 0``: the program evaluated element by
    element on the mask terms alone, at least ``[rows, columns]`` (masked where ``<= MASKED``)."""
    positions = tile_positions(prog, q_off + q0, q_off + q1, k_off + k0, k_off + k1, torch.device("cpu"))
    probe = torch.as_tensor(prog.evaluate(_ZERO, prog.leaf_tiles(leaves, q0, q1, k0, k1), positions))
    probe = probe.reshape((1,) * max(0, 2 - probe.dim()) + tuple(probe.shape))
    return probe.expand(*probe.shape[:-2], q1 - q0, k1 - k0)


def _probe_block(
    prog: ScoreProgram, leaves: list, q0: int, q1: int, S: int, tile: int, q_off: int = 0, k_off: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key tile, whether the mask leaves any logit of query rows ``[q0, q1)`` unmasked, and
    whether it leaves every one unmasked, for every batch row and head (``[n]`` bools each; programs
    without interval rules), over :data:`PROBE_TILES` tiles of columns at a time. ``leaves`` hold
    the rows and columns (``S`` of them) from position ``q_off`` and ``k_off``."""
    live, full, finite = [], [], []
    chunk = tile * PROBE_TILES
    for c0 in range(0, S, chunk):
        c1 = min(c0 + chunk, S)
        n = -(-(c1 - c0) // tile)
        probe = _probe(prog, leaves, q0, q1, c0, c1, q_off, k_off).flatten(0, -2)  # [rows of every batch and head, C]
        pad = n * tile - (c1 - c0)
        if pad:
            probe = torch.cat([probe, probe[:, -1:].expand(-1, pad)], dim=1)
        blocks = probe.view(probe.shape[0], n, tile)
        live.append((blocks > MASKED).any(-1).any(0))
        full.append((blocks > MASKED).all(-1).all(0))
        finite.append((blocks > -math.inf).any(-1).any(0))
    return torch.cat(live), torch.cat(full), torch.cat(finite)



# --------------------------------------------------------------------------- the map of live tiles
class _NoIntervalRule(Exception):
    pass


@dataclass
class _Interval:
    """Bounds of a value over each tile of the grid: ``lo <= x <= hi`` (for bools, ``lo``: true
    everywhere in the tile, ``hi``: true somewhere)."""

    lo: Any
    hi: Any


def _bounds(x: Any) -> _Interval:
    return x if isinstance(x, _Interval) else _Interval(x, x)


def _tile_bounds(leaf: torch.Tensor, axes: tuple, tile: int) -> _Interval:
    """``leaf``'s bounds over each tile: its query and key axes reduced to ``ceil(S/tile)`` blocks."""
    lo = hi = leaf
    for dim in (d for d in axes if d is not None and leaf.shape[d] != 1):
        n = leaf.shape[dim]
        blocks = -(-n // tile)

        def blocked(x: torch.Tensor, dim: int = dim) -> torch.Tensor:
            x = x.movedim(dim, -1)
            if blocks * tile > n:  # the last block padded with its own last value: the bounds do not move
                x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], blocks * tile - n)], dim=-1)
            return x.reshape(*x.shape[:-1], blocks, tile)

        lo = blocked(lo).amin(-1).movedim(-1, dim) if lo.dtype != torch.bool else blocked(lo).all(-1).movedim(-1, dim)
        hi = blocked(hi).amax(-1).movedim(-1, dim) if hi.dtype != torch.bool else blocked(hi).any(-1).movedim(-1, dim)
    return _Interval(lo, hi)


def _cmp(name: str, a: _Interval, b: _Interval) -> _Interval:
    if name in ("gt", "__gt__"):
        return _cmp("lt", b, a)
    if name in ("ge", "__ge__"):
        return _cmp("le", b, a)
    if name in ("lt", "__lt__"):
        return _Interval(a.hi < b.lo, a.lo < b.hi)
    if name in ("le", "__le__"):
        return _Interval(a.hi <= b.lo, a.lo <= b.hi)
    point = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
    overlap = (a.lo <= b.hi) & (b.lo <= a.hi)
    if name in ("eq", "__eq__"):
        return _Interval(point, overlap)
    return _Interval(~overlap, ~point)  # ne


def _mul(a: _Interval, b: _Interval) -> _Interval:
    products = [a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi]
    lo, hi = products[0], products[0]
    for p in products[1:]:
        lo, hi = torch.minimum(torch.as_tensor(lo), torch.as_tensor(p)), torch.maximum(torch.as_tensor(hi), torch.as_tensor(p))
    return _Interval(lo, hi)


def _where(c: _Interval, a: _Interval, b: _Interval) -> _Interval:
    lo = torch.where(c.lo, a.lo, torch.where(c.hi, torch.minimum(torch.as_tensor(a.lo), torch.as_tensor(b.lo)), b.lo))
    hi = torch.where(c.lo, a.hi, torch.where(c.hi, torch.maximum(torch.as_tensor(a.hi), torch.as_tensor(b.hi)), b.hi))
    return _Interval(lo, hi)


def _monotone(fn: Any) -> Any:
    return lambda a: _Interval(fn(torch.as_tensor(a.lo)), fn(torch.as_tensor(a.hi)))


#: bounds of an op's result from its arguments' bounds, per op name (of the program's torch calls)
_INTERVAL_RULES: dict[str, Any] = {
    **{n: (lambda n: lambda a, b: _cmp(n, a, b))(n) for n in (
        "lt", "le", "gt", "ge", "eq", "ne", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__")},
    **dict.fromkeys(("and_", "logical_and", "bitwise_and", "__and__"), lambda a, b: _Interval(a.lo & b.lo, a.hi & b.hi)),
    **dict.fromkeys(("or_", "logical_or", "bitwise_or", "__or__"), lambda a, b: _Interval(a.lo | b.lo, a.hi | b.hi)),
    **dict.fromkeys(("invert", "not_", "logical_not", "bitwise_not", "__invert__"), lambda a: _Interval(~torch.as_tensor(a.hi), ~torch.as_tensor(a.lo))),
    **dict.fromkeys(("add", "__add__", "__radd__"), lambda a, b: _Interval(a.lo + b.lo, a.hi + b.hi)),
    **dict.fromkeys(("sub", "__sub__"), lambda a, b: _Interval(a.lo - b.hi, a.hi - b.lo)),
    **dict.fromkeys(("rsub", "__rsub__"), lambda a, b: _Interval(b.lo - a.hi, b.hi - a.lo)),
    **dict.fromkeys(("neg", "__neg__"), lambda a: _Interval(-a.hi, -a.lo)),
    "pos": lambda a: a,
    **dict.fromkeys(("mul", "__mul__", "__rmul__"), _mul),
    "where": _where,
    "masked_fill": lambda x, mask, value: _where(mask, value, x),
    **{n: _monotone(getattr(torch, n)) for n in ("tanh", "exp", "sigmoid")},
}


def _grid(x: Any, nq: int, nk: int, reduce: str) -> torch.Tensor:
    """A per-tile bool over the grid ``[nq, nk]``, reduced over batch and heads (``"any"``/``"all"``)."""
    x = torch.as_tensor(x)
    x = x.reshape((1,) * max(0, 2 - x.dim()) + tuple(x.shape))
    if x.dim() > 2:
        x = getattr(x.flatten(0, -3), reduce)(0)
    return x.expand(nq, nk)


def _interval_live(
    prog: ScoreProgram, leaves: list, tile: int, q_len: int, kv_len: int, q_off: int = 0, k_off: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(live, full, finite)``, ``[ceil(q_len/tile), ceil(kv_len/tile)]`` each: ``live`` (int8)
    :data:`LIVE` for the tiles whose logits may be unmasked - the program evaluated once, on
    bounds over each tile (an interval per tile of the grid) - and :data:`LIVE_NO_BIAS` for those
    among them where an additive program's bias is 0 everywhere (the tile is then computed
    without a mask); ``full`` (bool) for the tiles whose every logit is unmasked; ``finite`` for
    those that may hold a logit above ``-inf`` (a masked tile without it is ``-inf`` throughout).
    A tile it cannot prove masked is live: computing a tile the mask covers changes nothing.
    Raises :class:`_NoIntervalRule` for an op without bounds."""
    regs: list[Any] = []
    bounds = [_tile_bounds(leaf, axes, tile) for leaf, axes in zip(leaves, prog.leaf_axes)]
    nq, nk = -(-q_len // tile), -(-kv_len // tile)
    for kind, name, args, kwargs, dep in prog.instructions:
        a = [_resolve(x, regs, bounds, _Interval(_ZERO, _ZERO)) for x in args]
        if kwargs:
            raise _NoIntervalRule(name)
        if dep and prog.heads is not None:
            a = [_Interval(prog._rank_heads(x.lo), prog._rank_heads(x.hi)) if isinstance(x, _Interval) else x for x in a]
        if kind == "special":
            value = _interval_special(name, a, tile, nq, nk, q_off, k_off)
        elif name in _INTERVAL_RULES:
            value = _INTERVAL_RULES[name](*[_bounds(x) for x in a])
        else:
            raise _NoIntervalRule(name)
        regs.append(value)
    out = _bounds(_resolve(prog.out, regs, bounds, _Interval(_ZERO, _ZERO)))
    live = _grid(out.hi > MASKED, nq, nk, "any").to(torch.int8)
    full = _grid(torch.as_tensor(out.lo) > MASKED, nq, nk, "all")
    finite = _grid(torch.as_tensor(out.hi) > -math.inf, nq, nk, "any")
    if prog.additive is not None:  # the bias's bounds: 0 everywhere in the tile, for every batch and head?
        bias = _Interval(_ZERO, _ZERO)
        for op, *a in prog.additive[1]:
            x = _bounds(_resolve(a[0], regs, bounds, None))
            if prog.heads is not None:
                x = _Interval(prog._rank_heads(x.lo), prog._rank_heads(x.hi))
            if op == "add":
                bias = _INTERVAL_RULES["add"](bias, x)
            elif op == "sub":
                bias = _INTERVAL_RULES["sub"](bias, x)
            elif op == "keep":
                bias = _where(x, bias, _bounds(torch.tensor(a[1])))
            else:
                bias = _where(x, _bounds(torch.tensor(a[1])), bias)
        zero = _grid((torch.as_tensor(bias.lo) == 0) & (torch.as_tensor(bias.hi) == 0), nq, nk, "all")
        live = torch.where(zero & (live > 0), LIVE_NO_BIAS, live)
    return live, full, finite


def _interval_special(name: str, a: list, tile: int, nq: int, nk: int, q_off: int = 0, k_off: int = 0) -> _Interval:
    if name == "to":
        x, dtype = _bounds(a[0]), a[1]
        return _Interval(torch.as_tensor(x.lo).to(dtype), torch.as_tensor(x.hi).to(dtype))
    if name == "const":
        return _bounds(ScoreProgram._special(name, a, None))
    if name in ("tril", "triu"):  # kv - q <= k (>= k) over the tile's rows and columns
        x, k = _bounds(a[0]), a[1]
        rows, cols = torch.arange(nq)[:, None] * tile + q_off, torch.arange(nk)[None, :] * tile + k_off
        q, kv = _Interval(rows, rows + tile - 1), _Interval(cols, cols + tile - 1)
        d = _INTERVAL_RULES["sub"](kv, q)
        keep = _cmp("le", d, _bounds(torch.tensor(k))) if name == "tril" else _cmp("ge", d, _bounds(torch.tensor(k)))
        zero = _bounds(torch.zeros((), dtype=torch.as_tensor(x.lo).dtype))
        return _where(keep, x, zero)
    if name in ("expand_lead", "reshape_lead", "index"):
        x = _bounds(a[0])
        return _Interval(*(ScoreProgram._special(name, [torch.as_tensor(v), *a[1:]], None) for v in (x.lo, x.hi)))
    raise _NoIntervalRule(name)


def live_map(
    prog: ScoreProgram, leaves: list, tile: int, q_len: int, kv_len: int, q_off: int = 0, k_off: int = 0, full: bool = False
) -> torch.Tensor:
    """``[ceil(q_len/tile), ceil(kv_len/tile)]`` (int8) for the query rows ``[q_off, q_off+q_len)``
    and key columns ``[k_off, k_off+kv_len)`` of the sequence (``leaves``, on the host, hold every
    position): 0 for a tile the mask covers whole, :data:`LIVE` for one to compute,
    :data:`LIVE_NO_BIAS` for one whose bias is 0 throughout (see :func:`_interval_live`). With
    ``full``: ``(map, full, finite)`` (see :func:`_interval_live`)."""
    leaves = prog.leaf_tiles(leaves, q_off, q_off + q_len, k_off, k_off + kv_len)  # over these rows and columns
    with torch.no_grad():
        try:
            live, whole, finite = _interval_live(prog, leaves, tile, q_len, kv_len, q_off, k_off)
        except _NoIntervalRule:
            nq, nk = -(-q_len // tile), -(-kv_len // tile)
            live = torch.zeros((nq, nk), dtype=torch.int8)
            whole, finite = torch.zeros((nq, nk), dtype=torch.bool), torch.zeros((nq, nk), dtype=torch.bool)
            for i, q0 in enumerate(range(0, q_len, tile)):
                any_, all_, fin = _probe_block(prog, leaves, q0, min(q0 + tile, q_len), kv_len, tile, q_off, k_off)
                live[i], whole[i], finite[i] = any_.to(torch.int8), all_, fin
    return (live, whole, finite) if full else live


def keyless_rows(
    prog: ScoreProgram, leaves: list, tile: int, live: torch.Tensor, full: torch.Tensor, finite: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """``[seq_len]`` bools: the query rows that may have no unmasked key in some batch row or head
    while their masked logits may be finite (a fill such as ``finfo.min``; under ``-inf`` such a
    row is simply 0). ``live``, ``full``, ``finite``: :func:`live_map` of the whole sequence
    against itself. A block of rows with a tile the mask leaves whole has a key in every row; the
    others are evaluated element by element over their live tiles: rows with no unmasked logit
    there, and a finite one there or in a skipped tile of the block."""
    keyless = torch.zeros(seq_len, dtype=torch.bool)
    with torch.no_grad():
        for i, q0 in enumerate(range(0, seq_len, tile)):
            if bool(full[i].any()):
                continue
            q1 = min(q0 + tile, seq_len)
            keyed, filled = None, bool((finite[i] & (live[i] == 0)).any())
            for j in torch.nonzero(live[i]).flatten().tolist():
                probe = _probe(prog, leaves, q0, q1, j * tile, min((j + 1) * tile, seq_len))
                alive = (probe > MASKED).any(-1)  # [..., rows]
                keyed = alive if keyed is None else keyed | alive
                filled = filled or bool(((probe <= MASKED) & (probe > -math.inf)).any())
            if filled:
                keyless[q0:q1] = True if keyed is None else ~keyed.reshape(-1, q1 - q0).all(0)
    return keyless


def mark_fill(live: torch.Tensor, finite: torch.Tensor, keyless: torch.Tensor, q_off: int, q_len: int, tile: int) -> torch.Tensor:
    """``live`` (the map of rows ``[q_off, q_off+q_len)``) with, in every block of rows holding a
    :func:`keyless_rows` row, each tile to compute - live, or skipped but possibly holding a finite
    fill value (``finite``) - marked :data:`FILL`: such a row's softmax runs over the fill values of
    every key, and the whole block runs interpreted (see :mod:`.tile_kernels`)."""
    rows = keyless[q_off:q_off + q_len]
    if not bool(rows.any()):
        return live
    pad = -(-q_len // tile) * tile - q_len
    blocks = torch.cat([rows, rows.new_zeros(pad)]).view(-1, tile).any(1)  # [nq]
    return torch.where(blocks[:, None] & ((live != 0) | finite), FILL, live).to(torch.int8)


def exactly_causal(prog: ScoreProgram, leaves: list, tile: int, live: torch.Tensor, seq_len: int) -> bool:
    """Whether the program's logits are ``s * scale`` under a plain causal mask, for these leaves
    (on the host): its map (``live``, of the whole sequence against itself) says every tile below
    the diagonal has a bias of 0 throughout and every tile above it is masked, and on each diagonal
    tile, evaluated element by element, the bias is 0 on and below the diagonal and masked above
    it - for every batch row and head. Then attention is SDPA's ``is_causal`` (what Hugging Face's
    mask builder makes of rows with no padding and one document: data decides it, so it is decided
    per step)."""
    n = live.shape[0]
    if prog.additive is None or live.shape != (n, n) or not _causal_pattern(live):
        return False
    fine = min(_FINE_TILE, tile)
    cpu = torch.device("cpu")
    with torch.no_grad():
        for q0 in range(0, seq_len, tile):  # each diagonal tile: its sub-tiles from bounds, their diagonal one by one
            q1 = min(q0 + tile, seq_len)
            if tile > fine and not _causal_pattern(live_map(prog, leaves, fine, q1 - q0, q1 - q0, q0, q0)):
                return False
            for f0 in range(q0, q1, fine):
                f1 = min(f0 + fine, q1)
                bias = prog.bias(prog.leaf_tiles(leaves, f0, f1, f0, f1), tile_positions(prog, f0, f1, f0, f1, cpu), torch.float32)
                if bias is None:
                    return False
                keep = torch.ones(f1 - f0, f1 - f0, dtype=torch.bool).tril()
                if not bool((bias.masked_fill(~keep, 0.0) == 0).all()) or not bool((bias.masked_fill(keep, MASKED) <= MASKED).all()):
                    return False
    return True


#: rows and columns of the sub-tiles :func:`exactly_causal` bounds a diagonal tile with
_FINE_TILE = 32


def _causal_pattern(live: torch.Tensor) -> bool:
    """Every tile below the diagonal live with a bias of 0, every tile above it masked."""
    n = live.shape[0]
    below = torch.ones(n, n, dtype=torch.bool).tril(-1)
    return bool((live[below] == LIVE_NO_BIAS).all()) and not bool(live[below.T].any())


def is_causal_map(rows: list[list[int]]) -> bool:
    """Whether a live-tile map (as lists) was marked exactly causal (its diagonal :data:`CAUSAL`)."""
    return bool(rows) and all(row[i] == CAUSAL for i, row in enumerate(rows))


def sequence_map(prog: ScoreProgram, leaves: list, tile: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(map, keyless)`` of the whole sequence against itself, ``leaves`` on the host: the live
    tiles with :data:`FILL` where a row may have no key, the diagonal :data:`CAUSAL` for a mask
    exactly causal; ``keyless`` from :func:`keyless_rows`."""
    live, full, finite = live_map(prog, leaves, tile, seq_len, seq_len, full=True)
    keyless = keyless_rows(prog, leaves, tile, live, full, finite, seq_len)
    if exactly_causal(prog, leaves, tile, live, seq_len):
        live = live.clone()
        live.diagonal().fill_(CAUSAL)
        return live, keyless
    return mark_fill(live, finite, keyless, 0, seq_len, tile), keyless


@torch.library.custom_op("autosp_attn::live_tiles", mutates_args=())
def live_tiles(leaves: list[torch.Tensor], program: str, tile: int, q_len: int, kv_len: int) -> torch.Tensor:
    """The map of the tiles of (query rows x key columns) of the whole sequence that
    :func:`~autosp.ops.tiled_attention.tiled_attention` computes (nonzero), **on the host**: the
    leaves are copied there once (:func:`~autosp.ops.kernels.to_host`: the one read of the device
    this mask costs per step, shared by every attention that reads it) and every data-dependent
    choice is made from the map, never from the device. Tiles whose logits the mask may leave
    unmasked, from the program's bounds over each tile (:func:`_interval_live`, which also marks
    the tiles where a bias is 0 throughout), or element by element for a program with an op
    interval arithmetic does not cover; :data:`FILL` where a row may have no key; a mask exactly
    causal (:func:`exactly_causal`) gets its diagonal marked :data:`CAUSAL`."""
    if q_len != kv_len:
        raise ValueError(f"live_tiles: self-attention only, got {q_len} query rows and {kv_len} keys")
    prog = ScoreProgram.parse(program)
    return sequence_map(prog, to_host(leaves), tile, q_len)[0]


@live_tiles.register_fake
def _(leaves, program, tile, q_len, kv_len):
    return torch.empty(((q_len + tile - 1) // tile, (kv_len + tile - 1) // tile), dtype=torch.int8, device="cpu")
