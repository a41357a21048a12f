"""The Ulysses rule for ``F.scaled_dot_product_attention``.

q, k, v arrive sharded on the sequence (``[B, H, S/P, D]`` with ``P = sp_size``); an
all-to-all each makes them sharded on heads with the full sequence (``[B, H/P, S, D]``),
attention runs unchanged for this rank's heads (``is_causal`` or the full mask), and one
all-to-all takes the output back to ``[B, H, S/P, D]``. KV heads that do not divide by
``sp_size`` (GQA/MQA) are repeated first so that every rank receives the ones its query heads
read. KV heads that the model repeats itself before attention (``repeat_kv``, as in Hugging Face
Llama) and that divide by ``sp_size`` are exchanged before the repeat and repeated after it:
rank ``j`` needs query heads ``j*H/P ..``, which read exactly KV heads ``j*Hk/P ..``, so the
all-to-all of k and v (and of their gradients) carries ``Hk`` heads instead of ``H``.

An ``attn_mask`` the model builds from positions (causal, padding, packed documents, sliding
windows, ALiBi; :mod:`.score_program`) is never materialised: attention then runs in
:func:`~autosp.ops.tiled_attention.tiled_attention`, which evaluates the mask per tile for
the rank's heads and skips the tiles it masks whole. A mask that cannot be evaluated that way
(a batch input, an op the tiles cannot run) stays a dense ``S x S`` tensor on every rank, as
SDPA's argument, and is reported in :attr:`SPPassStats.dense_masks`.
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any, Optional

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.errors import AutoSPError, user_source
from autosp.passes.placement import hinted_bytes
from autosp.passes.sp_rules.registry import OpCall, RuleResult, calls, op, sp_rule
from autosp.passes.sp_rules.score_program import ExtractedProgram, NotAFunction, ProgramBuilder, leaf_values, scaled_scores, sdpa_logits
from autosp.passes.sp_rules.shape import repeat_interleave_args
from autosp.ops.tiled_attention import default_tile

if TYPE_CHECKING:
    from autosp.passes.rewrite import SPRewrite

SDPA = F.scaled_dot_product_attention
TILED_ATTENTION = torch.ops.autosp_attn.tiled_attention.default
LIVE_TILES = torch.ops.autosp_attn.live_tiles.default
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _kv_repeat(node: fx.Node, heads: int, kv_heads: int, sp_size: int, gqa: bool) -> int:
    """How often to repeat each KV head so that they split over ``sp_size`` like the query's."""
    if kv_heads % sp_size == 0:
        return 1
    if not gqa or heads % kv_heads:
        raise AutoSPError(
            f"{node.name}: key/value have {kv_heads} heads and query {heads} without enable_gqa=True; "
            f"they must match or divide by sp_size={sp_size}."
        )
    return sp_size // kv_heads if sp_size % kv_heads == 0 else heads // kv_heads


def _only_inserts_dims(index: object) -> bool:
    """A ``getitem`` index made of ``None``, ``...`` and full slices (``x[:, :, None]``)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(
        i is None or i is Ellipsis
        or (isinstance(i, slice) and i.start in (None, 0) and i.stop is None and i.step in (None, 1))
        for i in items
    )


def repeated_heads(rw: "SPRewrite", n: fx.Node, head_dim: int) -> Optional[tuple[fx.Node, int]]:
    """``(x, n_rep)`` when ``n`` is ``x`` with every head repeated ``n_rep`` times in place, head
    ``h`` of ``n`` being head ``h // n_rep`` of ``x``: ``x[:, :, None].expand(.., n_rep, ..)
    .reshape(..)`` (``repeat_kv`` of Hugging Face and the bundled Llama; ``unsqueeze`` or
    ``flatten`` work too) or ``x.repeat_interleave(n_rep, dim=head_dim)``. Checked on the shapes
    of every step, so a similar chain that maps heads differently is not taken; else ``None``."""
    shape = list(rw.shape(n))
    if calls(n, "repeat_interleave"):
        found = repeat_interleave_args(n)
        if found is None:
            return None
        x, reps, dim = found
        xs = list(rw.shape(x))
        if dim % max(len(xs), 1) != head_dim or len(xs) != len(shape):
            return None
        expect = xs[:head_dim] + [xs[head_dim] * reps] + xs[head_dim + 1:]
        return (x, reps) if expect == shape else None
    if not (calls(n, "reshape") or calls(n, "view") or calls(n, "flatten")) or not isinstance(n.args[0], fx.Node):
        return None
    e = n.args[0]
    if not calls(e, "expand") or not isinstance(e.args[0], fx.Node):
        return None
    u = e.args[0]
    if u.target is operator.getitem and isinstance(u.args[0], fx.Node) and _only_inserts_dims(u.args[1]):
        x = u.args[0]
    elif calls(u, "unsqueeze") and isinstance(u.args[0], fx.Node):
        x = u.args[0]
    else:
        return None
    xs, us, es = list(rw.shape(x)), list(rw.shape(u)), list(rw.shape(e))
    if len(xs) != len(shape) or len(es) != len(xs) + 1:
        return None
    reps = es[head_dim + 1]
    if not reps.is_Integer or us != xs[: head_dim + 1] + [1] + xs[head_dim + 1:]:
        return None
    if es != xs[: head_dim + 1] + [reps] + xs[head_dim + 1:] or shape != xs[:head_dim] + [xs[head_dim] * reps] + xs[head_dim + 1:]:
        return None
    return x, int(reps)


def _repeat_heads(rw: "SPRewrite", x: fx.Node, n_rep: int, head_dim: int) -> fx.Node:
    """``[.., h, S, D]`` -> ``[.., h*n_rep, S, D]``, head ``i`` of the result being head
    ``i // n_rep`` of ``x``: the user's ``repeat_kv``, on this rank's heads after the exchange."""
    g = rw.graph
    u = g.call_function(torch.unsqueeze, (x, head_dim + 1))
    e = g.call_method("expand", (u, *([-1] * (head_dim + 1)), n_rep, -1, -1))
    return g.call_function(torch.flatten, (e, head_dim, head_dim + 1))


