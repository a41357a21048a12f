"""Ordinary model code that once crashed inside the pass: a per-head 3-D attention bias,
``type_as``/``to`` with a tensor of another shape, ``var``/``std`` with positional ``unbiased``,
a class-weighted loss whose ``ignore_index`` is not a class, a batch whose first tensor is
not the ``[B, S]`` token tensor, and a step that runs the model on ``tokens[:, :-1]``. Each runs under sp=2 and is compared with one device on loss
and gradients, with the naive-sharding negative control. A batch tensor with a feature dim that
happens to equal the sequence length gets a clear error."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from sp_harness import VOCAB, FnModule, TokenData, check_against_references, run_fit

IGNORE = VOCAB + 3  # an ignore_index that is not a class
FEATURES = 8


class FeatureData(TokenData):
    """Batches whose first tensor is a ``[B, features]`` float vector, then ids and labels."""

    def __init__(self, n, seq_len, features=FEATURES):
        super().__init__(n, seq_len)
        self.f = torch.randn(n, features, generator=torch.Generator().manual_seed(3))

    def __getitem__(self, i):
        return {"feats": self.f[i], **super().__getitem__(i)}


class PatternLM(nn.Module):
    def __init__(self, pattern: str, heads: int = 4, d: int = 32, layers: int = 2):
        super().__init__()
        torch.manual_seed(7)
        self.pattern, self.h, self.hd = pattern, heads, d // heads
        self.emb = nn.Embedding(VOCAB, d)
        self.qkv = nn.ModuleList([nn.Linear(d, 3 * d) for _ in range(layers)])
        self.o = nn.ModuleList([nn.Linear(d, d) for _ in range(layers)])
        self.head = nn.Linear(d, VOCAB)
        if pattern == "features_first":  # per-sample features
            self.feat = nn.Linear(FEATURES, d)
        self.register_buffer("slopes", 2.0 ** -torch.arange(1, heads + 1, dtype=torch.float32))

    def _bias(self, S: int, device) -> torch.Tensor:
        """ALiBi: a float bias per head, [H, S, S], -inf above the diagonal."""
        i = torch.arange(S, device=device)
        dist = (i[:, None] - i[None, :]).float()  # [S, S]
        bias = -self.slopes[:, None, None] * dist.abs()  # [H, S, S]
        return bias.masked_fill(dist < 0, float("-inf"))

    def _manual_attention(self, q, k, v, bias):
        """Attention by hand: Gemma-2's soft-capped logits and a boolean causal mask
        (``manual_softcap``), or an additive per-head bias ``[H, S, S]`` with k transposed by
        ``mT`` and the probabilities computed in float64 and converted back (``manual_bias``)."""
        S = q.size(-2)
        if self.pattern == "manual_stable":  # scores read twice (a stable softmax by hand): not matched
            scores = q @ k.transpose(-2, -1)
            e = torch.exp(scores - scores.amax(-1, keepdim=True))
            return (e / e.sum(-1, keepdim=True)) @ v
        if self.pattern == "manual_softcap":
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
            scores = torch.tanh(scores / 5.0) * 5.0
            causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
            probs = F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            return F.dropout(probs, p=0.0, training=self.training) @ v
        scores = torch.matmul(q, k.mT) * self.hd**-0.5 + bias
        return F.softmax(scores, dim=-1, dtype=torch.float64).to(q.dtype) @ v

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x, x.shape[-1:])
        if self.pattern == "var_positional":  # torch.var(x, dim, unbiased, keepdim), x.std(dim, unbiased, keepdim)
            var = torch.var(x, 0, True, False)  # over the batch: [S, d]
            std = x.std(0, False, True)  # [1, S, d]
            return normed * (1 + 0.1 * torch.tanh(var))[None] + 0.01 * std
        return normed

    def forward(self, idx: torch.Tensor, feats: torch.Tensor | None = None) -> torch.Tensor:
        B, S = idx.shape
        x = self.emb(idx)  # [B, S, d]
        if feats is not None:
            x = x + self.feat(feats)[:, None, :]
        if self.pattern == "to_other_shape":
            x = x.type_as(self.head.weight)  # reference of another shape: only its dtype counts
            pos = torch.arange(S, device=idx.device).to(x) / S  # [S], converted like x
            x = x + pos[None, :, None]
        bias = self._bias(S, idx.device) if self.pattern in ("alibi_hss", "manual_bias") else None
        for qkv, o in zip(self.qkv, self.o):
            q, k, v = qkv(self._norm(x)).view(B, S, 3 * self.h, self.hd).transpose(1, 2).chunk(3, dim=1)  # [B, H, S, D]
            if self.pattern.startswith("manual"):
                y = self._manual_attention(q, k, v, bias)
            elif bias is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            x = x + o(y.transpose(1, 2).reshape(B, S, -1))
        return self.head(self._norm(x))


def pattern_loss(model: PatternLM, batch) -> torch.Tensor:
    if model.pattern == "slice_before_model":  # nanoGPT's and LitGPT's pretraining loops: attention runs over S - 1
        tokens = batch["input_ids"]
        return F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    logits = model(batch["input_ids"], batch.get("feats"))
    labels = batch["labels"]
    if model.pattern == "weighted_ignore_not_a_class":
        labels = labels.masked_fill(labels == -100, IGNORE)
        weight = torch.linspace(0.5, 1.5, VOCAB, device=logits.device)
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), weight=weight, ignore_index=IGNORE)
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


PATTERNS = [
    "alibi_hss", "to_other_shape", "var_positional", "weighted_ignore_not_a_class", "features_first", "slice_before_model",
    "manual_softcap", "manual_bias",
]


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("pattern", PATTERNS)
def test_pattern_matches_one_device(tmp_path, pattern):
    factory = lambda: PatternLM(pattern)  # noqa: E731
    data = FeatureData(8, 24) if pattern == "features_first" else TokenData(8, 24)
    run = run_fit(tmp_path, FnModule(factory, pattern_loss, log_loss=False), data, devices=2, sp_size=2)
    loss_err, grad_err, naive = check_against_references(run, 2, factory, pattern_loss)
    graphs = run.ranks[0]["graphs"]["training_step"]
    assert sum(g.attention for g in graphs) == 2 and all(not g.fallbacks for g in graphs), [g.fallbacks for g in graphs]
    assert sum(g.manual_attention for g in graphs) == (2 if pattern.startswith("manual") else 0)


@pytest.mark.full
def test_feature_dim_equal_to_the_sequence_length_is_a_clear_error(tmp_path):
    """``feats`` is ``[B, 24]`` and so is the sequence: by shape alone it is a sequence tensor,
    but the model feeds it to a Linear(24, d). Before: Dynamo's internal ConstraintViolationError."""
    factory = lambda: PatternLM("features_first")  # noqa: E731
    model_of_24 = lambda: _with_features(factory(), 24)  # noqa: E731
    with pytest.raises(Exception, match=r"(?s)batch\['feats'\] dim 1.*uses one of them as a fixed size.*size other than the sequence length"):
        run_fit(tmp_path, FnModule(model_of_24, pattern_loss), FeatureData(4, 24, features=24), devices=2, sp_size=2, steps=1)


def _with_features(model: PatternLM, features: int) -> PatternLM:
    model.feat = nn.Linear(features, model.emb.embedding_dim)
    return model
