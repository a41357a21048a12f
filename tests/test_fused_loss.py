"""The fused, chunked vocabulary projection and loss: the op against autograd on full logits,
and where the pass uses it (only where nothing else reads the logits).

End to end (loss and gradients against one device, in chunks that do not divide the tokens)
it runs in ``test_numerics.py``, where every case but one uses it."""

import operator

import pytest
import torch
import torch.nn.functional as F
from sp_harness import lm_loss, make_model
from test_pass import batch, capture

from lightning_autosp import AutoSPStrategy

from autosp.ops import fused_loss
from autosp.passes import runtime, sequence_parallel_pass

TOL = 1e-5


def _case(bias: bool, class_weight: bool, smoothing: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    N, D, V = 45, 16, 50
    h = torch.randn(N, D, generator=g, requires_grad=True)
    w = torch.randn(V, D, generator=g, requires_grad=True)
    b = torch.randn(V, generator=g, requires_grad=True) if bias else None
    target = torch.randint(0, V, (N,), generator=g)
    target[::4] = -100
    cw = torch.rand(V, generator=g) if class_weight else None
    return h, w, b, target, cw, smoothing


def _errors(h, w, b, target, cw, smoothing, chunk=7):
    """Relative errors of the op's loss and gradients (h, W, b) against autograd on full logits;
    the loss is scaled as a mean would be, so backward sees a grad_output that is not 1."""
    params = [h, w] + ([b] if b is not None else [])
    ref = F.cross_entropy(F.linear(h, w, b), target, weight=cw, ignore_index=-100, reduction="sum", label_smoothing=smoothing)
    ref_grads = torch.autograd.grad(ref / 37, params)
    got = fused_loss.linear_cross_entropy(h, w, b, target, cw, -100, smoothing, None, chunk, True)[0]
    got_grads = torch.autograd.grad(got / 37, params)
    loss_err = float(((got - ref).abs() / ref.abs()).detach())
    grad_err = max(float((a - r).norm() / r.norm()) for a, r in zip(got_grads, ref_grads))
    return loss_err, grad_err


@pytest.mark.parametrize(
    "bias,class_weight,smoothing", [(False, False, 0.0), (True, False, 0.0), (False, True, 0.0), (True, False, 0.1)]
)
def test_op_matches_autograd_on_full_logits(bias, class_weight, smoothing):
    """45 tokens in chunks of 7 (the last one 3), every 4th target ignored."""
    loss_err, grad_err = _errors(*_case(bias, class_weight, smoothing))
    assert loss_err <= TOL and grad_err <= TOL, (loss_err, grad_err)


@pytest.mark.parametrize("path", ["plain", "class_weight"])
def test_negative_control_gradient_that_forgets_ignore_index(monkeypatch, path):
    """A chunked gradient that lets ignored targets contribute fails the same comparison, on
    both paths of the op: the plain one (loss and gradient in the logits' memory) and the one
    for class weights and label smoothing (the gradient computed apart from the loss)."""
    if path == "plain":
        real = fused_loss._plain_loss_and_grad
        monkeypatch.setattr(fused_loss, "_plain_loss_and_grad", lambda z, t, ii, wg: real(z, t.clamp_min(0), ii, wg))
    else:
        real = fused_loss._logits_grad
        monkeypatch.setattr(fused_loss, "_logits_grad", lambda z, t, cw, ii, s: real(z, t.clamp_min(0), cw, ii, s))
    loss_err, grad_err = _errors(*_case(False, path == "class_weight", 0.0))
    assert grad_err > 100 * TOL
    if path == "class_weight":  # there the loss is F.cross_entropy's, untouched
        assert loss_err <= TOL


def test_op_without_grad_returns_the_loss_only():
    h, w, b, target, cw, s = _case(True, False, 0.0)
    with torch.no_grad():
        ref = F.cross_entropy(F.linear(h, w, b), target, ignore_index=-100, reduction="sum")
        total, gh, gw, gb = fused_loss.linear_cross_entropy(h, w, b, target, None, -100, 0.0, None, 8, False)
    assert float((total - ref).abs() / ref) <= TOL
    assert gh.numel() == gw.numel() == gb.numel() == 0


def test_low_precision_logits_cast_to_fp32():
    """bf16 weights with logits upcast to fp32 (Hugging Face's ``logits.float()``): the loss
    and gradients of autograd through the same casts, to bf16 precision."""
    h, w, _, target, _, _ = _case(False, False, 0.0)
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    ref = F.cross_entropy(F.linear(hb, wb).float(), target, ignore_index=-100, reduction="sum")
    ref_grads = torch.autograd.grad(ref, [hb, wb])
    got = fused_loss.linear_cross_entropy(hb, wb, None, target, None, -100, 0.0, torch.float32, 7, True)[0]
    assert got.dtype == torch.float32 and float(((got - ref).abs() / ref).detach()) <= 1e-5
    for a, r in zip(torch.autograd.grad(got, [hb, wb]), ref_grads):
        assert a.dtype == torch.bfloat16 and float((a.float() - r.float()).norm() / r.float().norm()) <= 1e-2


def test_auto_chunk_keeps_fp32_logits_of_a_chunk_near_256_mib():
    assert fused_loss.auto_chunk_rows(128256) == 523 and fused_loss.auto_chunk_rows(32000) == 2097
    assert fused_loss.auto_chunk_rows(64) == 2**20


# ------------------------------------------------------------ where the pass fuses
def _fused_calls(gm):
    return [n for n in gm.graph.nodes if n.target is runtime.linear_token_loss]


def _vocab_linears(gm):
    """``linear`` nodes left in the graph whose weight is the (tied) vocabulary matrix."""
    return [n for n in gm.graph.nodes if n.target is torch._C._nn.linear and "wte" in str(n.args[1])]


@pytest.mark.parametrize("shift", [False, True])
def test_pass_fuses_the_loss_of_logits_nothing_else_reads(shift):
    gm = capture(make_model("gpt"), *batch(), shift=shift)
    out = sequence_parallel_pass(gm, sp_size=2, sp_rank=1, group_name="unused")
    assert out.meta["autosp"].fused_losses == 1
    (call,) = _fused_calls(out)
    assert call.args[4] is True  # with_grad: the gradients are computed while a chunk's logits are live
    assert not _vocab_linears(out)  # the full logits are gone
    # negative control: chunked_loss=False keeps the logits and the plain loss
    kept = sequence_parallel_pass(gm, sp_size=2, sp_rank=1, group_name="unused", loss_chunk=None)
    assert kept.meta["autosp"].fused_losses == 0 and not _fused_calls(kept) and len(_vocab_linears(kept)) == 1


def _capture_fn(fn, model, grad=True):
    graphs = []
    x, y = batch()
    torch._dynamo.mark_dynamic(x, 1)
    torch._dynamo.mark_dynamic(y, 1)
    with torch.set_grad_enabled(grad):
        torch.compile(fn, backend=lambda gm, ex: graphs.append(gm) or gm.forward)(x, y)
    assert len(graphs) == 1
    return sequence_parallel_pass(graphs[0], sp_size=2, sp_rank=0, group_name="unused")


def test_pass_keeps_logits_the_step_returns_or_reads():
    model = make_model("gpt")

    def returns_logits(a, b):
        logits = model(a)
        return lm_loss(logits, b, False), logits

    def reads_logits(a, b):
        logits = model(a)
        return lm_loss(logits, b, False) + logits.float().pow(2).mean()

    def classes_not_last(a, b):  # cross_entropy on [B, V, S]
        return F.cross_entropy(model(a).transpose(1, 2), b)

    def slice_after_reshape(a, b):  # the slice picks rows of the flattened logits, not of h
        logits = model(a)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1))[:-1], b.reshape(-1)[1:])

    def double_rounding(a, b):  # fp32 -> fp16 -> fp32 rounds what one cast would not
        logits = model(a)
        return F.cross_entropy(logits.half().float().view(-1, logits.size(-1)), b.view(-1))

    for fn in (returns_logits, reads_logits, classes_not_last, slice_after_reshape, double_rounding):
        out = _capture_fn(fn, model)
        assert out.meta["autosp"].fused_losses == 0, fn.__name__
        assert len(_vocab_linears(out)) == 1, fn.__name__