def _native_gqa(rw: "SPRewrite", q: fx.Node) -> bool:
    """Hand attention the exchanged KV heads unrepeated (``enable_gqa=True``)? ``rw.native_gqa``,
    or where it is verified when that is ``None``: CPU tensors (the CPU flash kernel groups the
    heads itself, forward and backward)."""
    if rw.native_gqa is not None:
        return rw.native_gqa
    return rw.val(q).device.type == "cpu"


def exchanged_source(a: object) -> object:
    """What attention reads ``a`` from: through the local repeat :func:`_repeat_heads` emits."""
    if calls(a, "flatten") and calls(a.args[0], "expand") and calls(a.args[0].args[0], "unsqueeze"):
        return a.args[0].args[0].args[0]
    return a


def _sequence_local(rw: "SPRewrite", node: fx.Node, n: fx.Node, seq_dim: int) -> fx.Node:
    """q, k or v as this rank's ``[B, H, S/P, D]`` shard."""
    shard = rw.placements.get(n)
    if not rw.is_shard(n):
        if seq_dim not in rw.seq_dims(n):
            raise AutoSPError(
                f"{node.name}: {n.name} has shape {list(rw.shape(n))} with no sequence dim at "
                f"dim {seq_dim}: AutoSP expects SDPA inputs laid out as [B, H, S, D], with S the {rw.seq} positions "
                "the query attends over (keys and values as long as the queries: self-attention).\n"
                + user_source(node) + "\n"
                + "Transpose q, k and v to [B, H, S, D] before attention (`x.view(B, S, H, D).transpose(1, 2)`)."
            )
        return rw.redistribute.to_shard(n, rw.base_shard(seq_dim))
    if shard.dim != seq_dim or shard.inner != 1 or shard.off != 0 or sympy.simplify(shard.length - rw.seq) != 0:
        raise AutoSPError(
            f"{node.name}: {n.name} (shape {list(rw.shape(n))}) reaches attention sharded as {shard}; "
            f"AutoSP expects the full sequence in dim {seq_dim} of a [B, H, S, D] layout."
        )
    return rw.new_value[n]


def report_dense(rw: "SPRewrite", node: fx.Node, what: str, value: Any, why: str, per_rank: int = 1) -> None:
    """Record that attention ``node`` keeps ``what`` (a fake tensor ``value``, of which each rank
    holds ``1/per_rank``) dense on every rank."""
    mib = hinted_bytes(value) / per_rank / 2**20
    rw.stats.dense_masks.append(
        f"{node.name}: {what} {list(value.shape)} stays dense ({mib:.1f} MiB per rank at the compiled length), "
        f"because {why}"
    )


def emit_tiled_attention(
    rw: "SPRewrite", q: Any, k: Any, v: Any, program: ExtractedProgram, heads: int, device: torch.device
) -> fx.Node:
    """``tiled_attention(q, k, v, leaves, live, program)`` on this rank's heads (q ``[B, H/P, S, D]``;
    k, v ``[B, Hk', S, D]`` with ``Hk'`` dividing ``H/P``; tensors on ``device``): its output
    ``[B, H/P, S, Dv]``. ``live`` (:func:`~autosp.ops.tiled_attention.live_tiles`) is emitted
    once per mask, for every attention call that reads the same one."""
    leaves = leaf_values(rw, program, heads)
    rw.record_mask_inputs(list(program.leaves))
    tile = rw.attention_tile or default_tile(device)
    key = (program.text, tuple(leaves), tile)
    if key not in rw.live_tiles:  # the tiles the mask leaves: computed once for the attention calls that share it
        seq = rw.emit(rw.seq)
        rw.live_tiles[key] = rw.graph.call_function(LIVE_TILES, (leaves, program.text, tile, seq, seq))
    call = rw.graph.call_function(TILED_ATTENTION, (q, k, v, leaves, rw.live_tiles[key], program.text, tile))
    rw.stats.tiled_attention += 1
    return rw.graph.call_function(operator.getitem, (call, 0))


