"""Dropout under SP: shards draw independent masks, forward and backward use the same mask,
and attention dropout - which cannot be drawn that way - is refused by name.

Every SP rank starts a step from the same RNG state, so before the random-op rules the dropout
mask of token ``i`` was the same on every shard (measured: shard masks agreed on 100% of their
elements at p=0.5). The run below records the full dropout mask of each step and checks
(1) the shards' masks agree on about half their elements, as independent draws do, (2) the
keep rate is 1 - p, and (3) replaying the steps on one device with the recorded masks gives
the same loss and gradients, while replaying with another mask does not.
"""

import math

import lightning as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from sp_harness import VOCAB, TokenData, compare, run_fit

from lightning_autosp import AutoSPError
from autosp.passes import sequence_parallel_pass

P = 0.5
S = 32


class DropoutLM(nn.Module):
    """Embedding -> dropout -> attention -> head; ``keep`` replays a recorded mask."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        torch.manual_seed(21)
        self.h, self.hd = heads, d // heads
        self.emb = nn.Embedding(VOCAB, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx, keep=None):
        B, L_ = idx.shape
        x = self.emb(idx)
        dropped = F.dropout(x, P, self.training) if keep is None else x * keep / (1 - P)
        q, k, v = self.qkv(dropped).view(B, L_, 3 * self.h, self.hd).transpose(1, 2).chunk(3, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(dropped + self.o(y.transpose(1, 2).reshape(B, L_, -1))), dropped


def _loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


class DropoutModule(L.LightningModule):
    def __init__(self, out_dir):
        super().__init__()
        self.model = DropoutLM()
        self.out_dir = str(out_dir)
        self.kept = []

    def training_step(self, batch, batch_idx):
        logits, dropped = self.model(batch["input_ids"])
        return {"loss": _loss(logits, batch["labels"]), "kept": dropped != 0}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.kept.append(outputs["kept"].detach().clone())

    def on_train_end(self):
        torch.save(self.kept, f"{self.out_dir}/kept{self.global_rank}.pt")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _replay(run, masks):
    model = DropoutLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for batch, keep in zip(run.ranks[0]["batches"], masks):
        loss = _loss(model(batch["input_ids"], keep.float())[0], batch["labels"])
        loss.backward()
        losses.append([loss.item()])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


def test_dropout_masks_are_independent_across_shards(tmp_path):
    run = run_fit(tmp_path, DropoutModule(tmp_path), TokenData(8, S), devices=2, sp_size=2, steps=3)
    kept = [torch.load(tmp_path / f"kept{r}.pt") for r in range(2)]
    for a, b in zip(*kept):
        assert torch.equal(a, b)  # one global mask, the same on both ranks
    for step, mask in enumerate(kept[0]):  # [B, S, d]
        n = mask[:, : S // 2].numel()
        agree = (mask[:, : S // 2] == mask[:, S // 2 :]).float().mean().item()
        rate = mask.float().mean().item()
        print(f"step {step}: shards agree on {agree:.3f} of {n} elements; keep rate {rate:.3f}")
        # independent draws agree on P^2 + (1-P)^2 = 0.5 of the elements (std 0.016 here); repeated masks on 1.0
        assert abs(agree - (P**2 + (1 - P) ** 2)) < 6 * math.sqrt(0.25 / n)
        assert abs(rate - (1 - P)) < 6 * math.sqrt(P * (1 - P) / mask.numel())
    # forward and backward used the recorded mask: one device replaying it gets the same numbers
    loss_err, grad_err = compare(run, 2, *_replay(run, kept[0]))
    print(f"replay with the recorded masks: loss rel err {loss_err:.2e}, grad rel err {grad_err:.2e}")
    assert loss_err <= 1e-4 and grad_err <= 1e-4
    # negative control: the same replay with the shard masks swapped does not match
    swapped = [torch.cat([m[:, S // 2 :], m[:, : S // 2]], dim=1) for m in kept[0]]
    loss_err, grad_err = compare(run, 2, *_replay(run, swapped))
    assert loss_err > 1e-2 and grad_err > 1e-2


def test_attention_dropout_is_refused_by_name():
    def step(idx):
        q = k = v = torch.nn.functional.embedding(idx, torch.ones(VOCAB, 32)).view(2, -1, 4, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1).sum()

    graphs = []
    idx = torch.randint(0, VOCAB, (2, 16))
    torch._dynamo.mark_dynamic(idx, 1)
    torch.compile(step, backend=lambda gm, _: graphs.append(gm) or gm.forward)(idx)
    with pytest.raises(AutoSPError, match=r"(?s)dropout_p=0.1.*heads of different ranks would share masks.*test_dropout.py"):
        sequence_parallel_pass(graphs[0], sp_size=2, sp_rank=0, group_name="unused")
