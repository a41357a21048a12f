"""Losses computed in chunks of rows (LitGPT's ``chunked_cross_entropy``) merged into one loss over
the rows before the SP pass (``autosp.passes.chunks``): the merged graph computes the
same loss and gradients, and chunkings that are not row by row are left alone."""

import copy

import pytest
import torch
import torch.nn.functional as F

from autosp.passes.chunks import merge_row_chunks

N, V = 30, 11


def litgpt_chunked(logits, targets, chunk=8):
    """As LitGPT's chunked_cross_entropy: chunks of rows of the flattened logits, a per-row loss
    per chunk, concatenated, summed, divided by the tokens that count."""
    logits, targets = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
    losses = [F.cross_entropy(lc, tc, ignore_index=-100, reduction="none") for lc, tc in zip(logits.split(chunk), targets.split(chunk))]
    n = (targets != -100).sum()
    return torch.cat(losses).sum() / n.maximum(torch.ones_like(n))


def misaligned(logits, targets):
    """Chunks of logits paired with the chunks of targets in reverse order."""
    logits, targets = logits.reshape(-1, V), targets.reshape(-1)
    pairs = zip(logits.split(8), reversed(targets.split(8)))
    return torch.cat([F.cross_entropy(lc, tc, reduction="none") for lc, tc in pairs]).sum()


def per_chunk_mean(logits, targets):
    """A mean per chunk (not a per-row loss): the chunks weigh rows differently."""
    logits, targets = logits.reshape(-1, V), targets.reshape(-1)
    return torch.stack([F.cross_entropy(lc, tc) for lc, tc in zip(logits.split(8), targets.split(8))]).sum()


def _graph(fn, logits, targets):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.maybe_mark_dynamic(logits, 1)  # symbolic where the chunking allows it
    torch._dynamo.maybe_mark_dynamic(targets, 1)
    torch.compile(fn, backend=backend)(logits, targets)
    (found,) = graphs
    return found


def _loss_and_grad(graph, logits, targets):
    gm, inputs = graph
    x = logits.detach().clone().requires_grad_()
    args = [x if a is logits else a for a in inputs]  # sizes (symbolic dims) and the targets as traced
    loss = gm(*args)[0]
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("length", [15, 16])
def test_chunked_loss_merges_into_one_exact_loss(length):
    g = torch.Generator().manual_seed(length)
    logits, targets = torch.randn(2, length, V, generator=g), torch.randint(0, V, (2, length), generator=g)
    targets[0, :3] = -100
    gm, inputs = traced = _graph(litgpt_chunked, logits, targets)
    merged = copy.deepcopy(gm)
    assert merge_row_chunks(merged) == 2  # the cat of chunk losses, then their sum
    ce = [n for n in merged.graph.nodes if n.target is F.cross_entropy]
    assert len(ce) == 1 and ce[0].kwargs["reduction"] == "sum"
    assert not [n for n in merged.graph.nodes if n.target in ("split", torch.cat) or n.target is torch.cat]
    ref_loss, ref_grad = _loss_and_grad(traced, logits, targets)
    loss, grad = _loss_and_grad((merged, inputs), logits, targets)
    assert torch.allclose(loss, ref_loss, atol=1e-6) and torch.allclose(grad, ref_grad, atol=1e-7)
    # negative control: merging only the cat but not honouring the chunk -> row map would be caught
    wrong = copy.deepcopy(gm)
    merge_row_chunks(wrong)
    (ce,) = [n for n in wrong.graph.nodes if n.target is F.cross_entropy]
    with wrong.graph.inserting_before(ce):
        rolled = wrong.graph.call_function(torch.roll, (ce.args[1], 1, 0))
    ce.update_arg(1, rolled)
    wrong.recompile()
    bad_loss, _ = _loss_and_grad((wrong, inputs), logits, targets)
    assert (bad_loss - ref_loss).abs() > 1e-3


@pytest.mark.parametrize("fn", [misaligned, per_chunk_mean], ids=["misaligned", "mean_per_chunk"])
def test_chunkings_that_are_not_row_by_row_stay(fn):
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(2, 16, V, generator=g), torch.randint(0, V, (2, 16), generator=g)
    gm, _ = _graph(fn, logits, targets)
    kept = copy.deepcopy(gm)
    assert merge_row_chunks(kept) == 0
    assert len([n for n in kept.graph.nodes if n.target is F.cross_entropy]) == 4  # 32 rows in chunks of 8


W = torch.randn(V, 6, generator=torch.Generator().manual_seed(1))
W_OTHER = W.flip(0)


def lm_head_chunks(h, labels, weights=(W,), chunk=5):
    """LitGPT's fine-tuning recipe: lm_head over chunks of ``chunk`` positions, the last chunk
    shifted, the targets split like the logits, a per-row loss per chunk, concatenated and summed."""
    logits = [F.linear(x, weights[min(i, len(weights) - 1)]) for i, x in enumerate(h.split(chunk, dim=1))]
    logits[-1] = logits[-1][..., :-1, :]
    targets = labels[..., 1:]
    losses = [
        F.cross_entropy(lc.reshape(-1, V), tc.reshape(-1), reduction="none")
        for lc, tc in zip(logits, targets.split(logits[0].size(1), dim=1))
    ]
    return torch.cat(losses).sum() / (targets != -100).sum()


@pytest.mark.parametrize("chunk", [5, 64], ids=["4chunks", "1chunk"])
def test_lm_head_chunks_merge_into_one_exact_loss(chunk):
    g = torch.Generator().manual_seed(3)
    h, labels = torch.randn(2, 18, 6, generator=g), torch.randint(0, V, (2, 18), generator=g)
    traced = _graph(lambda h, y: lm_head_chunks(h, y, chunk=chunk), h, labels)
    merged = copy.deepcopy(traced[0])
    assert merge_row_chunks(merged) == 1
    assert [n.kwargs["reduction"] for n in merged.graph.nodes if n.target is F.cross_entropy] == ["sum"]
    assert not [n for n in merged.graph.nodes if n.target == "split"]
    ref_loss, ref_grad = _loss_and_grad(traced, h, labels)
    loss, grad = _loss_and_grad((merged, traced[1]), h, labels)
    assert torch.allclose(loss, ref_loss, atol=1e-6) and torch.allclose(grad, ref_grad, atol=1e-6)
    # negative control: chunks with different weights are not one linear over the whole
    if chunk > 18:
        return  # one chunk, one weight
    other = _graph(lambda h, y: lm_head_chunks(h, y, (W, W_OTHER)), h, labels)
    kept = copy.deepcopy(other[0])
    assert merge_row_chunks(kept) == 0
    other_loss, _ = _loss_and_grad(other, h, labels)
    assert (other_loss - ref_loss).abs() > 1e-3  # merging it anyway would compute ref_loss