def _mask_program(rw: "SPRewrite", node: fx.Node, bound: dict, heads: int) -> Optional[ExtractedProgram]:
    """SDPA's logits with its ``attn_mask`` as a score program, or ``None`` (dense, reported)."""
    mask, q = bound.get("attn_mask"), bound["query"]
    if not isinstance(mask, fx.Node) or rw.attention_tile is None:
        return None
    scale = bound.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(int(rw.shape(q)[-1]))
    try:
        if not isinstance(scale, (int, float)):
            raise NotAFunction(node, "its scale is not a number")
        builder = ProgramBuilder(rw, heads, node)
        return builder.finish(sdpa_logits(builder, mask, float(scale)), rw.val(q).dtype)
    except NotAFunction as exc:
        report_dense(rw, node, f"attn_mask {mask.name}", rw.val(mask), f"{exc.node.name} {exc.why}")
        return None


def _plain_program(rw: "SPRewrite", node: fx.Node, bound: dict, heads: int) -> ExtractedProgram:
    """SDPA without a mask (or with ``is_causal``) as the score program it is, for a scheme that
    computes every attention itself; a mask that stayed dense cannot be split that way (refused)."""
    q, mask = bound["query"], bound.get("attn_mask")
    if isinstance(mask, fx.Node):
        why = "tiled_attention=False keeps it dense" if rw.attention_tile is None else rw.stats.dense_masks[-1].split("because ", 1)[-1]
        raise refuse_dense(rw, node, f"its attn_mask {mask.name} is not a function of positions ({why})")
    scale = bound.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(int(rw.shape(q)[-1]))
    if not isinstance(scale, (int, float)):
        raise refuse_dense(rw, node, "its scale is not a number")
    builder = ProgramBuilder(rw, heads, node)
    scores = scaled_scores(builder, float(scale))
    if bound.get("is_causal", False):
        keep = builder.emit("special", "tril", [builder.emit("special", "const", [True, {"dtype": "bool"}]), 0])
        scores = builder.emit("torch", "where", [keep, scores, -math.inf])
    return builder.finish(scores, rw.val(q).dtype)


def refuse_dense(rw: "SPRewrite", node: fx.Node, why: str) -> AutoSPError:
    """The error for an attention the ring level cannot split: ``why`` names what stays dense."""
    return AutoSPError(
        f"{node.name}: attention with sp_layout=({rw.sp_size // rw.ring}, {rw.ring}) runs as a ring over the sequence, "
        f"which needs its mask as a function of positions, but {why}.\n" + user_source(node) + "\n"
        + "Build the mask from positions (as Hugging Face models and `is_causal` do), or use a layout without a ring: "
        f"sp_layout=({rw.sp_size}, 1) where the heads divide by sp_size, or a smaller sp_size."
    )


