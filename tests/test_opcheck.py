"""Every custom op of the package against its fake kernel, on every path it chooses at run time.

``torch.library.opcheck`` runs an op on real tensors and on fake ones and compares what comes
back (sizes, strides, dtypes), checks the schema and the autograd registration, and runs it
through AOT autograd with dynamic shapes. Inductor trusts the fake kernel's strides when it plans
the buffers around an op and asserts them at run time, so an op whose real outputs are laid out
otherwise stops a compiled step (aot_eager does not check: such a bug passes there). The inputs
below drive each internal path of the attention ops: a mask exactly causal for the batch (one
fused call), tiles with a mask (fused per tile), a program that is not additive (interpreted
tiles), rows with no key, GQA and MQA, fp32, bf16 and fp64, inputs laid out as the SP pass hands
them (heads inside) and contiguous; the ring ops at ring=2 in two processes; the collectives,
the tiled rows, the fused loss and the offload ops. A control shows that opcheck fails when the
exactly-causal path returns the fused kernel's own layout."""

import math

import pytest
import torch
import torch.distributed as dist
from sp_harness import spawn
from test_tiled_attention import D, causal_docs_padding

import autosp.ops.tiled_attention as tiled_attention_module
from autosp.ops import programs
from autosp.ops.live_tiles import CAUSAL
from autosp.passes.offload import offload, reload  # noqa: F401  (registers the ops)

B, S = 2, 37
OPCHECK = dict(raise_exception=False)


def failures(results: dict) -> dict:
    return {name: str(r) for name, r in results.items() if r != "SUCCESS"}


