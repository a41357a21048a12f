"""Checkpoints under AutoSP: a run interrupted and resumed from a ``ModelCheckpoint`` equals the
uninterrupted run, replicated (one file) and sharded (one file per rank); a sharded checkpoint
resumes on other layouts with the same parameters and optimizer state."""

import lightning as L
import pytest
import torch
from sp_harness import LMModule, TokenData, lm_loss, make_model, make_optimizer, rel_err, run_fit

from lightning_autosp.checkpoint import ShardedCheckpoint

LR = 1e-2
STEPS, SAVE_AT = 8, 4  # 4 batches per epoch: the checkpoint closes epoch 0


@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "sharded"])
def test_resume_equals_the_uninterrupted_run(tmp_path, fsdp):
    """AdamW (its moments are state a resume must restore), sp=2, 8 steps over two epochs.
    Run A saves at step 4 and goes on; run B resumes from that file with ``ckpt_path``. B's
    losses and final parameters must equal A's (<= 1e-6 relative: the same layout and the same
    compiled graphs, so the same arithmetic). Negative control: resuming the weights alone
    (a fresh AdamW) diverges."""
    ckpt_dir = tmp_path / "ckpt"
    save = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=SAVE_AT, save_top_k=-1)
    data = TokenData(8, 32)

    def module():
        return LMModule("llama", lr=LR, optimizer="adamw", layers=1, log_loss=False)

    full = run_fit(tmp_path, module(), data, 2, 2, steps=STEPS, callbacks=[save], fsdp=fsdp)
    ckpt = ckpt_dir / f"epoch=0-step={SAVE_AT}.ckpt"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [ckpt.name, f"epoch=1-step={STEPS}.ckpt"]
    if fsdp:  # a directory, one file per rank
        assert sorted(p.name for p in ckpt.iterdir()) == ["meta.pt", "shard-00000-of-00002.pt", "shard-00001-of-00002.pt"]
    resumed = run_fit(tmp_path, module(), data, 2, 2, steps=STEPS, ckpt_path=str(ckpt), fsdp=fsdp)

    loss_err = max(abs(g / w - 1) for a, b in zip(full.ranks, resumed.ranks) for g, w in zip(b["losses"], a["losses"][SAVE_AT:]))
    param_err = max(rel_err(b["final"][k], w) for a, b in zip(full.ranks, resumed.ranks) for k, w in a["final"].items())
    print(f"resume at step {SAVE_AT}: losses {loss_err:.1e}, final parameters {param_err:.1e}")
    for a, b in zip(full.ranks, resumed.ranks):
        assert len(b["losses"]) == STEPS - SAVE_AT  # continued at step 5, nothing repeated
        for got, want in zip(b["losses"], a["losses"][SAVE_AT:]):
            assert abs(got - want) <= 1e-6 * abs(want)
        for b_batch, a_batch in zip(b["batches"], a["batches"][SAVE_AT:]):  # the same data order
            assert torch.equal(b_batch["input_ids"], a_batch["input_ids"])
        for key, want in a["final"].items():
            assert rel_err(b["final"][key], want) <= 1e-6, key

    # negative control, on one device: the checkpoint's weights with a fresh AdamW
    state = ShardedCheckpoint(ckpt).to_full() if fsdp else torch.load(ckpt, weights_only=False)
    model = make_model("llama", 1)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state["state_dict"].items()})
    opt = make_optimizer("adamw", model.parameters(), LR)
    fresh = []
    for batch in resumed.ranks[0]["batches"]:
        loss = lm_loss(model(batch["input_ids"]), batch["labels"], False)
        loss.backward()
        opt.step()
        opt.zero_grad()
        fresh.append(loss.item())
    assert abs(fresh[0] / full.ranks[0]["losses"][SAVE_AT] - 1) < 1e-5  # the weights were restored
    fresh_err = max(abs(f / w - 1) for f, w in zip(fresh[1:], full.ranks[0]["losses"][SAVE_AT + 1 :]))
    print(f"negative control, weights only (fresh AdamW): losses {fresh_err:.1e}")
    assert fresh_err > 1e-4
