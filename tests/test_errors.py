"""Inputs AutoSP cannot handle end with a clear error, never with a silently wrong answer."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from sp_harness import LMModule, TokenData, VOCAB, run_fit


class ManualAttentionLM(nn.Module):
    """Attention written by hand (softmax(q k^T)) instead of F.scaled_dot_product_attention."""

    def __init__(self, d=16):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        q, k, v = self.qkv(x).split(x.size(-1), dim=-1)  # [B, S, d] each
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # [B, S, S]
        return self.head(F.softmax(att, dim=-1) @ v)


class ManualAttentionModule(LMModule):
    def __init__(self):
        super().__init__("gpt")
        self.model = ManualAttentionLM()


def test_model_without_sdpa_is_rejected(tmp_path):
    with pytest.raises(Exception, match=r"no attention or other sequence mixer to parallelize.*scaled_dot_product_attention"):
        run_fit(tmp_path, ManualAttentionModule(), TokenData(8, 16), devices=2, sp_size=2, steps=1)


def test_sequence_too_short_for_sp_size(tmp_path):
    # 5 tokens over 4 ranks: the last rank would hold -1 tokens
    with pytest.raises(Exception, match=r"sequence of 5 tokens split over sp_size=4 ranks leaves the last rank -1 token"):
        run_fit(tmp_path, LMModule("gpt"), TokenData(8, 5, ignore="none"), devices=4, sp_size=4, steps=1)


class BreakingGPT(nn.Module):
    """The tiny GPT with something between its blocks that Dynamo cannot trace."""

    def __init__(self, mode):
        super().__init__()
        from sp_harness import make_model

        self.gpt, self.mode = make_model("gpt"), mode

    def forward(self, idx):
        g = self.gpt
        x = g.wte(idx) + g.wpe(torch.arange(idx.shape[1]))
        for i, block in enumerate(g.blocks):
            if self.mode == "print" and i == 1:
                print("between blocks")
            if self.mode == "branch" and i == 1 and bool(x.mean() > 0):  # data-dependent Python branch
                x = x * 1.0
            x = block(x)
        return g.head(g.ln_f(x))


class BreakingModule(LMModule):
    def __init__(self, mode):
        super().__init__("gpt")
        self.model = BreakingGPT(mode)


@pytest.mark.parametrize("mode", ["print", "branch"])
def test_graph_break_inside_the_model_is_reported(tmp_path, mode):
    with pytest.raises(Exception, match=r"(?s)graph break splits the model.*graph breaks:\n  - .*Remove print/logging"):
        run_fit(tmp_path, BreakingModule(mode), TokenData(8, 16), devices=2, sp_size=2, steps=1)



class BreakInTheStep(LMModule):
    """A graph break in ``training_step`` between two losses: the first graph (the model over the
    batch, its loss) compiles; the second (the model over the first 8 tokens, a fixed length, its
    loss, then ``self.log``) is refused."""

    def __init__(self):
        super().__init__("gpt", log_loss=True)

    def training_step(self, batch, batch_idx):
        ids, labels = batch["input_ids"], batch["labels"]
        first = F.cross_entropy(self.model(ids).flatten(0, 1), labels.flatten())
        print("between the losses")
        loss = first + F.cross_entropy(self.model(ids[:, :8]).flatten(0, 1), labels[:, :8].flatten())
        self.log("train_loss", loss)  # no graph break (made when the step returns)
        return loss


@pytest.mark.slow
def test_a_break_before_the_graph_with_the_loss_is_listed(tmp_path):
    """The graph with the loss refused, a graph break before it and none after it: the break is
    listed. Only a break that ended the refused graph stands after its loss; dropping the last
    break counted instead (what the runner did while ``self.log`` was a graph break) drops this one."""
    with pytest.raises(Exception, match=r"(?s)attention runs over 8 positions.*graph breaks:\n  - .*builtin operator `print`"):
        run_fit(tmp_path, BreakInTheStep(), TokenData(8, 16), devices=2, sp_size=2, steps=1)


class FixedLengthModule(LMModule):
    """Attention over the first 8 tokens (a fixed length), and a graph break after the loss."""

    def __init__(self):
        super().__init__("gpt", log_loss=False)

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"][:, :8]
        loss = F.cross_entropy(self.model(ids).flatten(0, 1), batch["labels"][:, :8].flatten())
        self.seen = float(loss)  # a graph break after the loss
        return loss


class ThreeHeads(LMModule):
    def __init__(self):
        super().__init__("gpt", log_loss=True)  # self.log(loss): a graph break after the loss
        from autosp.models import GPT, GPTConfig

        self.model = GPT(GPTConfig.tiny(vocab_size=VOCAB, n_layers=1, n_heads=3, dim=24))


@pytest.mark.slow
def test_refusals_list_only_the_graph_breaks_before_the_loss(tmp_path):
    """A refusal a graph break inside the model could explain (attention over a fixed length) does
    not name the break after the loss (`float(loss)`) as its cause; a refusal no graph break
    explains (heads that do not divide an explicit layout) gets no list of breaks at all, though
    the step logs its loss after computing it."""
    with pytest.raises(Exception, match=r"(?s)attention runs over 8 positions.*a fixed number") as info:
        run_fit(tmp_path, FixedLengthModule(), TokenData(8, 16), devices=2, sp_size=2, steps=1)
    assert "several graphs" not in str(info.value) and "graph break inside the model" not in str(info.value)

    with pytest.raises(Exception, match=r"3 attention heads.*not divisible by sp_size=2") as info:
        run_fit(tmp_path, ThreeHeads(), TokenData(8, 16), devices=2, sp_size=2, steps=1, sp_layout=(2, 1))
    assert "several graphs" not in str(info.value)