def _qkv(dtype, heads, kv_heads, seq=S, layout="heads_inside", seed=0):
    """q, k, v ``[B, H, S, D]``: laid out as ``[B, S, H, D]`` transposed (what the SP pass's
    exchange hands attention) or contiguous."""
    g = torch.Generator().manual_seed(seed)

    def make(h):
        if layout == "heads_inside":
            return torch.randn(B, seq, h, D, generator=g, dtype=torch.float64).to(dtype).transpose(1, 2).requires_grad_()
        return torch.randn(B, h, seq, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()

    return make(heads), make(kv_heads), make(kv_heads)


def _causal_program(dtype, seq=S, docs=False, padded=False):
    """Hugging Face's mask as a score program: causal, same document, key not padded."""
    pad = torch.ones(B, seq, dtype=torch.bool)
    if padded:
        pad[1, -3:] = False
    documents = (torch.arange(seq) >= seq // 2).long() if docs else None
    return programs.causal(seq, 1 / math.sqrt(D), dtype, documents=documents, keys=pad)


def _softcap_program(dtype):
    """Gemma-2's soft-capped causal logits: ``tanh`` makes the program not additive (interpreted tiles)."""
    return programs.soft_capped_causal(S, 0.3, 5.0, dtype)


def _keyless_program(dtype):
    """Left padding with a finite fill (Hugging Face's eager masks): rows of row 0 with no key."""
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[0, :5] = False
    return programs.padded_with_finite_fill(S, pad, 0.25, dtype)


#: path -> (dtype, query heads, KV heads, layout, program builder, what the live-tile map must say)
ATTENTION_PATHS = {
    "exactly-causal-fp32": (torch.float32, 4, 2, "heads_inside", lambda d: _causal_program(d), "causal"),
    "exactly-causal-contiguous": (torch.float32, 4, 2, "contiguous", lambda d: _causal_program(d), "causal"),
    "exactly-causal-bf16-mqa": (torch.bfloat16, 4, 1, "heads_inside", lambda d: _causal_program(d), "causal"),
    "tiles-masked-fp32": (torch.float32, 4, 2, "heads_inside", lambda d: _causal_program(d, docs=True, padded=True), "tiles"),
    "tiles-masked-bf16": (torch.bfloat16, 4, 2, "heads_inside", lambda d: _causal_program(d, docs=True), "tiles"),
    "tiles-interpreted-softcap": (torch.float32, 4, 2, "heads_inside", _softcap_program, "tiles"),
    "tiles-no-key-in-a-row": (torch.float32, 4, 2, "contiguous", _keyless_program, "tiles"),
    "tiles-fp64": (torch.float64, 4, 4, "heads_inside", lambda d: causal_docs_padding(), "tiles"),
}


def _attention_case(path):
    dtype, heads, kv_heads, layout, build, expect = ATTENTION_PATHS[path]
    built = build(dtype)
    text, leaves = built[0], built[1]
    q, k, v = _qkv(dtype, heads, kv_heads, layout=layout)
    live = torch.ops.autosp_attn.live_tiles.default(leaves, text, 8, S, S)
    assert bool((live.diagonal() == CAUSAL).all()) == (expect == "causal"), f"{path}: the map does not drive the path under test"
    return q, k, v, leaves, live, text


@pytest.mark.parametrize("path", list(ATTENTION_PATHS))
def test_tiled_attention_ops_agree_with_their_fake_kernels(path):
    """``tiled_attention`` and its backward, each path: the outputs' sizes, strides and dtypes are
    the fake kernel's, and the autograd registration holds."""
    q, k, v, leaves, live, text = _attention_case(path)
    forward = torch.ops.autosp_attn.tiled_attention.default
    assert failures(torch.library.opcheck(forward, (q, k, v, leaves, live, text, 8), **OPCHECK)) == {}
    with torch.no_grad():
        out, m, l = forward(q, k, v, leaves, live, text, 8)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(out.dtype)
    args = (grad, *(x.detach() for x in (q, k, v)), out, m, l, live, leaves, text, 8)
    assert failures(torch.library.opcheck(torch.ops.autosp_attn.tiled_attention_backward.default, args, **OPCHECK)) == {}


def test_live_tiles_agrees_with_its_fake_kernel():
    for path in ("exactly-causal-fp32", "tiles-masked-fp32", "tiles-interpreted-softcap"):
        dtype, *_, build, _ = ATTENTION_PATHS[path]
        text, leaves = build(dtype)[:2]
        args = (leaves, text, 8, S, S)
        assert failures(torch.library.opcheck(torch.ops.autosp_attn.live_tiles.default, args, **OPCHECK)) == {}, path


def test_opcheck_catches_the_fused_kernels_own_layout(monkeypatch):
    """The control: the exactly-causal path returning the fused kernel's log-sum-exp as it comes
    (``[B, S, H]`` strides, the bug Inductor stopped on) fails opcheck's fake-tensor test."""
    q, k, v, leaves, live, text = _attention_case("exactly-causal-fp32")
    monkeypatch.setattr(tiled_attention_module, "in_layout", lambda x, buf: x.to(buf.dtype))
    results = torch.library.opcheck(torch.ops.autosp_attn.tiled_attention.default, (q, k, v, leaves, live, text, 8), **OPCHECK)
    assert "Stride mismatch" in str(results["test_faketensor"])


def test_tiled_rows_agree_with_their_fake_kernels():
    """A tiled MLP region, rows given contiguous and as a transposed view, 16-bit weights too."""
    from autosp.ops.tiled_rows import register_region

    for dtype in (torch.float32, torch.bfloat16):
        w1 = torch.randn(24, 8, dtype=dtype, requires_grad=True)
        w2 = torch.randn(8, 24, dtype=dtype, requires_grad=True)
        region = torch.fx.symbolic_trace(_Mlp())
        for x in (torch.randn(2, 11, 8, dtype=dtype), torch.randn(11, 2, 8, dtype=dtype).transpose(0, 1)):
            x.requires_grad_()
            key = register_region(region, x, [w1, w2], None)
            assert failures(torch.library.opcheck(torch.ops.autosp_tile.rows.default, (x, [w1, w2], key, 4), **OPCHECK)) == {}
            grad = torch.randn(2, 11, 8, dtype=dtype)
            args = (grad, x.detach(), [w1.detach(), w2.detach()], key, 4)
            assert failures(torch.library.opcheck(torch.ops.autosp_tile.rows_backward.default, args, **OPCHECK)) == {}


class _Mlp(torch.nn.Module):
    def forward(self, x, w1, w2):
        return torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(x, w1)), w2)


