"""The tiled attention kernel against dense attention (forward and backward, fp64), and the SP
pass turning the masks models build into score programs - with no ``S x S`` tensor left in the
compiled step."""

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mask_models import PLAIN_CAUSAL, DocumentLM, hf_factory, packed_call, padded_call, plain_call
from sp_harness import VOCAB, TraceStop, trace_rank

from autosp.passes.sp_rules.attention import LIVE_TILES, TILED_ATTENTION
from autosp.passes import sequence_parallel_pass
from autosp.ops.tiled_attention import TILE_COUNTS, attend

B, H, HK, S, D = 2, 4, 2, 37, 8


def ins(kind, name, *args, s=False):
    return {"kind": kind, "name": name, "args": list(args), "kwargs": {}, "s": s}


def program(instructions, leaf_axes, out=None, heads=None, dtype="float64"):
    out = out or {"r": len(instructions) - 1}
    return json.dumps({"instructions": instructions, "out": out, "leaf_axes": leaf_axes, "out_dtype": dtype, "heads": heads})


def qkv(dtype=torch.float64, heads=H, kv_heads=HK, seq=S):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, h, seq, D, generator=g, dtype=dtype, requires_grad=True) for h in (heads, kv_heads, kv_heads)]


def grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, g)


def dense(q, k, v, logits_fn):
    """softmax(logits_fn(q @ k^T)) @ v with KV heads repeated - the reference, autograd through it."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    return torch.softmax(logits_fn(q @ k.transpose(-1, -2)), dim=-1) @ v


def positions(seq=S):
    pos = torch.arange(seq)
    doc = (pos >= 11).long() + (pos >= 30).long()
    pad = torch.ones(B, seq, dtype=torch.bool)
    pad[1, -5:] = False
    return pos, doc, pad


def causal_docs_padding(seq=S, with_docs=True):
    """where(causal & same document & key not padded, s * scale, -inf), from leaves [S,1], [1,S], ..."""
    pos, doc, pad = positions(seq)
    leaves = [pos[:, None], pos[None, :], doc[:, None], doc[None, :], pad[:, None, None, :]]
    axes = [[-2, None], [None, -1], [-2, None], [None, -1], [None, -1]]
    steps = [ins("operator", "le", {"l": 1}, {"l": 0}), ins("operator", "eq", {"l": 2}, {"l": 3}),
             ins("operator", "and_", {"r": 0}, {"r": 1} if with_docs else {"r": 0}), ins("operator", "and_", {"r": 2}, {"l": 4}),
             ins("operator", "mul", {"s": 0}, 1 / math.sqrt(D), s=True), ins("torch", "where", {"r": 3}, {"r": 4}, -math.inf, s=True)]
    keep = (pos[None, :] <= pos[:, None]) & (doc[:, None] == doc[None, :]) & pad[:, None, None, :]
    return program(steps, axes), leaves, keep


@pytest.mark.parametrize("tile", [5, 16, 64])
def test_kernel_matches_sdpa_with_a_bool_mask(tile):
    """Causal, packed documents and key padding, GQA (4 query heads on 2 KV heads), uneven tiles."""
    q, k, v = qkv()
    text, leaves, keep = causal_docs_padding()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    out = attend(q, k, v, leaves, text, tile)
    assert (out - ref).abs().max() < 1e-12
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        assert (a - b).abs().max() < 1e-12
    # negative control: the same program without the document term is another attention
    text_nodocs, _, _ = causal_docs_padding(with_docs=False)
    assert (attend(q, k, v, leaves, text_nodocs, tile) - ref).abs().max() > 1e-2


def test_kernel_skips_tiles_the_mask_covers():
    """A sliding window of 4 over 64 positions in tiles of 8: most tiles are never computed, and
    the result is the dense one."""
    seq, window = 64, 4
    q, k, v = qkv(seq=seq)
    pos = torch.arange(seq)
    steps = [ins("operator", "sub", {"l": 0}, {"l": 1}), ins("operator", "lt", {"r": 0}, window), ins("operator", "ge", {"r": 0}, 0),
             ins("operator", "and_", {"r": 1}, {"r": 2}), ins("operator", "mul", {"s": 0}, 0.3, s=True),
             ins("torch", "where", {"r": 3}, {"r": 4}, -math.inf, s=True)]
    text = program(steps, [[-2, None], [None, -1]])
    keep = (pos[:, None] - pos[None, :] < window) & (pos[:, None] >= pos[None, :])
    before = dict(TILE_COUNTS)
    out = attend(q, k, v, [pos[:, None], pos[None, :]], text, 8)
    computed, skipped = TILE_COUNTS["computed"] - before["computed"], TILE_COUNTS["skipped"] - before["skipped"]
    assert (computed, skipped) == (15, 49)  # the diagonal tiles and the 7 just below: 8 + 7 of 64
    ref = dense(q, k, v, lambda s: (s * 0.3).masked_fill(~keep, -math.inf))
    assert (out - ref).abs().max() < 1e-12
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        assert (a - b).abs().max() < 1e-12


def test_kernel_rows_with_no_key_follow_dense_attention():
    """Rows whose every key is masked: with a finite fill (finfo.min, Hugging Face's eager masks) a
    softmax over the fill values, as dense attention computes; with -inf (a bool mask in SDPA) an
    output of 0 and no gradient."""
    q, k, v = qkv()
    pos, _, _ = positions()
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[0, :5] = False  # left padding: queries 0..4 of row 0 see only padded keys
    keep = (pos[None, :] <= pos[:, None]) & pad[:, None, None, :]
    leaves = [pos[:, None], pos[None, :], pad[:, None, None, :]]
    axes = [[-2, None], [None, -1], [None, -1]]
    fmin = torch.finfo(torch.float32).min  # what a Hugging Face fp32 model fills with
    mask_steps = [ins("operator", "le", {"l": 1}, {"l": 0}), ins("operator", "and_", {"r": 0}, {"l": 2})]
    finite = program(mask_steps + [ins("torch", "where", {"r": 1}, 0.0, fmin), ins("operator", "mul", {"s": 0}, 0.25, s=True),
                                   ins("operator", "add", {"r": 3}, {"r": 2}, s=True)], axes)
    out = attend(q, k, v, leaves, finite, 8)
    ref = dense(q, k, v, lambda s: s * 0.25 + torch.where(keep, 0.0, fmin))
    assert (out[0, :, :5] - v[0].repeat_interleave(2, 0)[:, :].mean(-2, keepdim=True)).abs().max() < 1e-12  # uniform
    assert (out - ref).abs().max() < 1e-12
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        assert (a - b).abs().max() < 1e-12
    inf = program(mask_steps + [ins("operator", "mul", {"s": 0}, 0.25, s=True), ins("torch", "where", {"r": 1}, {"r": 2}, -math.inf, s=True)], axes)
    out = attend(q, k, v, leaves, inf, 8)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.25, enable_gqa=True)
    assert out[0, :, :5].abs().max() == 0
    assert (out - ref).abs().max() < 1e-12
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        assert (a - b).abs().max() < 1e-12


def test_kernel_soft_capping_and_per_head_biases():
    """Gemma-2's ``tanh(s * scale / c) * c + mask`` and an ALiBi bias per head; the logits of all
    heads narrowed to two of them (``heads``) equal those heads of the whole."""
    q, k, v = qkv(kv_heads=H)
    pos, _, _ = positions()
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    leaves = [pos[:, None], pos[None, :], -slopes[:, None, None]]
    axes = [[-2, None], [None, -1], [None, None]]
    steps = [ins("operator", "sub", {"l": 0}, {"l": 1}), ins("torch", "abs", {"r": 0}), ins("operator", "mul", {"l": 2}, {"r": 1}),
             ins("operator", "ge", {"r": 0}, 0), ins("torch", "where", {"r": 3}, 0.0, -math.inf), ins("operator", "add", {"r": 2}, {"r": 4}),
             ins("operator", "mul", {"s": 0}, 0.35, s=True), ins("operator", "truediv", {"r": 6}, 5.0, s=True),
             ins("torch", "tanh", {"r": 7}, s=True), ins("operator", "mul", {"r": 8}, 5.0, s=True),
             ins("operator", "add", {"r": 9}, {"r": 5}, s=True)]
    bias = -slopes[:, None, None] * (pos[:, None] - pos[None, :]).abs() + torch.where(pos[:, None] >= pos[None, :], 0.0, -math.inf)
    ref = dense(q, k, v, lambda s: torch.tanh(s * 0.35 / 5.0) * 5.0 + bias)
    from autosp.ops.tiled_attention import ScoreProgram

    assert ScoreProgram.parse(program(steps, axes)).additive is None  # soft-capping: the interpreted path
    assert ScoreProgram.parse(causal_docs_padding()[0]).additive == (1 / math.sqrt(D), (("keep", {"r": 3}, -math.inf),))
    out = attend(q, k, v, leaves, program(steps, axes), 8)
    assert (out - ref).abs().max() < 1e-12
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        assert (a - b).abs().max() < 1e-12
    q2, k2, v2 = (t[:, 2:].detach().requires_grad_() for t in (q, k, v))  # a rank holding heads 2 and 3
    out2 = attend(q2, k2, v2, leaves, program(steps, axes, heads=[2, 2, 4]), 8)
    assert (out2 - ref[:, 2:]).abs().max() < 1e-12


def test_kernel_fp32_against_the_cpu_flash_kernel():
    q, k, v = qkv(torch.float32)
    text, leaves, keep = causal_docs_padding()
    text = text.replace('"out_dtype": "float64"', '"out_dtype": "float32"')
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    out = attend(q, k, v, leaves, text, 16)
    assert out.dtype == torch.float32 and (out - ref).abs().max() < 1e-5
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        assert (a - b).abs().max() / b.abs().max() < 1e-5


# ---------------------------------------------------------------------- the pass, on traced steps
LONG = 4096


def long_batch(kind):
    """One row of 4096 tokens: packed documents of 1000 tokens, or padding on both sides."""
    x = torch.randint(0, VOCAB, (1, LONG), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(LONG) % 1000
    if kind == "packed":
        return {"input_ids": x, "labels": x, "position_ids": pos[None], "doc_ids": (torch.arange(LONG) // 1000)[None]}
    am = torch.ones_like(x)
    am[:, :100] = 0
    am[:, -100:] = 0
    return {"input_ids": x, "labels": x.masked_fill(am == 0, -100), "attention_mask": am}


def _hf(call):
    return lambda factory: (lambda b: call(factory(), b))


_LLAMA_PLAIN = hf_factory("llama", PLAIN_CAUSAL)
#: model, the call, the batch and the same model with plain causal attention (is_causal=True)
LONG_CASES = {
    "llama-use_cache=False": (hf_factory("llama"), plain_call, "packed", _LLAMA_PLAIN),
    "llama-packed-sdpa": (hf_factory("llama"), packed_call, "packed", _LLAMA_PLAIN),
    "llama-packed-eager": (hf_factory("llama", "eager"), packed_call, "packed", _LLAMA_PLAIN),
    "mistral-window64": (hf_factory("mistral", sliding_window=64), packed_call, "packed", hf_factory("mistral", PLAIN_CAUSAL)),
    "gemma2-eager": (hf_factory("gemma2", "eager", layers=2, sliding_window=64), plain_call, "packed",
                     hf_factory("gemma2", PLAIN_CAUSAL, layers=2)),
    "qwen2-padded": (hf_factory("qwen2"), padded_call, "padded", hf_factory("qwen2", PLAIN_CAUSAL)),
    "documents-alibi-sdpa": (lambda: DocumentLM(layers=1), None, "packed", lambda: DocumentLM(layers=1, plain=True)),
    "documents-window-manual": (lambda: DocumentLM(layers=1, attention="manual", window=64, alibi=False), None, "packed",
                                lambda: DocumentLM(layers=1, plain=True)),
}


def _long_step(factory, call, kind):
    batch = long_batch(kind)
    model = factory()
    if call is None:  # DocumentLM
        return (lambda ids, docs, labels: F.cross_entropy(model(ids, docs).flatten(0, 1), labels.flatten())), [
            batch["input_ids"], batch["doc_ids"], batch["labels"]]
    keys = [k for k in ("input_ids", "position_ids", "attention_mask", "labels") if k in batch]
    return (lambda *ts: call(model, dict(zip(keys, ts)))), [batch[k] for k in keys]


def _plain_step(factory, call, kind):
    model = factory()
    batch = long_batch(kind)
    if call is None:
        return (lambda ids, docs, labels: F.cross_entropy(model(ids, docs).flatten(0, 1), labels.flatten())), [
            batch["input_ids"], batch["doc_ids"], batch["labels"]]
    return (lambda ids, labels: model(input_ids=ids, labels=labels, use_cache=False).loss), [batch["input_ids"], batch["labels"]]


_BASELINES: dict = {}  # plain causal traces, shared by the cases of one model
#: the cases also traced with tiled_attention=False: the negative control, an SDPA mask and a hand-written chain
DENSE_CONTROLS = ("llama-packed-sdpa", "documents-window-manual")


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == "llama-packed-sdpa" else pytest.mark.full) for c in LONG_CASES])
def test_no_sequence_squared_tensor_at_4096_tokens(case):
    """At S = 4096 and sp=2 nothing in the compiled joint graph holds S x S elements, and the bytes
    a rank saves for backward are within 1.1x of the same model with plain causal attention; with
    tiled_attention=False (the dense path, the negative control) the mask is there."""
    factory, call, kind, plain = LONG_CASES[case]
    tiled = trace_rank(*_long_step(factory, call, kind))
    assert tiled["stats"].dense_masks == [] and tiled["stats"].tiled_attention == tiled["stats"].attention > 0
    assert tiled["joint_max"] < LONG * LONG, tiled["joint_max"]
    if (plain, call is None) not in _BASELINES:
        torch._dynamo.reset()
        _BASELINES[(plain, call is None)] = trace_rank(*_plain_step(plain, call, kind))
    baseline = _BASELINES[(plain, call is None)]
    assert baseline["stats"].tiled_attention == 0
    ratio = tiled["saved"] / baseline["saved"]
    print(f"{case}: saved {tiled['saved'] / 2**20:.2f} MiB vs plain causal {baseline['saved'] / 2**20:.2f} MiB ({ratio:.3f}x)")
    assert ratio <= 1.1
    if case in DENSE_CONTROLS:
        torch._dynamo.reset()
        dense = trace_rank(*_long_step(factory, call, kind), attention_tile=None)
        assert dense["stats"].tiled_attention == 0 and dense["joint_max"] >= LONG * LONG
        assert dense["saved"] > 1.5 * baseline["saved"]


@pytest.mark.slow
@pytest.mark.full
def test_masks_that_stay_dense_are_reported():
    """A mask given as data (a batch input), a learned bias (it needs a gradient) and
    tiled_attention=False keep SDPA with the dense mask, each reported with its size and why."""
    lm = DocumentLM(layers=1)
    ids = torch.randint(0, VOCAB, (2, 24))
    docs = torch.zeros_like(ids)

    def data_mask_step(ids, mask):
        B, S = ids.shape
        x = lm.emb(ids)
        q = k = v = x.view(B, S, 4, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()

    mask = torch.ones(2, 1, 24, 24, dtype=torch.bool).tril()
    stats = trace_rank(data_mask_step, [ids, mask])["stats"]
    assert stats.tiled_attention == 0 and len(stats.dense_masks) == 1
    assert "is data of S x S" in stats.dense_masks[0] and "MiB per rank" in stats.dense_masks[0]

    bias = nn.Parameter(torch.zeros(4, 1, 1))

    def learned_bias_step(ids):
        B, S = ids.shape
        pos = torch.arange(S)
        q = k = v = lm.emb(ids).view(B, S, 4, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias * (pos[:, None] - pos[None, :])).sum()

    torch._dynamo.reset()
    stats = trace_rank(learned_bias_step, [ids])["stats"]
    assert stats.tiled_attention == 0 and "needs a gradient" in stats.dense_masks[0]

    torch._dynamo.reset()
    stats = trace_rank(lambda i, d: lm(i, d).sum(), [ids, docs], attention_tile=None)["stats"]
    assert stats.tiled_attention == 0 and "tiled_attention=False" in stats.dense_masks[0]
    torch._dynamo.reset()  # control: the same model with tiles on is tiled
    stats = trace_rank(lambda i, d: lm(i, d).sum(), [ids, docs])["stats"]
    assert stats.tiled_attention == 1 and not stats.dense_masks and stats.mask_inputs


def test_the_kernel_op_is_what_the_pass_emits():
    ids = torch.randint(0, VOCAB, (2, 24))
    lm = DocumentLM(layers=2, attention="manual", window=5)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(sequence_parallel_pass(gm, sp_size=2, sp_rank=1, group_name="unused", attention_tile=8))
        raise TraceStop  # no process group: the graph only has to exist

    docs = torch.zeros_like(ids)
    for t in (ids, docs):
        torch._dynamo.mark_dynamic(t, 1)
    with pytest.raises(Exception, match="TraceStop"):
        torch.compile(lambda i, d: lm(i, d).sum(), backend=backend)(ids, docs)
    (gm,) = graphs
    tiled = gm.graph.find_nodes(op="call_function", target=TILED_ATTENTION)
    assert len(tiled) == 2 and gm.meta["autosp"].manual_attention == 2
    assert all(n.args[-1] == 8 for n in tiled)
    live = gm.graph.find_nodes(op="call_function", target=LIVE_TILES)  # the two layers read one mask: one map of its tiles
    assert len(live) == 1 and all(n.args[4] is live[0] for n in tiled)
    assert not any(n.target in (torch.softmax, torch.matmul) for n in gm.graph.nodes)  # the chain is gone


def test_tiled_attention_argument():
    from lightning_autosp import AutoSPStrategy
    from lightning_autosp.fabric import AutoSPStrategy as FabricAutoSP

    for cls in (AutoSPStrategy, FabricAutoSP):
        assert cls(tiled_attention=True)._step_config.attention_tile == 0
        assert cls(tiled_attention=False)._step_config.attention_tile is None
        assert cls(tiled_attention=256)._step_config.attention_tile == 256
        for bad in (4, 0, "yes", 1.5):
            with pytest.raises(ValueError, match=r"tiled_attention=.*rows and key columns per tile"):
                cls(tiled_attention=bad)


def test_live_tiles_from_bounds_cover_every_unmasked_tile():
    """The map of live tiles comes from the program's bounds over each tile: it must hold every tile
    with an unmasked logit (the element-by-element probe says which) - and, for causal masks over
    packed documents with padding, no other. With causality on positions that restart in every
    document (Hugging Face's packed masks) bounds cannot tell tiles across a document boundary
    apart: a few more tiles, never fewer. A program with an op it has no bounds for (``remainder``)
    is probed element by element."""
    from autosp.ops.live_tiles import LIVE_NO_BIAS, _interval_live, _probe_block, live_tiles
    from autosp.ops.score_program import ScoreProgram

    seq, tile = 200, 16
    g = torch.Generator().manual_seed(4)
    cuts = sorted(torch.randperm(seq - 1, generator=g)[:6].add(1).tolist())
    doc = torch.zeros(seq, dtype=torch.long)
    for c in cuts:
        doc[c:] += 1
    restarting = torch.cat([torch.arange(n) for n in torch.bincount(doc).tolist()])
    pad = torch.ones(2, seq, dtype=torch.bool)
    pad[0, :23] = False
    pad[1, -40:] = False
    axes = [[-2, None], [None, -1], [-2, None], [None, -1], [None, -1]]
    steps = [ins("operator", "le", {"l": 1}, {"l": 0}), ins("operator", "eq", {"l": 2}, {"l": 3}), ins("operator", "and_", {"r": 0}, {"r": 1}),
             ins("operator", "and_", {"r": 2}, {"l": 4}), ins("operator", "mul", {"s": 0}, 0.3, s=True),
             ins("torch", "where", {"r": 3}, {"r": 4}, -math.inf, s=True)]

    def maps(pos, text):
        leaves = [pos[None, None, :, None], pos[None, None, None, :], doc[None, None, :, None], doc[None, None, None, :], pad[:, None, None, :]]
        prog = ScoreProgram.parse(text)
        exact = torch.stack([_probe_block(prog, leaves, q0, min(q0 + tile, seq), seq, tile)[0] for q0 in range(0, seq, tile)])
        return exact, live_tiles(leaves, text, tile, seq, seq), prog, leaves

    exact, bounds, _, _ = maps(torch.arange(seq), program(steps, axes))
    assert torch.equal(bounds > 0, exact) and 0 < int(exact.sum()) < exact.numel() // 2  # the mask covers most tiles
    # tiles strictly below the diagonal, inside one document and clear of the padding, have no mask to apply
    clear = [(i, j) for i in range(bounds.shape[0]) for j in range(i) if len({int(doc[i * tile]), int(doc[min(i * tile + tile, seq) - 1]),
             int(doc[j * tile]), int(doc[j * tile + tile - 1])}) == 1 and j * tile >= 23 and (j + 1) * tile <= seq - 40]
    assert clear and all(int(bounds[i, j]) == LIVE_NO_BIAS for i, j in clear)
    assert int((bounds == LIVE_NO_BIAS).sum()) == len(clear)
    exact, bounds, _, leaves = maps(restarting, program(steps, axes))
    bounds = bounds > 0
    assert bool((bounds >= exact).all()) and int(bounds.sum()) - int(exact.sum()) <= 2 * len(cuts) * bounds.shape[0]
    # negative control: bounds that ignore the documents keep many more tiles
    nodocs = ScoreProgram.parse(program([steps[0], steps[0], *steps[2:]], axes))
    assert int((_interval_live(nodocs, leaves, tile, seq, seq)[0] > 0).sum()) > int(bounds.sum()) + 10
    chunked = steps[:2] + [ins("operator", "mod", {"l": 0}, 7), ins("operator", "ne", {"r": 2}, 3), ins("operator", "and_", {"r": 0}, {"r": 3}),
                           ins("operator", "mul", {"s": 0}, 0.3, s=True), ins("torch", "where", {"r": 4}, {"r": 5}, -math.inf, s=True)]
    exact, probed, _, _ = maps(torch.arange(seq), program(chunked, axes))
    assert torch.equal(probed > 0, exact) and int(probed.max()) == 1  # (probed: no claim about the bias)


def test_a_mask_that_is_exactly_causal_runs_as_causal_attention():
    """Causal rows through a mask (what Hugging Face builds under ``use_cache=False``: positions
    compared, documents compared, padding) run as the fused kernel's ``is_causal`` over the whole
    sequence when the batch makes them exactly causal - one document, no padding - with no tile
    computed, and equal SDPA's ``is_causal``; a second document or one padded key keeps the tiles
    (the controls)."""
    from autosp.ops.live_tiles import CAUSAL

    q, k, v = qkv(dtype=torch.float32, seq=70)
    pos = torch.arange(70)
    one_doc, pad = torch.zeros(70, dtype=torch.long), torch.ones(B, 70, dtype=torch.bool)
    axes = [[-2, None], [None, -1], [-2, None], [None, -1], [None, -1]]
    steps = [ins("operator", "le", {"l": 1}, {"l": 0}), ins("operator", "eq", {"l": 2}, {"l": 3}), ins("operator", "and_", {"r": 0}, {"r": 1}),
             ins("operator", "and_", {"r": 2}, {"l": 4}), ins("operator", "mul", {"s": 0}, 1 / math.sqrt(D), s=True),
             ins("torch", "where", {"r": 3}, {"r": 4}, -math.inf, s=True)]
    text = program(steps, axes, dtype="float32")

    def run(doc, pad):
        leaves = [pos[:, None], pos[None, :], doc[:, None], doc[None, :], pad[:, None, None, :]]
        before = dict(TILE_COUNTS)
        out = attend(q, k, v, leaves, text, 16)
        live = torch.ops.autosp_attn.live_tiles.default(leaves, text, 16, 70, 70)
        return out, live, {key: TILE_COUNTS[key] - before[key] for key in before}

    out, live, counts = run(one_doc, pad)
    assert bool((live.diagonal() == CAUSAL).all()) and counts == {"computed": 0, "skipped": 0, "causal": 1}
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (out - ref).abs().max() < 1e-5
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        assert (a - b).abs().max() < 1e-5
    two_docs = (pos >= 40).long()
    padded = pad.clone()
    padded[1, -3:] = False
    for doc, p in ((two_docs, pad), (one_doc, padded)):
        out, live, counts = run(doc, p)
        keep = (pos[None, :] <= pos[:, None]) & (doc[:, None] == doc[None, :]) & p[:, None, None, :]
        assert not bool((live.diagonal() == CAUSAL).any()) and counts["causal"] == 0 and counts["computed"] > 0
        assert (out - F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)).abs().max() < 1e-5
