"""The Ulysses sequence-parallel pass on Dynamo (torch IR) graphs.

``sequence_parallel_pass(gm, sp_size=..., sp_rank=..., group_name=...)`` rewrites a graph written
for one device into the graph one SP rank runs:

* graph inputs are replicated; activations become sequence-sharded at the first token-wise
  op (embedding, linear, norm) that sees the sequence dim, by slicing its input;
* replicated tensors that meet sharded ones (labels, position ids, RoPE tables) are sliced the
  same way, so positions, label shifts and masks built from ``arange`` are right on every rank;
* every ``F.scaled_dot_product_attention`` gets an all-to-all on q, k, v
  (``[B, H, S/P, D] -> [B, H/P, S, D]`` with ``P = sp_size``) and one on its output (the reverse);
  KV heads the model repeats for attention (``repeat_kv``) are exchanged before the repeat;
* reductions over the sequence (``sum``, ``mean``, ``cross_entropy``/``nll_loss`` with any
  reduction and ``ignore_index``) are combined over the SP group, token-weighted;
  ``cross_entropy`` of a ``linear`` whose logits nothing else reads is computed in chunks of
  tokens, so the logits never exist whole (:mod:`autosp.ops.fused_loss`);
* a slice of a sharded tensor on the sequence (``logits[:, :-1]``) keeps every token where it is
  and is tracked as an uneven shard (see :mod:`.placement`): no token is lost at a boundary;
* an op the pass has no rule for gets its sharded inputs all-gathered and runs replicated -
  correct, only slower - and is reported in :attr:`SPPassStats.fallbacks`;
* an in-place op runs exactly on the local value or is refused (:mod:`.inplace`);
* graph outputs are all-gathered, so code outside the graph sees full-sequence values.

The pass is a driver (this module: visit the graph in order, ask the rule registered for each
op, fall back, check the postcondition), the state every rule sees (:class:`~.rewrite.SPRewrite`),
a :class:`~.redistribute.Redistributor` (slices and gathers between placements) and the rules
(:mod:`.sp_rules`, one registered per op). ``docs/pass-internals.md`` shows how to add an op.

Postcondition (checked, :class:`~autosp.errors.AutoSPError` otherwise): every SDPA
reads its q, k, v from an all-to-all and feeds one; the graph lints.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.errors import AutoSPError, GraphSplitError, NoSequenceDim, user_source
from autosp.layout import check_sequence_fits
from autosp.passes.chunks import merge_row_chunks
from autosp.passes.inplace import mutated_input, visit_inplace
from autosp.passes.placement import RANK_LOCAL, hinted_bytes, is_tensor, shape_exprs
from autosp.passes.rewrite import SPPassStats, SPRewrite
from autosp.layout import AttentionLayout, choose_attention_layout, validate_sp_layout
from autosp.passes.attention_schemes import DEFAULT_SCHEME, AttentionScheme, get_scheme
from autosp.passes.attention_schemes.ring import RING_ATTENTION
from autosp.passes.attention_schemes.ulysses import SEQ_GATHER, SEQ_SCATTER
from autosp.passes.sp_rules import SDPA, lookup
from autosp.passes.sp_rules.attention import TILED_ATTENTION
from autosp.passes.sp_rules.expert_dispatch import emit_dispatch, match_dispatch, starts_dispatch
from autosp.passes.sp_rules.manual_attention import expected_all_to_alls, find_manual_attention, rewrite_manual_attention

__all__ = [
    "sequence_parallel_pass", "SPPassStats", "SPRewrite", "find_sequence_symbol", "attention_offset", "attention_layout",
    "attention_heads", "SDPA", "SEQ_GATHER", "SEQ_SCATTER",
]

log = logging.getLogger(__name__)


def find_sequence_symbol(gm: fx.GraphModule, seq_dim: int) -> Optional[sympy.Symbol]:
    """The SymInt symbol of the sequence length: the symbol at ``seq_dim`` of the graph's
    (non-parameter) tensor inputs. ``None`` if no input has a symbolic sequence dim, or if
    several do and the graph has no attention (it then runs replicated, which is correct)."""
    seen: Counter = Counter()
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("example_value")
        if is_tensor(val) and not isinstance(val, torch.nn.Parameter) and val.dim() > seq_dim:
            expr = shape_exprs(val)[seq_dim]
            if isinstance(expr, sympy.Symbol):
                seen[expr] += 1
    if not seen:
        return None
    (best, n), *rest = seen.most_common()
    if rest and rest[0][1] == n:
        if not _attention_lengths(gm):
            return None  # e.g. a metric update after a graph break: run it replicated, unchanged
        for node, q, length in _attention_lengths(gm):
            if not length.free_symbols:  # the inputs were cut to a fixed length: say so, not "several sizes"
                raise _unrelated_length(node, q, length, best)
        raise GraphSplitError(
            f"AutoSP found several symbolic sizes at seq_dim={seq_dim} of the graph inputs "
            f"({', '.join(str(s) for s in seen)}); inputs must share one sequence length. "
            "Check `seq_dim` or make the batch's tensors the same length."
        )
    return best


def attention_offset(gm: fx.GraphModule, seq: sympy.Symbol) -> int:
    """``k`` such that every attention of ``gm`` runs over ``seq + k`` positions: the sequence
    the pass splits. ``k`` is 0 when the model runs on the batch as it is and, e.g., -1 when
    the step slices the batch before the model (``model(tokens[:, :-1])``); 0 without attention.

    Raises :class:`AutoSPError` when attention runs over a length the pass cannot relate to the
    batch's (a fixed size, or not the batch's length plus a constant), or over several lengths.
    """
    found: dict[int, fx.Node] = {}
    for node, q, length in _attention_lengths(gm):
        k = sympy.expand(length - seq)
        if not k.is_Integer:
            raise _unrelated_length(node, q, length, seq)
        found.setdefault(int(k), node)
    if len(found) > 1:
        lengths = ", ".join(f"{seq + k} ({n.name})" for k, n in sorted(found.items()))
        raise AutoSPError(
            f"AutoSP found attention over sequences of different lengths in one graph: {lengths}. It splits one "
            "sequence per step; run attention on the same tokens everywhere (slice the batch once, before the model)."
        )
    return next(iter(found), 0)


def _attention_lengths(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node, sympy.Expr]]:
    """``(attention, query, the query's sequence length)`` for every attention of ``gm``: SDPA
    calls and hand-written attention (its first matmul)."""
    out = []
    for node in gm.graph.find_nodes(op="call_function", target=SDPA):
        q = node.args[0] if node.args else node.kwargs.get("query")
        val = q.meta.get("example_value") if isinstance(q, fx.Node) else None
        if is_tensor(val) and val.dim() >= 2:  # else the attention rule reports it
            out.append((node, q, shape_exprs(val)[val.dim() - 2]))
    for attn in find_manual_attention(gm):
        out.append((attn.first, attn.q, shape_exprs(attn.q.meta["example_value"])[-2]))
    return out


def _unrelated_length(node: fx.Node, q: fx.Node, length: sympy.Expr, seq: sympy.Symbol) -> AutoSPError:
    fixed = not length.free_symbols
    return GraphSplitError(
        f"{node.name}: attention runs over {length} positions (query {q.name}, shape "
        f"{list(shape_exprs(q.meta['example_value']))}), " + ("a fixed number" if fixed else "a length")
        + f" AutoSP cannot relate to the batch's sequence length {seq}; it splits a sequence whose length "
        "follows the batch's (the batch itself, or a slice of it with fixed ends).\n"
        + user_source(node) + "\n"
        + "Slice the batch relative to its length (`tokens[:, :-1]`, `tokens[:, 1:]`), not up to a fixed "
        "position (`tokens[:, :block_size]`): cut the batch to its length in the data pipeline instead."
    )


def attention_heads(gm: fx.GraphModule) -> list[int]:
    """The query heads of every attention of ``gm`` whose heads are static (SDPA and hand-written)."""
    out = []
    for node, q, _ in _attention_lengths(gm):
        shape = shape_exprs(q.meta["example_value"])
        if len(shape) >= 3 and shape[-3].is_Integer:
            out.append(int(shape[-3]))
    return out


def attention_layout(
    gm: fx.GraphModule, sp_size: int, sp_layout: Optional[tuple[int, int]] = None, max_ulysses: Optional[int] = None
) -> AttentionLayout:
    """How the SP group splits the attention of ``gm``: ``sp_layout`` as given, or the default for
    its heads (:func:`~autosp.layout.choose_attention_layout`)."""
    if sp_layout is not None:
        ulysses, ring = validate_sp_layout(sp_layout, sp_size)
        return AttentionLayout(ulysses, ring)
    return choose_attention_layout(sp_size, attention_heads(gm), max_ulysses)


def _run(rw: SPRewrite) -> fx.Graph:
    """Visit the old graph in order; every node gets its new value and placement."""
    for node in rw.gm.graph.nodes:
        if node.op == "placeholder":
            new = rw.copy(node)
            new.meta.update(node.meta)
            rw.record(node, new, rw.replicated_placement(node))
        elif node.op == "output":
            rw.graph.output(fx.map_arg(node.args[0], rw.redistribute.to_replicate))
        elif node.op == "get_attr":
            rw.record(node, rw.copy(node), rw.replicated_placement(node))
        else:
            _visit(rw, node)
    # in-place ops have no users; keep them
    rw.graph.eliminate_dead_code(is_impure_node=lambda n: n in rw.mutations or n.is_impure())
    return rw.graph


def _visit(rw: SPRewrite, node: fx.Node) -> None:
    if node.op == "call_function":
        _refuse_attention_in_subgraph(rw.gm, node)
    attn = rw.manual.get(node)
    if attn is not None:  # hand-written attention: the whole chain is emitted at its last matmul
        if node is attn.last:
            rw.record(node, *rewrite_manual_attention(rw, attn))
        else:  # read only by the next step of the chain (checked by the match)
            rw.record(node, None, None)
        return
    if node not in rw.dispatch and starts_dispatch(node):
        region = match_dispatch(rw, node)
        if region is not None:  # a mixture-of-experts dispatch: run on the rank's own rows
            rw.dispatch.update(dict.fromkeys(region.roles, region))
            rw.stats.expert_dispatch += 1
    region = rw.dispatch.get(node)
    if region is not None:
        return rw.record(node, *emit_dispatch(rw, region, node))
    local = [n.name for n in node.all_input_nodes if rw.placements.get(n) is RANK_LOCAL]
    if local:
        raise AutoSPError(f"internal: {node.name} reads {local}, values local to a mixture-of-experts dispatch")
    mutated = mutated_input(rw, node)
    if mutated is not None:
        return visit_inplace(rw, node, mutated, lookup)
    found = lookup(node)
    sharded_input = any(rw.is_shard(n) for n in rw.tensor_inputs(node))
    if not sharded_input and not (found is not None and found[1].source):
        # nothing sharded flows in: run as on one device (indices, masks, RoPE tables).
        placement = rw.replicated_placement(node)
        if node.target is operator.getitem and isinstance(rw.placements.get(node.args[0]), tuple):
            placement = rw.placements[node.args[0]][node.args[1]]
        rw.record(node, rw.copy(node), placement)
        return
    if found is None:
        return _fallback(rw, node, "no sequence-parallel rule")
    call, rule = found
    result = rule(rw, node, call)
    if result is None:
        return _fallback(rw, node, "unsupported arguments")
    rw.record(node, *result)


def _fallback(rw: SPRewrite, node: fx.Node, why: str) -> None:
    """Gather every sharded input and run the op replicated (always correct)."""
    what = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    rw.stats.fallbacks.append(f"{node.name} ({what}): {why}")
    held = [rw.val(n) for n in rw.tensor_inputs(node) if rw.is_shard(n)]
    out = rw.val(node)
    held += [v for v in (out if isinstance(out, (tuple, list)) else (out,)) if is_tensor(v)]
    rw.stats.fallback_bytes.append(sum(hinted_bytes(v) for v in held))
    rw.stats.fallback_sources.append(user_source(node))
    gather = rw.redistribute.to_replicate
    new = rw.copy(node, fx.map_arg(node.args, gather), fx.map_arg(node.kwargs, gather))
    rw.record(node, new, rw.replicated_placement(node))


def describe_fallbacks(stats: SPPassStats, only: Optional[set[int]] = None) -> list[str]:
    """One line per op run replicated (those at indices ``only``, default all): what it is, the
    bytes a rank holds for it at the compiled length, and the user's line that wrote it."""
    return [
        f"  {what}; {nbytes / 2**20:.2f} MiB per rank at the compiled length, at\n    "
        + source.replace("\n", "\n    ")
        for i, (what, nbytes, source) in enumerate(zip(stats.fallbacks, stats.fallback_bytes, stats.fallback_sources))
        if only is None or i in only
    ]


def _calls_attention(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` or a sub-graph it holds (``get_attr``) calls SDPA."""
    for n in gm.graph.nodes:
        if n.target is SDPA:
            return True
        if n.op == "get_attr":
            sub = getattr(gm, n.target, None)
            if isinstance(sub, fx.GraphModule) and _calls_attention(sub):
                return True
    return False


def _refuse_attention_in_subgraph(gm: fx.GraphModule, node: fx.Node) -> None:
    """Attention inside a higher-order op (e.g. torch.utils.checkpoint) cannot be rewritten."""
    for a in node.args:
        if isinstance(a, fx.Node) and a.op == "get_attr":
            sub = getattr(gm, a.target, None)
            if isinstance(sub, fx.GraphModule) and _calls_attention(sub):
                raise AutoSPError(
                    f"{node.name}: attention runs inside `{getattr(node.target, '__name__', node.target)}` (sub-graph "
                    f"{a.target}), a higher-order op AutoSP does not rewrite inside (regions under torch.utils.checkpoint "
                    "are put in place first; this is another kind). Call attention outside it."
                )


def _check_postcondition(graph: fx.Graph, stats: SPPassStats, manual_all_to_alls: int, scheme: AttentionScheme) -> None:
    """Every attention reads its inputs through the scheme's exchange and hands its output to the
    exchange back; the exchanges counted are those the rules asked for."""
    graph.lint()
    for n in graph.find_nodes(op="call_function", target=SDPA):
        if not all(scheme.reads_exchanged(a) for a in n.args[:3]) or not all(scheme.writes_exchanged(u) for u in n.users):
            raise AutoSPError(f"internal: attention {n.name} was not fully rewritten for sequence parallelism")
    tiled = graph.find_nodes(op="call_function", target=TILED_ATTENTION)
    ring = graph.find_nodes(op="call_function", target=RING_ATTENTION)
    for n in (*tiled, *ring):  # its output reaches the exchange through getitem 0
        outputs = [v for u in n.users for v in u.users]
        if not all(scheme.reads_exchanged(a) for a in n.args[:3]) or not outputs or not all(scheme.writes_exchanged(v) for v in outputs):
            raise AutoSPError(f"internal: tiled attention {n.name} was not fully rewritten for sequence parallelism")
    if len(tiled) != stats.tiled_attention or len(ring) != stats.ring_attention:
        raise AutoSPError(
            f"internal: {len(tiled)} tiled and {len(ring)} ring attention ops for {stats.tiled_attention} tiled and "
            f"{stats.ring_attention} ring attention calls"
        )
    if scheme.owns_attention and stats.ring_attention != stats.attention:
        raise AutoSPError(f"internal: {stats.attention} attention calls, {stats.ring_attention} of them in the ring kernel")
    if stats.all_to_all != 4 * stats.sdpa + manual_all_to_alls + stats.mixer_all_to_alls:
        raise AutoSPError(
            f"internal: {stats.all_to_all} all-to-alls for {stats.sdpa} attention calls (4 each) and "
            f"{stats.manual_attention} hand-written ones ({manual_all_to_alls} in all)"
        )


def _check_example_fits(gm: fx.GraphModule, seq: sympy.Symbol, sp_size: int, shift: int, offset: int) -> None:
    """The batch this graph is compiled for must leave the last rank more than ``shift`` tokens
    of the ``seq + offset`` the pass splits (later batches are checked by the strategy before
    each step, against the known shift and offset)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("example_value")
        sizes = val.shape if is_tensor(val) else (val,)
        for size in sizes:
            if isinstance(size, torch.SymInt) and size.node.expr == seq and size.node.hint is not None:
                try:
                    check_sequence_fits(int(size.node.hint) + offset, sp_size, shift)
                except ValueError as exc:
                    raise AutoSPError(str(exc)) from None
                return


def sequence_parallel_pass(
    gm: fx.GraphModule,
    example_inputs: Any = None,
    *,
    sp_size: int,
    sp_rank: int,
    group_name: str,
    seq_dim: int = 1,
    loss_chunk: Optional[int] = 0,
    kv_before_repeat: bool = True,
    native_gqa: Optional[bool] = None,
    attention_tile: Optional[int] = 0,
    strict: bool = False,
    attention_scheme: Optional[str] = None,
    sp_layout: Optional[tuple[int, int]] = None,
    max_ulysses: Optional[int] = None,
    zigzag: bool = True,
) -> fx.GraphModule:
    """Rewrite a Dynamo graph for Ulysses sequence parallelism (see the module docstring).

    Graphs without a symbolic sequence dim in their inputs are returned unchanged, unless they
    call SDPA, which is an error (the strategy marks the sequence dim dynamic before tracing).
    The returned module carries :class:`SPPassStats` in ``meta["autosp"]``. ``loss_chunk`` is the
    number of tokens per chunk of a fused vocabulary projection and loss (``0``: chosen from the
    vocabulary size, ``None``: never fuse; see :mod:`autosp.ops.fused_loss`).
    ``kv_before_repeat=False`` exchanges k and v as attention receives them, after the model's
    own repeat of the KV heads, as hand-written Ulysses around an attention function does (the
    benchmarks' memory model of that baseline); the default exchanges them before the repeat.
    KV heads exchanged before the repeat are then repeated on the rank's heads, or, with
    ``native_gqa``, handed to attention unrepeated with ``enable_gqa=True`` (attention reads
    query head ``i`` against KV head ``i // n_rep``, the same heads as the repeat): no repeated
    copy, in forward or backward. ``None`` (default) does so where that attention kernel was
    verified here - CPU tensors (the CPU flash kernel computes grouped heads itself) - and
    repeats elsewhere (on CUDA some attention backends would fall back to the math kernel).
    ``attention_tile``: attention with a mask built from positions (SDPA's ``attn_mask``, the
    mask or score terms of hand-written attention) runs in
    :func:`~autosp.ops.tiled_attention.tiled_attention` with tiles of this many rows and
    columns (``0``: automatic; ``None``: masks stay dense ``S x S`` tensors, as before).
    ``strict``: an op the pass would run replicated (its sharded inputs all-gathered) is an
    :class:`AutoSPError` naming it, its bytes per rank and the line that wrote it.
    ``sp_layout``: ``(ulysses, ring)``, how the SP group splits attention (``None``: the largest
    Ulysses degree that divides ``sp_size``, every attention's heads and ``max_ulysses``, the
    devices per node; :func:`~autosp.layout.choose_attention_layout`). With a ring level every
    attention runs in the ring kernel (:mod:`.attention_schemes.ring`; ``zigzag``: head-tail
    segments, else contiguous). ``attention_scheme``: a registered scheme by name, instead of the
    one the layout implies (``"ulysses"`` for ``ring=1``, ``"ring"`` otherwise).
    """
    if sp_size < 1 or not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} must lie in [0, sp_size={sp_size})")
    try:
        return _rewrite(
            gm, sp_size, sp_rank, group_name, seq_dim, loss_chunk, kv_before_repeat, native_gqa, attention_tile, strict,
            attention_scheme, sp_layout, max_ulysses, zigzag,
        )
    except GraphSplitError as exc:
        exc.graph_has_loss = _computes_loss(gm)
        raise


def _computes_loss(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` computes a loss: then a graph break that ended it came after the loss."""
    for n in gm.graph.nodes:
        name = getattr(n.target, "__name__", str(n.target)) if n.op == "call_function" else ""
        if name in ("cross_entropy", "nll_loss") or name.endswith("_loss"):
            return True
    return False


def _rewrite(
    gm: fx.GraphModule, sp_size: int, sp_rank: int, group_name: str, seq_dim: int, loss_chunk: Optional[int],
    kv_before_repeat: bool, native_gqa: Optional[bool], attention_tile: Optional[int], strict: bool,
    attention_scheme: Optional[str], sp_layout: Optional[tuple[int, int]], max_ulysses: Optional[int], zigzag: bool,
) -> fx.GraphModule:
    seq = find_sequence_symbol(gm, seq_dim)
    manual = find_manual_attention(gm)
    n_sdpa = len(gm.graph.find_nodes(op="call_function", target=SDPA)) + len(manual)
    if seq is None:
        if n_sdpa:
            fixed = tuple(sorted({  # inputs marked dynamic at seq_dim that Dynamo made static
                int(size) for n in gm.graph.find_nodes(op="placeholder")
                if is_tensor(v := n.meta.get("example_value")) and v.dim() > seq_dim
                and (size := shape_exprs(v)[seq_dim]).is_Integer
                and seq_dim in getattr(getattr(n.meta.get("grapharg"), "example", None), "_dynamo_dynamic_indices", ())
            }))
            raise NoSequenceDim(
                f"AutoSP found {n_sdpa} attention call(s) in a graph with no input with a symbolic "
                f"sequence length at seq_dim={seq_dim}, so it cannot tell which dim to split. This happens "
                "when a graph break splits the model before an attention (the graph after the break sees "
                "intermediate tensors of fixed size), or when the model runs outside AutoSPStrategy (which "
                "marks the sequence dim of the batch dynamic) or with the wrong `seq_dim`.",
                fixed,
            )
        gm.meta["autosp"] = SPPassStats()
        return gm
    merged = merge_row_chunks(gm)  # chunked losses as one op over the rows (exact; see passes/chunks.py)
    offset = attention_offset(gm, seq)
    layout = attention_layout(gm, sp_size, sp_layout, max_ulysses)
    if attention_scheme is None:
        attention_scheme = DEFAULT_SCHEME if layout.ring == 1 else "ring"
    rw = SPRewrite(
        gm, sp_size, sp_rank, group_name, seq, loss_chunk, kv_before_repeat, native_gqa, seq_offset=offset,
        attention_tile=attention_tile, attention=get_scheme(attention_scheme), ring=layout.ring, zigzag=zigzag,
    )
    rw.stats.merged_losses = merged
    for attn in manual:
        rw.manual.update(dict.fromkeys(attn.nodes, attn))
    graph = _run(rw)
    if strict and rw.stats.fallbacks:
        raise AutoSPError(
            f"AutoSP (strict=True): {len(rw.stats.fallbacks)} op(s) would run replicated, every rank holding the whole "
            "sequence there (their sharded inputs all-gathered):\n"
            + "\n".join(describe_fallbacks(rw.stats))
            + "\nWrite them along another dim than the sequence (or in a way the supported-models page lists), or "
            "pass strict=False to run them replicated (exact; each rank then holds the bytes above)."
        )
    _check_postcondition(graph, rw.stats, sum(expected_all_to_alls(rw, attn) for attn in manual), rw.attention)
    _check_example_fits(gm, seq, sp_size, rw.stats.max_shift, offset)
    new_gm = fx.GraphModule(gm, graph)
    new_gm.meta["autosp"] = rw.stats
    if rw.stats.fallbacks:
        log.info("AutoSP: %d op(s) ran replicated (inputs all-gathered): %s", len(rw.stats.fallbacks), "; ".join(rw.stats.fallbacks))
    if rw.stats.dense_masks:
        log.info("AutoSP: %d attention call(s) keep a dense mask: %s", len(rw.stats.dense_masks), "; ".join(rw.stats.dense_masks))
    return new_gm