@pytest.mark.parametrize("bias,with_grad,dtype", [(True, True, torch.float32), (False, True, torch.bfloat16), (True, False, torch.float32)])
def test_fused_loss_agrees_with_its_fake_kernel(bias, with_grad, dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(13, 8, generator=g).to(dtype).requires_grad_(with_grad)
    w = torch.randn(16, 8, generator=g).to(dtype).requires_grad_(with_grad)
    b = torch.randn(16, generator=g).to(dtype).requires_grad_(with_grad) if bias else None
    target = torch.randint(0, 16, (13,), generator=g)
    target[::4] = -100
    args = (h, w, b, target, None, -100, 0.0, torch.float32, 5, with_grad)
    assert failures(torch.library.opcheck(torch.ops.autosp_loss.linear_cross_entropy.default, args, **OPCHECK)) == {}


def test_offload_ops_agree_with_their_fake_kernels():
    x = torch.randn(4, 6, 3).transpose(0, 1)  # strides kept, not made contiguous
    assert failures(torch.library.opcheck(torch.ops.autosp_offload.offload.default, (x,), **OPCHECK)) == {}
    assert failures(torch.library.opcheck(torch.ops.autosp_offload.reload.default, (x, torch.device("cpu")), **OPCHECK)) == {}


# ------------------------------------------------------------------ the collectives and the ring, in two processes
def _collective_ops_rank(rank: int, world: int) -> dict:
    """opcheck of every op that talks to the group, run by both ranks in the same order."""
    group = dist.group.WORLD.group_name
    seq = 37  # 19 + 18 tokens: the uneven split
    local = [19, 18][rank]
    g = torch.Generator().manual_seed(rank)
    ops = torch.ops.autosp
    results = {}

    def check(name, op, args):
        results[name] = failures(torch.library.opcheck(op, args, **OPCHECK))

    send = torch.randn(world, B, local, 2, D, generator=g, requires_grad=True)  # [P, B, S_r, H/P, D]
    check("seq_gather", ops.seq_gather.default, (send, 1, group, seq, rank))
    full = torch.randn(B, seq, 2, D, generator=g).transpose(1, 2).requires_grad_()  # [B, H/P, S, D], not contiguous
    check("seq_scatter", ops.seq_scatter.default, (full, 2, group, world, seq, rank))
    check("ring_seq_gather", ops.ring_seq_gather.default, (send[:1].detach().requires_grad_(), 1, group, seq, rank, 2, True))
    segment = [19, 18][rank]  # ring=2 over 37 tokens, head-tail: 10 + 9 and 9 + 9
    seg = torch.randn(B, 2, segment, D, generator=g, requires_grad=True)
    check("ring_seq_scatter", ops.ring_seq_scatter.default, (seg, 2, group, world, seq, rank, 2, True))
    check("all_reduce", ops.all_reduce.default, (torch.randn(3, 4, generator=g).t().requires_grad_(), group, world))
    num, den = torch.tensor(3.0 + rank, requires_grad=True), torch.tensor(7.0 + rank, requires_grad=True)
    check("group_ratio", ops.group_ratio.default, (num, den, group, world))
    check("group_ratio_backward", ops.group_ratio_backward.default, (torch.tensor(1.0), torch.tensor([9.0, 15.0]), group, world))
    check("all_gather", ops.all_gather.default, (torch.randn(4, 3, generator=g, requires_grad=True), 1, group, world))
    check("reduce_scatter", ops.reduce_scatter.default, (torch.randn(4, 6, generator=g, requires_grad=True), 1, group, world))
    halo = torch.randn(B, 6, 3, generator=g).transpose(1, 2).requires_grad_()  # a convolution's left context, not contiguous
    check("seq_pass-forward", ops.seq_pass.default, (halo, True, group, world, rank))
    check("seq_pass-backward", ops.seq_pass.default, (halo, False, group, world, rank))
    mixed = torch.randn(B, local, 4, D, generator=g, requires_grad=True)  # a sequence mixer's input [B, S_r, H, D]
    check("pack_heads", ops.pack_heads.default, (mixed, 2, 1, world))
    channels = torch.randn(B, local, 6, generator=g).transpose(1, 2).requires_grad_()  # Mamba-1's [B, D, S_r], not contiguous
    check("pack_heads-channels", ops.pack_heads.default, (channels, 1, 2, world))
    # the ring: this rank's segment of 37 positions, a mask with documents and padding, GQA
    from autosp.layout import ring_segment_length

    for dtype in (torch.float32, torch.bfloat16):
        text, leaves = _causal_program(dtype, seq=seq, docs=True, padded=True)
        L = ring_segment_length(seq, 2, rank, True)
        q, k, v = _qkv(dtype, 4, 2, seq=L, seed=10 + rank)
        maps_args = (leaves, text, 8, seq, 2, rank, True)
        check(f"ring_live_tiles-{dtype}", torch.ops.autosp_attn.ring_live_tiles.default, maps_args)
        maps = torch.ops.autosp_attn.ring_live_tiles.default(*maps_args)
        args = (q, k, v, leaves, maps, text, 8, seq, group, rank, 2, True)
        check(f"ring_attention-{dtype}", torch.ops.autosp_attn.ring_attention.default, args)
        with torch.no_grad():
            out, m, l = torch.ops.autosp_attn.ring_attention.default(*args)
        grad = torch.randn(out.shape, generator=g).to(dtype)
        back = (grad, q.detach(), k.detach(), v.detach(), out, m, l, leaves, maps, text, 8, seq, group, rank, 2, True)
        check(f"ring_attention_backward-{dtype}", torch.ops.autosp_attn.ring_attention_backward.default, back)
    return results


def test_collectives_and_ring_ops_agree_with_their_fake_kernels(tmp_path):
    for rank, results in enumerate(spawn(tmp_path, _collective_ops_rank, 2)):
        assert len(results) == 19 and {k: v for k, v in results.items() if v} == {}, rank