@sp_rule(op("scaled_dot_product_attention", SDPA, method=False), source=True)
def attention(rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
    bound = dict(zip(_SDPA_ARGS, node.args))
    bound.update(node.kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    ndim = rw.val(q).dim()
    if ndim < 3:
        raise AutoSPError(f"{node.name}: scaled_dot_product_attention with {ndim}-D inputs has no head dim to split")
    seq_dim, head_dim = ndim - 2, ndim - 3
    heads, kv_heads = rw.shape(q)[head_dim], rw.shape(k)[head_dim]
    if not (heads.is_Integer and kv_heads.is_Integer):
        raise AutoSPError(
            f"{node.name}: attention heads must be static, got q {list(rw.shape(q))}, k {list(rw.shape(k))}"
        )
    heads, kv_heads = int(heads), int(kv_heads)
    rw.attention.check_heads(rw, node, heads, list(rw.shape(q)))
    dropout_p = bound.get("dropout_p", 0.0)
    if isinstance(dropout_p, fx.Node) or dropout_p != 0:
        raise AutoSPError(
            f"AutoSP: scaled_dot_product_attention with dropout_p={dropout_p if not isinstance(dropout_p, fx.Node) else dropout_p.name} "
            f"({node.name}) is not supported: after the all-to-all every rank draws the attention-dropout mask "
            "for its own heads from the same RNG state, so heads of different ranks would share masks.\n"
            + user_source(node) + "\n"
            + "Set the attention dropout to 0 (Hugging Face: `attention_dropout=0.0`, the default of most configs; "
            "dropout on activations, `F.dropout`/`nn.Dropout`, is supported)."
        )
    split = rw.attention.head_split(rw)
    kv_repeat = _kv_repeat(node, heads, kv_heads, split, bool(bound.get("enable_gqa", False)))
    # KV heads the model repeats for attention: exchange them before the repeat (as (x, n_rep))
    unrepeated = {}
    if kv_repeat == 1 and rw.kv_before_repeat:
        for n in (k, v):
            found = repeated_heads(rw, n, head_dim)
            if found is not None and (kv_heads // found[1]) % split == 0:
                unrepeated[n] = found
    reps = {n_rep for _, n_rep in unrepeated.values()}
    program = _mask_program(rw, node, bound, heads)
    if program is None and rw.attention.owns_attention:
        program = _plain_program(rw, node, bound, heads)
    # k and v both, alike: attention reads them unrepeated (the tiled kernel groups heads itself)
    native = len(unrepeated) == 2 and len(reps) == 1 and (program is not None or _native_gqa(rw, q))
    qkv = []
    for n in (q, k, v):
        n_heads = heads if n is q else kv_heads
        source, n_rep = unrepeated.get(n, (n, 1))
        local = _sequence_local(rw, node, source, seq_dim)
        if n is not q and kv_repeat > 1:  # [B, Hk, S/P, D] -> [B, Hk*kv_repeat, S/P, D]
            local = rw.graph.call_function(torch.repeat_interleave, (local, kv_repeat), {"dim": head_dim})
            n_heads = kv_heads * kv_repeat
        # [B, H, S/P, D] -> [B, H/P, S, D]
        exchanged = rw.attention.to_heads(rw, local, n_heads // n_rep, head_dim, seq_dim)
        if n_rep > 1:
            rw.stats.kv_exchanged_unrepeated += 1
            if not native:  # [B, Hk/P, S, D] -> [B, H/P, S, D]
                exchanged = _repeat_heads(rw, exchanged, n_rep, head_dim)
        qkv.append(exchanged)
    kwargs = {key: bound[key] for key in _SDPA_ARGS[3:] if key in bound}
    if native:  # rank j's query heads j*H/P.. read KV heads j*Hk/P.. (head i -> i // n_rep), as after the repeat
        rw.stats.native_gqa += 1
    rw.stats.sdpa += 1
    if program is not None:  # [B, H/P, S, D] -> [B, H/P, S, D], the mask evaluated per tile
        out = rw.attention.attend(rw, *qkv, program, heads, rw.val(q).device)
        return rw.attention.to_sequence(rw, out, head_dim, seq_dim), rw.base_shard(seq_dim)
    if kv_repeat > 1 and kv_heads * kv_repeat == heads:
        kwargs["enable_gqa"] = False
    if native:
        kwargs["enable_gqa"] = True
    mask = kwargs.get("attn_mask")
    if isinstance(mask, fx.Node):
        rw.record_mask_inputs([mask])
        full_mask = rw.redistribute.to_replicate(mask)
        mask_shape = rw.shape(mask)
        mask_head_dim = head_dim - (ndim - len(mask_shape))  # masks broadcast from the right: [B, H, S, S], [H, S, S]
        if mask_head_dim >= 0 and mask_shape[mask_head_dim] != 1:  # a mask per head: keep this rank's heads
            if mask_shape[mask_head_dim] != heads:
                raise AutoSPError(
                    f"{node.name}: attn_mask shape {list(mask_shape)} has {mask_shape[mask_head_dim]} heads, the query {heads}"
                )
            # [.., H, S, S] -> [.., H/P, S, S]
            first, per_rank = rw.attention.first_head(rw, heads), rw.attention.heads_per_rank(rw, heads)
            full_mask = rw.graph.call_function(torch.narrow, (full_mask, mask_head_dim, first, per_rank))
        kwargs["attn_mask"] = full_mask
        if rw.attention_tile is None:
            report_dense(rw, node, f"attn_mask {mask.name}", rw.val(mask), "of AutoSPStrategy(tiled_attention=False)")
    kwargs = {key: (rw.new_value[a] if isinstance(a, fx.Node) and key != "attn_mask" else a) for key, a in kwargs.items()}
    out = rw.graph.call_function(SDPA, tuple(qkv), kwargs)  # [B, H/P, S, D]
    # [B, H/P, S, D] -> [B, H, S/P, D]
    return rw.attention.to_sequence(rw, out, head_dim, seq_dim), rw.base_shard(seq_dim)