def test_pass_fuses_hugging_face_style_upcast_and_no_grad_graphs():
    """bf16 logits upcast with ``.float()`` before the loss keep the upcast (fp32 logits per
    chunk); a graph traced without grad asks for no gradients."""
    model = make_model("gpt").bfloat16()

    def hf_style(a, b):
        logits = model(a).float()
        labels = F.pad(b, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100, reduction="sum")

    (call,) = _fused_calls(_capture_fn(hf_style, model))
    assert call.args[3] == torch.float32 and call.args[4] is True
    (call,) = _fused_calls(_capture_fn(hf_style, model, grad=False))
    assert call.args[4] is False


def test_chunked_loss_argument_is_validated():
    assert AutoSPStrategy(chunked_loss=False).loss_chunk is None
    assert AutoSPStrategy(chunked_loss=True).loss_chunk == 0
    assert AutoSPStrategy(chunked_loss=1024).loss_chunk == 1024
    for bad in (0, -5, 2.5, "auto"):
        with pytest.raises(ValueError, match=r"chunked_loss=.*positive number of tokens per chunk"):
            AutoSPStrategy(chunked_loss=bad)


def test_getitem_is_the_only_replayed_step():
    """Row slices are replayed on the hidden states; the pass adds no other node for them."""
    gm = capture(make_model("gpt"), *batch(), shift=True)
    out = sequence_parallel_pass(gm, sp_size=2, sp_rank=1, group_name="unused")
    (call,) = _fused_calls(out)
    assert call.args[0].target is operator.getitem


def test_pass_follows_autocast_dtypes():
    """Under bf16 autocast the projection runs in bf16 (h and W cast as autocast casts them)
    and the loss in fp32 (autocast upcasts cross_entropy), as on one device."""
    model = make_model("gpt")

    def step(a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lm_loss(model(a), b, False)

    (call,) = _fused_calls(_capture_fn(step, model))
    assert call.args[0].target == "to" and call.args[0].args[1] == torch.bfloat16
    assert call.args[1].target == "to" and call.args[1].args[1] == torch.bfloat16
    assert call.args[3] == torch.float32


def test_pass_fuses_after_torch_rms_norm():
    """``torch.nn.RMSNorm`` (``torch.rms_norm`` in the graph) is token-wise like ``F.rms_norm``:
    it stays sharded, and the loss after it is fused."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.RMSNorm(16), torch.nn.Linear(16, 64, bias=False))
    out = _capture_fn(lambda a, b: lm_loss(model(a), b, False), model)
    assert out.meta["autosp"].fallbacks == [] and out.meta["autosp"].fused_losses == 1
