"""Models whose attention masks are built from positions, shared by the mask tests: a hand-written
decoder with document ids, ALiBi and a sliding window (through SDPA or a softmax written out), the
Hugging Face families with the masks they build themselves, and batches that exercise them
(packed documents, padding on either side)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from sp_harness import VOCAB, TokenData


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes ``2^(-8 (h+1) / H)``."""
    return torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)])


class DocumentLM(nn.Module):
    """Attention with masks the model builds from positions, written by hand:

    * ``doc_ids`` ``[B, S]`` compared at the queries and the keys (packed documents),
    * causal, optionally within a sliding ``window``,
    * an ALiBi bias per head (``-slope_h * |i - j|``), optionally,

    through ``F.scaled_dot_product_attention`` with a float mask (``attention="sdpa"``) or a
    softmax written out with ``masked_fill`` (``"manual"``). ``plain=True``: ``is_causal=True``
    and nothing else (the baseline of plain causal attention)."""

    def __init__(self, heads=4, d=32, layers=2, window=None, alibi=True, attention="sdpa", plain=False, seed=11):
        super().__init__()
        torch.manual_seed(seed)
        self.h, self.hd, self.window, self.alibi, self.attention, self.plain = heads, d // heads, window, alibi, attention, plain
        self.emb = nn.Embedding(VOCAB, d)
        self.qkv = nn.ModuleList([nn.Linear(d, 3 * d) for _ in range(layers)])
        self.o = nn.ModuleList([nn.Linear(d, d) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)
        self.register_buffer("slopes", alibi_slopes(heads), persistent=False)

    def forward(self, idx: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        B, S = idx.shape
        pos = torch.arange(S, device=idx.device)
        keep = (pos[:, None] >= pos[None, :]) & (doc_ids[:, :, None] == doc_ids[:, None, :])  # [B, S, S]
        if self.window is not None:
            keep = keep & (pos[:, None] - pos[None, :] < self.window)
        keep = keep[:, None]  # [B, 1, S, S]
        bias = torch.zeros((), device=idx.device)
        if self.alibi:
            bias = -self.slopes[:, None, None] * (pos[:, None] - pos[None, :]).abs()  # [H, S, S]
        x = self.emb(idx)
        for qkv, o in zip(self.qkv, self.o):
            q, k, v = qkv(x).view(B, S, 3 * self.h, self.hd).transpose(1, 2).chunk(3, dim=1)  # [B, H, S, D] each
            if self.plain:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            elif self.attention == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(keep, bias, -math.inf))  # [B, H, S, S]
            else:
                scores = q @ k.transpose(-2, -1) / math.sqrt(self.hd) + bias
                y = torch.softmax(scores.masked_fill(~keep, -math.inf), dim=-1) @ v
            x = x + o(y.transpose(1, 2).reshape(B, S, -1))
        return self.head(self.norm(x))


def document_loss(model, batch):
    logits = model(batch["input_ids"], batch["doc_ids"])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100)


def packed_positions(seq_len: int, cuts) -> torch.Tensor:
    """Position ids of documents packed in one row, restarting at each cut."""
    pos = torch.arange(seq_len)
    for c in sorted(cuts):
        pos[c:] = torch.arange(seq_len - c)
    return pos


class PackedData(TokenData):
    """Rows of packed documents, as Hugging Face's flattening collator makes them: ``position_ids``
    restart at every document (``doc_ids`` count them), labels are the ids (the model shifts).
    Some rows start mid-document (positions from 3), one row holds a single document."""

    def __init__(self, n: int, seq_len: int):
        super().__init__(n, seq_len, ignore="none")
        self.y = self.x.clone()
        self.pos, self.doc = [], []
        for i in range(n):
            cuts = [] if i % 4 == 3 else sorted({3 + i % 5, seq_len // 2 + i % 3, seq_len - 5})
            pos = packed_positions(seq_len, cuts)
            if i % 4 == 1:
                pos[: cuts[0]] += 3  # the row starts in the middle of a document
            self.pos.append(pos)
            self.doc.append(torch.cat([torch.zeros(1, dtype=torch.long), (pos.diff() != 1).long()]).cumsum(0))

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i], "position_ids": self.pos[i], "doc_ids": self.doc[i]}


class PaddedBothSides(TokenData):
    """Hugging Face batches with padding: right, left, and on both sides, per row."""

    def __init__(self, n: int, seq_len: int):
        super().__init__(n, seq_len, ignore="none")
        self.y = self.x.clone()
        self.am = torch.ones_like(self.x)
        for i in range(n):
            left, right = [(0, 2 + i % 3), (3 + i % 2, 0), (2, 3)][i % 3]
            self.am[i, :left] = 0
            self.am[i, seq_len - right :] = 0
        self.y[self.am == 0] = -100

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i], "attention_mask": self.am[i]}


PLAIN_CAUSAL = "autosp_test_plain_causal"


def _plain_causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Plain causal attention (``is_causal=True``, no mask, no soft-capping): the memory baseline of a
    Hugging Face model (its mask builder skips models with an attention function of their own)."""
    gqa = query.shape[1] != key.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def hf_config(family: str, impl: str = "sdpa", layers: int = 1, **extra):
    transformers = pytest.importorskip("transformers")
    if impl == PLAIN_CAUSAL:
        transformers.AttentionInterface.register(PLAIN_CAUSAL, _plain_causal_attention)
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096 * 2, attn_implementation=impl,
    )
    common.update(extra)
    if family == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralForCausalLM, transformers.MistralConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**common)
    if family == "gemma2":  # alternating sliding-window and global layers, soft-capped logits
        return transformers.Gemma2ForCausalLM, transformers.Gemma2Config(**{**common, "head_dim": 8})
    raise ValueError(family)


def hf_factory(family: str, impl: str = "sdpa", layers: int = 1, seed: int = 7, **extra):
    cls, config = hf_config(family, impl, layers, **extra)

    def build():
        torch.manual_seed(seed)
        return cls(config)

    return build


def plain_call(model, batch):
    """The loss of a Hugging Face model as training code calls it: no cache, so the model builds its mask."""
    return model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss


def packed_call(model, batch):
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"], use_cache=False).loss


def padded_call(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"], use_cache=False).loss


class ModelZoo(nn.Module):
    """Several models trained in one step: ``families`` is a list of ``(name, factory, loss)``,
    :meth:`loss` the sum of each model's loss on the batch (each reads the fields it needs)."""

    def __init__(self, families):
        super().__init__()
        self.losses = [(name, loss) for name, _, loss in families]  # module-level functions: picklable
        self.models = nn.ModuleDict({name: factory() for name, factory, _ in families})

    @staticmethod
    def loss(zoo: "ModelZoo", batch) -> torch.Tensor:
        return sum(loss(zoo.models[name], batch) for name, loss in zoo.losses)
