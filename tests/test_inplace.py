"""In-place ops: one device's numbers, or an AutoSPError naming the op and the user's line.

The exact patterns run under sp=2 against one device (loss and gradients) with the
naive-sharding negative control; before the in-place policy each of them gave other numbers
than one device without any error (the mutation went to a gathered copy or a stale slice).
The refused patterns are checked on the captured graph, with no process group.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from sp_harness import VOCAB, FnModule, TokenData, check_against_references, run_fit

from lightning_autosp import AutoSPError
from autosp.passes import sequence_parallel_pass


class InplaceLM(nn.Module):
    def __init__(self, pattern: str, heads: int = 4, d: int = 32, layers: int = 2):
        super().__init__()
        torch.manual_seed(11)
        self.pattern, self.h, self.hd = pattern, heads, d // heads
        self.emb = nn.Embedding(VOCAB, d)
        self.qkv = nn.ModuleList([nn.Linear(d, 3 * d) for _ in range(layers)])
        self.o = nn.ModuleList([nn.Linear(d, d) for _ in range(layers)])
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, S = idx.shape
        x = self.emb(idx)  # [B, S, d], sharded from here
        if self.pattern == "mask_mutated_after_slice":
            keep = (idx != 0).float()[..., None].repeat(1, 1, x.shape[-1])  # [B, S, d], replicated
            view = keep.view(B, S, -1)  # a view of keep
            x = x + view  # sliced here ...
            keep.mul_(torch.linspace(0.5, 1.5, x.shape[-1]))  # ... then changed in place through the base
            x = x + view  # one device: the view sees the change
        for qkv, o in zip(self.qkv, self.o):
            h = F.layer_norm(x, (x.shape[-1],))
            if self.pattern == "mul_and_alias":
                h.mul_(2)  # on a shard
                g = h
                g += 1  # through an alias
                h.add_(x)
            q, k, v = qkv(h).view(B, S, 3 * self.h, self.hd).transpose(1, 2).chunk(3, dim=1)  # [B, H, S, D]
            y = o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, -1))
            if self.pattern == "relu_after_gather":
                flipped = torch.flip(y, dims=[1]).cumsum(1)  # no rule: y is all-gathered here ...
                F.relu(y, inplace=True)  # ... then changed in place: the gathered copy is stale
                y = y + 0.01 * torch.flip(flipped, dims=[1]) + 0.01 * torch.flip(y, dims=[1])
            x = x + y
        return self.head(F.layer_norm(x, (x.shape[-1],)))


def loss_fn(model, batch):
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100)


@pytest.mark.parametrize(
    "pattern", ["mul_and_alias", pytest.param("relu_after_gather", marks=[pytest.mark.slow, pytest.mark.full]),
                pytest.param("mask_mutated_after_slice", marks=pytest.mark.full)]
)
def test_inplace_matches_one_device(tmp_path, pattern):
    factory = lambda: InplaceLM(pattern)  # noqa: E731
    run = run_fit(tmp_path, FnModule(factory, loss_fn, log_loss=False), TokenData(8, 24), devices=2, sp_size=2)
    check_against_references(run, 2, factory, loss_fn)
    assert sum(g.sdpa for g in run.ranks[0]["graphs"]["training_step"]) == 2


def _capture(fn, *inputs):
    graphs = []
    for t in inputs:
        torch._dynamo.mark_dynamic(t, 1)
    torch.compile(fn, backend=lambda gm, ex: graphs.append(gm) or gm.forward)(*inputs)
    return graphs[0]


def _attention(x, heads=4):  # [B, S, d] -> [B, S, d]
    B, S, d = x.shape
    q = x.view(B, S, heads, d // heads).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(B, S, d)


def _setitem_on_shard(emb, idx):
    x = emb(idx)
    x[:, :, 0] = 0  # the line the error must show
    return _attention(x).sum()


def _copy_into_new_empty(emb, idx):
    x = emb(idx)
    buf = x.new_empty(x.shape[0], x.shape[1], 2 * x.shape[2])
    buf[..., : x.shape[2]].copy_(x)  # DeepSeek-V3 builds its keys this way
    buf[..., x.shape[2] :].copy_(x)
    return _attention(buf).sum()


def _copy_along_the_sequence(emb, idx):
    x = emb(idx)
    buf = x.new_zeros(x.shape)
    buf[:, 1:].copy_(x[:, :-1])  # moves every token one position: crosses the ranks' boundaries
    return _attention(buf).sum()


def _scatter_on_shard(emb, idx):
    x = emb(idx)
    x.scatter_(1, torch.zeros_like(idx)[..., None].expand(-1, -1, x.shape[2]), 1.0)  # along the sequence
    return _attention(x).sum()


@pytest.mark.parametrize(
    "fn,op,line",
    [
        (_setitem_on_shard, "setitem", "x[:, :, 0] = 0"),
        (_copy_along_the_sequence, "copy_", "buf[:, 1:].copy_(x[:, :-1])"),
        (_scatter_on_shard, "scatter_", "x.scatter_(1"),
    ],
)
def test_inplace_that_cannot_be_exact_is_refused(fn, op, line):
    emb = nn.Embedding(VOCAB, 16)
    idx = torch.randint(0, VOCAB, (2, 12))
    gm = _capture(lambda i: fn(emb, i), idx)
    with pytest.raises(AutoSPError, match=f"in-place op `{op}`") as err:
        sequence_parallel_pass(gm, sp_size=2, sp_rank=0, group_name="unused")
    assert "test_inplace.py" in str(err.value) and line in str(err.value)  # the user's line
    assert "Write it out of place" in str(err.value)


def _scatter_along_features(emb, idx):
    x = emb(idx)
    x.scatter_(2, torch.zeros_like(idx)[..., None], 1.0)  # one feature per token: each rank's own tokens
    return _attention(x).sum()


@pytest.mark.parametrize("fn", [_copy_into_new_empty, _scatter_along_features])
def test_inplace_writes_that_keep_the_sequence_whole_run_locally(fn):
    """A fresh buffer as long as the sequence is created split like the activations (its local
    size), so ``copy_`` into feature slices of it (DeepSeek-V3's q and k) and ``scatter_`` along a
    feature dim run on each rank's tokens: no gather, no refusal (numerics: the DeepSeek-V3 test
    in test_any_model.py and the router's scatter_ below). The refusals above are the negative
    control: writes across the sequence stay errors."""
    emb = nn.Embedding(VOCAB, 16)
    gm = _capture(lambda i: fn(emb, i), torch.randint(0, VOCAB, (2, 12)))
    out = sequence_parallel_pass(gm, sp_size=2, sp_rank=0, group_name="unused")
    assert out.meta["autosp"].sdpa == 1 and not out.meta["autosp"].fallbacks
    if fn is _copy_into_new_empty:
        (buf,) = [n for n in out.graph.nodes if n.target == "new_empty"]
        assert not isinstance(buf.args[2], int)  # the local length (a node), not the global 12


def test_inplace_on_replicated_values_is_left_alone():
    """Negative control for the refusals: in-place work on tensors no rank splits (a mask built
    in place) passes through unchanged."""

    def fn(emb, idx):
        mask = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool).tril()
        mask[:, 0] = True
        mask.logical_not_()
        x = emb(idx)
        B, S, d = x.shape
        q = x.view(B, S, 4, d // 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=~mask).sum()

    emb = nn.Embedding(VOCAB, 16)
    gm = _capture(lambda i: fn(emb, i), torch.randint(0, VOCAB, (2, 12)))
    out = sequence_parallel_pass(gm, sp_size=2, sp_rank=0, group_name="unused")
    assert out.meta["autosp"].sdpa == 1 and not out.meta["autosp"].fallbacks
