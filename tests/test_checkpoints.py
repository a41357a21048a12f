"""Checkpoints under AutoSP: a run interrupted and resumed from a ``ModelCheckpoint`` equals the
uninterrupted run, replicated (one file) and sharded (one file per rank); a sharded checkpoint
resumes on other layouts with the same parameters and optimizer state."""

import lightning as L
import pytest
import torch
from sp_harness import LMModule, TokenData, lm_loss, make_model, make_optimizer, rel_err, run_fit

from lightning_autosp.checkpoint import ShardedCheckpoint

LR = 1e-2
STEPS, SAVE_AT = 8, 3  # 4 batches per epoch: the checkpoint interrupts epoch 0


@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "sharded"])
def test_resume_equals_the_uninterrupted_run(tmp_path, fsdp):
    """AdamW (its moments are state a resume must restore), sp=2, 8 steps over two epochs.
    Run A saves at step 3 (mid-epoch) and goes on; run B resumes from it with ``ckpt_path``. B's
    losses and final parameters must equal A's (<= 1e-6 relative: the same layout and the same
    compiled graphs, so the same arithmetic). Negative control: resuming the weights alone
    (a fresh AdamW) diverges."""
    ckpt_dir = tmp_path / "ckpt"
    save = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=SAVE_AT, save_top_k=-1, save_last="link")
    data = TokenData(8, 32)

    def module():
        return LMModule("llama", lr=LR, optimizer="adamw", layers=1, log_loss=False)

    full = run_fit(tmp_path, module(), data, 2, 2, steps=STEPS, callbacks=[save], fsdp=fsdp)
    ckpt = ckpt_dir / f"epoch=0-step={SAVE_AT}.ckpt"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [ckpt.name, f"epoch=1-step={2 * SAVE_AT}.ckpt", "last.ckpt"]
    assert (ckpt_dir / "last.ckpt").resolve() == (ckpt_dir / f"epoch=1-step={2 * SAVE_AT}.ckpt").resolve()
    if fsdp:  # a directory, one file per rank
        assert sorted(p.name for p in ckpt.iterdir()) == ["meta.pt", "shard-00000-of-00002.pt", "shard-00001-of-00002.pt"]
    resumed = run_fit(tmp_path, module(), data, 2, 2, steps=STEPS, ckpt_path=str(ckpt), fsdp=fsdp)

    loss_err = max(abs(g / w - 1) for a, b in zip(full.ranks, resumed.ranks) for g, w in zip(b["losses"], a["losses"][SAVE_AT:]))
    param_err = max(rel_err(b["final"][k], w) for a, b in zip(full.ranks, resumed.ranks) for k, w in a["final"].items())
    print(f"resume at step {SAVE_AT}: losses {loss_err:.1e}, final parameters {param_err:.1e}")
    for a, b in zip(full.ranks, resumed.ranks):
        assert len(b["losses"]) == STEPS - SAVE_AT  # continued at step 4, nothing repeated
        assert len(b["batches"]) == len(a["batches"][SAVE_AT:])
        for got, want in zip(b["losses"], a["losses"][SAVE_AT:]):
            assert abs(got - want) <= 1e-6 * abs(want)
        for b_batch, a_batch in zip(b["batches"], a["batches"][SAVE_AT:]):  # the same data order, mid-epoch too
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


def _state_now(trainer, module) -> dict:
    """The whole model and the whole AdamW state, by parameter name, gathered from the shards
    (a collective) or read from the replica."""
    import math

    import torch.distributed as dist

    from lightning_autosp.checkpoint import named_optimizer_state, sharded_param_names, sharded_shapes
    from lightning_autosp.fsdp import full_state_dict, is_sharded

    optimizer = trainer.optimizers[0]
    if not is_sharded(module):
        names = {id(p): n for n, p in module.named_parameters()}
        return {"params": {k: v.clone() for k, v in module.state_dict().items()}, "state": named_optimizer_state(optimizer, names)["state"]}
    shapes = sharded_shapes(module)
    mine = named_optimizer_state(optimizer, sharded_param_names(module))["state"]
    every = [None] * trainer.world_size
    dist.all_gather_object(every, mine)
    state = {
        name: {
            k: torch.cat([e[name][k] for e in every])[: math.prod(shapes[name])].view(shapes[name]) if v.dim() else v
            for k, v in entry.items()
        }
        for name, entry in mine.items()
    }
    return {"params": full_state_dict(module), "state": state, "shards": {k: v.clone() for k, v in module.state_dict().items()}}


class _StateAt(L.Callback):
    """Saves :func:`_state_now` after step ``step``, or (``step=None``) when training starts,
    after a restore."""

    def __init__(self, out, step=None):
        self.out, self.step = out, step

    def _save(self, trainer, pl_module):
        torch.save(_state_now(trainer, pl_module), f"{self.out}/rank{trainer.global_rank}.pt")

    def on_train_start(self, trainer, pl_module):
        if self.step is None:
            self._save(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self._save(trainer, pl_module)


class _AtTeardown(L.Callback):
    def __init__(self, out):
        self.out = out

    def teardown(self, trainer, pl_module, stage):
        from lightning_autosp.fsdp import is_sharded

        state = {k: v.clone() for k, v in pl_module.state_dict().items()}
        torch.save({"sharded": is_sharded(pl_module), "params": state}, f"{self.out}/rank{trainer.global_rank}.pt")


class _ProbeAfterResume(LMModule):
    """Records the restored state at the first batch after the resume, then stops: no step runs
    (and nothing compiles)."""

    def __init__(self, out, **kwargs):
        super().__init__(**kwargs)
        self.out = str(out)

    def on_train_batch_start(self, batch, batch_idx):
        torch.save(_state_now(self.trainer, self), f"{self.out}/rank{self.global_rank}.pt")
        self.trainer.should_stop = True
        return -1  # skip the rest of the epoch


def test_sharded_checkpoint_resumes_on_other_layouts(tmp_path):
    """Saved at step 2 by dp=2 x sp=2 with fsdp=True (4 shard files), resumed at sp=4, at dp=1 x
    sp=2 (2 ranks: each reads parts of two files) and replicated (fsdp=False): right after the
    restore every parameter and every AdamW state tensor (both moments, the step) equals the
    saving run's, exactly - resharding only moves elements. The dp=1 x sp=2 run then trains on
    (batch 4 = the two DP groups' batches of 2, every sample with all its targets, so the global
    mean is the mean of the groups' means): its losses and final parameters match the saving
    run's steps 3-4 to 1e-5 - the layouts reduce in different orders (~1e-7 per step), which two
    AdamW steps leave far below that on this data (measured below). Negative controls: the
    initial model differs, and a layout-blind load (new rank r reads old file r) would not match."""
    save = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    data = TokenData(8, 32, ignore="none")
    kwargs = dict(kind="llama", lr=LR, optimizer="adamw", layers=1, log_loss=False)
    (tmp_path / "saved").mkdir()
    full = run_fit(tmp_path, LMModule(**kwargs), data, 4, 2, steps=4, callbacks=[save, _StateAt(tmp_path / "saved", step=2)], fsdp=True)
    ckpt = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.pt"] + [f"shard-0000{r}-of-00004.pt" for r in range(4)]
    saved = torch.load(tmp_path / "saved" / "rank0.pt", weights_only=False)
    assert {k for e in saved["state"].values() for k in e} == {"step", "exp_avg", "exp_avg_sq"}

    def check_identical(name, out, devices):
        for r in range(devices):
            got = torch.load(out / f"rank{r}.pt", weights_only=False)
            assert got["params"].keys() == saved["params"].keys()
            for k, want in saved["params"].items():
                assert torch.equal(got["params"][k], want), (name, r, k)
            assert got["state"].keys() == saved["state"].keys()
            for p, entry in saved["state"].items():
                for k, want in entry.items():
                    assert torch.equal(got["state"][p][k], want), (name, r, p, k)
        print(f"resumed {name}: {len(saved['params'])} parameters and {sum(map(len, saved['state'].values()))} AdamW tensors identical")

    for name, devices, sp, fsdp in [("sp4", 4, 4, True), ("replicated", 2, 2, False)]:
        out = tmp_path / name
        out.mkdir()
        run_fit(tmp_path, _ProbeAfterResume(out, **kwargs), data, devices, sp, steps=4, ckpt_path=str(ckpt), fsdp=fsdp)
        check_identical(name, out, devices)
    (tmp_path / "dp1xsp2").mkdir()
    cont = run_fit(tmp_path, LMModule(**kwargs), data, 2, 2, steps=4, batch_size=4, ckpt_path=str(ckpt), fsdp=True, callbacks=[_StateAt(tmp_path / "dp1xsp2")])
    check_identical("dp1xsp2", tmp_path / "dp1xsp2", 2)
    want = [(a + b) / 2 for a, b in zip(full.ranks[0]["losses"][2:], full.ranks[2]["losses"][2:])]  # the two DP groups
    loss_err = max(abs(g / w - 1) for g, w in zip(cont.ranks[0]["losses"], want))
    param_err = max(rel_err(cont.ranks[0]["final"][k], v) for k, v in full.ranks[0]["final"].items())
    print(f"dp=2 x sp=2 -> dp=1 x sp=2, steps 3-4: losses {loss_err:.1e}, final parameters {param_err:.1e}")
    assert len(cont.ranks[0]["losses"]) == 2 and loss_err <= 1e-5 and param_err <= 1e-5

    # resumed at max_steps: fit runs no epoch (no on_train_end), and still hands back full parameters
    import os

    from sp_harness import free_port
    from torch.utils.data import DataLoader

    from lightning_autosp import AutoSPStrategy

    os.environ["MASTER_PORT"] = str(free_port())
    (tmp_path / "done").mkdir()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[_AtTeardown(tmp_path / "done")],
        strategy=AutoSPStrategy(sp_size=2, compile_backend="aot_eager", start_method="fork", fsdp=True),
    )
    trainer.fit(LMModule(**kwargs), DataLoader(data, batch_size=2), ckpt_path=str(ckpt))
    for r in range(2):
        got = torch.load(tmp_path / "done" / f"rank{r}.pt", weights_only=False)
        assert not got["sharded"] and all(torch.equal(got["params"][k], v) for k, v in saved["params"].items())

    # negative controls: the restore is what made them equal, and the layout matters
    fresh = make_model("llama", 1).state_dict()
    assert all(not torch.equal(fresh[k.removeprefix("model.")], v) for k, v in saved["params"].items() if "norm" not in k)
    old = [torch.load(ckpt / f"shard-0000{r}-of-00004.pt", weights_only=True)["params"] for r in range(4)]
    key = "model.layers.0.attention.wq.weight"
    half = saved["params"][key].numel() // 2
    blind = old[1][key]  # rank 1 of 2 reading the file of its own rank number: the second quarter
    assert not torch.equal(blind, saved["params"][key].reshape(-1)[half : half + blind.numel()])
    assert torch.equal(torch.cat([old[2][key], old[3][key]]), saved["params"][key].reshape(-1)[half:])


def _save_sharded_gpt(rank, world, path):
    """GPT (tied head) sharded over ``world`` ranks with AdamW state, saved; then loaded back into
    a fresh sharded GPT, and into a Llama (refused; its values stay)."""
    import torch.distributed as dist

    from lightning_autosp import AutoSPError
    from lightning_autosp.checkpoint import (
        ShardedCheckpoint,
        load_sharded_module,
        load_sharded_optimizer,
        named_optimizer_state,
        save_sharded,
        sharded_param_names,
        sharded_shapes,
        sharded_state_dict,
    )
    from lightning_autosp.fsdp import _sharded_entries, full_state_dict, shard_parameters

    def sharded(kind, seed):
        model = make_model(kind, 1)
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
        shard_parameters(model, dist.group.WORLD)
        return model

    model = sharded("gpt", 0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _, mod, name in _sharded_entries(model):  # gradients as the reduce-scatter leaves them: zero padding
        plist = mod.parametrizations[name]
        if not plist[0].already_sharded:  # (the tied head's owner: the same shard)
            plist.original.grad = plist[0].right_inverse(torch.randn(plist[0].shape))
    opt.step()
    checkpoint = {"epoch": 3, "state_dict": sharded_state_dict(model), "optimizer_states": [named_optimizer_state(opt, sharded_param_names(model))]}
    save_sharded(checkpoint, path, rank=rank, world=world, shapes=sharded_shapes(model), barrier=lambda name: dist.barrier())
    save_sharded(checkpoint, path, rank=rank, world=world, shapes=sharded_shapes(model), barrier=lambda name: dist.barrier())  # over itself

    source = ShardedCheckpoint(path)
    again = sharded("gpt", 1)
    opt2 = torch.optim.AdamW(again.parameters(), lr=0.1)
    load_sharded_module(again, source, rank, world)
    load_sharded_optimizer(opt2, 0, source, again, rank)
    same_shards = all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    same_state = all(
        torch.equal(opt.state[a][k], opt2.state[b][k]) for a, b in zip(model.parameters(), again.parameters()) for k in opt.state[a]
    )
    llama = sharded("llama", 2)
    before = [p.clone() for p in llama.parameters()]
    try:
        load_sharded_module(llama, source, rank, world)
        refused = None
    except AutoSPError as exc:
        refused = str(exc)
    untouched = all(torch.equal(a, b) for a, b in zip(before, llama.parameters()))
    return {"full": full_state_dict(model), "same_shards": same_shards, "same_state": same_state, "refused": refused, "untouched": untouched,
            "tied": again.head.parametrizations.weight.original is again.wte.parametrizations.weight.original}


def test_sharded_checkpoint_files_and_bad_input(tmp_path):
    """3 ranks (every GPT parameter padded), AdamW state: the directory holds one shard file per
    rank plus the index; a fresh sharded model reads back the same shards, ties and optimizer
    state; any element range reads as the flat padded tensor (what another layout loads); the
    full view equals the gathered model. Bad input names the file and changes nothing: a model
    that does not fit, a missing shard, a truncated shard, a save that never finished."""
    from sp_harness import spawn

    from lightning_autosp import AutoSPError

    path = tmp_path / "last.ckpt"
    results = spawn(tmp_path, _save_sharded_gpt, 3, str(path))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("last")) == ["last.ckpt"]  # no .partial left
    assert sorted(p.name for p in path.iterdir()) == ["meta.pt"] + [f"shard-0000{r}-of-00003.pt" for r in range(3)]
    for r in results:
        assert r["same_shards"] and r["same_state"] and r["tied"]
        assert r["refused"] is not None and str(path) in r["refused"] and "does not fit this model" in r["refused"]
        assert r["untouched"]
    source = ShardedCheckpoint(path)
    full = results[0]["full"]
    for key, want in full.items():
        assert torch.equal(source.full(key), want), key
        flat = torch.cat([want.reshape(-1), want.new_zeros(4)])
        chunk = -(-want.numel() // 2)  # what rank 1 of a 2-rank layout reads
        assert torch.equal(source.read(key, chunk, 2 * chunk), flat[chunk : 2 * chunk]), key
    assert any(v.numel() % 3 for v in full.values())  # padding was exercised
    whole = source.to_full()
    assert whole["epoch"] == 3 and set(whole["optimizer_states"][0]["state"]["wte.weight"]) == {"step", "exp_avg", "exp_avg_sq"}

    shard1 = path / "shard-00001-of-00003.pt"
    data = shard1.read_bytes()
    shard1.write_bytes(data[: len(data) // 2])
    with pytest.raises(AutoSPError, match=r"cannot read .*shard-00001-of-00003\.pt.*damaged or truncated"):
        ShardedCheckpoint(path).full("wte.weight")
    shard1.unlink()
    with pytest.raises(AutoSPError, match=r"incomplete: shard-00001-of-00003\.pt missing"):
        ShardedCheckpoint(path)
    (path / "meta.pt").rename(tmp_path / "meta.pt")
    with pytest.raises(AutoSPError, match=r"not a complete AutoSP checkpoint.*meta\.pt is missing"):
        ShardedCheckpoint(path)


def _save_sharded_hf(rank, world, path):
    """A small HF Llama held as ``self.model`` (as a LightningModule holds it), compiled
    (``_orig_mod.``) and sharded, saved as a sharded checkpoint; returns its full weights."""
    import torch.distributed as dist
    from test_any_model import hf_model

    from lightning_autosp.checkpoint import save_sharded, sharded_shapes, sharded_state_dict
    from lightning_autosp.fsdp import full_state_dict, shard_parameters

    holder = torch.nn.Module()
    holder.model = hf_model("llama", 1)()
    with torch.no_grad():  # trained weights, not the init: every tensor different
        for p in holder.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    shard_parameters(holder, dist.group.WORLD)
    state = {k.replace("model.", "model._orig_mod.", 1): v for k, v in sharded_state_dict(holder).items()}
    shapes = {k.replace("model.", "model._orig_mod.", 1): v for k, v in sharded_shapes(holder).items()}
    save_sharded({"state_dict": state}, path, rank=rank, world=world, shapes=shapes, barrier=lambda name: dist.barrier())
    return {k.removeprefix("model."): v for k, v in full_state_dict(holder).items()}


def test_export_to_one_file_and_to_hugging_face(tmp_path):
    """``python -m lightning_autosp.export``: a sharded checkpoint of a Hugging Face Llama (keys
    ``model._orig_mod.*`` as a compiled module inside a LightningModule saves them) becomes (a)
    one file with the model's own keys that ``load_state_dict`` takes strictly on one device and
    (b) ``save_pretrained`` files that ``from_pretrained`` loads: logits equal the trained
    model's. A replicated single-file checkpoint exports the same way. Negative control: the
    freshly initialised model's logits differ."""
    import subprocess
    import sys

    from sp_harness import spawn
    from test_any_model import hf_model

    from lightning_autosp.export import export_state_dict, main

    transformers = pytest.importorskip("transformers")
    ckpt = tmp_path / "hf.ckpt"
    trained = spawn(tmp_path, _save_sharded_hf, 2, str(ckpt))[0]
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = hf_model("llama", 1)()
    reference.load_state_dict(trained)
    want = reference(input_ids=ids).logits

    main([str(ckpt), str(tmp_path / "model.pt")])
    one_file = torch.load(tmp_path / "model.pt", weights_only=True)
    assert sorted(one_file) == sorted(trained)  # own names: no model., _orig_mod., parametrizations
    model = hf_model("llama", 1)()
    assert (model(input_ids=ids).logits - want).abs().max() > 1e-2  # negative control: init weights
    model.load_state_dict(one_file)  # strict
    assert torch.equal(model(input_ids=ids).logits, want)

    reference.config.save_pretrained(tmp_path / "config")
    cmd = [sys.executable, "-m", "lightning_autosp.export", str(ckpt), str(tmp_path / "hf"), "--hf-config", str(tmp_path / "config")]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa")
    assert (loaded(input_ids=ids).logits - want).abs().max().item() <= 1e-6

    single = tmp_path / "replicated.ckpt"  # what fsdp=False writes (the module as LightningModule.state_dict names it)
    torch.save({"state_dict": {f"model.{k}": v for k, v in trained.items()}, "epoch": 0}, single)
    assert all(torch.equal(v, trained[k]) for k, v in export_state_dict(single).items())
    assert sorted(export_state_dict(single, module="")) == sorted(f"model.{k}" for k in trained)


def test_resumable_order_continues_the_epoch(recwarn):
    """The training loader's index order after a mid-epoch resume (shuffled, 11 samples, so
    DistributedSampler pads): on the same DP size each rank continues exactly as the
    uninterrupted run, and over the epoch every sample is seen once (the padding duplicates
    aside); on another DP size the epoch starts over, with a warning saying so. Negative
    control: a resume without the saved state would repeat the epoch's first batches."""
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_autosp.sampler import make_resumable

    data, batch, seen = list(range(11)), 2, 2

    def loaders(dp):
        out = []
        for rank in range(dp):
            loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, num_replicas=dp, rank=rank, shuffle=True, seed=5))
            assert make_resumable(loader, lambda: (1, seen))
            loader.batch_sampler.sampler.set_epoch(1)
            out.append(loader)
        return out

    full = [[b.tolist() for b in loader] for loader in loaders(2)]
    state = loaders(2)[0].state_dict()
    assert state == {"epoch": 1, "position": seen * batch * 2, "batches": seen, "dp_size": 2}
    resumed = loaders(2)
    for loader in resumed:
        loader.load_state_dict(state)
    rest = [[b.tolist() for b in loader] for loader in resumed]
    assert rest == [f[seen:] for f in full]  # each rank: what the uninterrupted run had left
    before = [i for f in full for b in f[:seen] for i in b]
    after = [i for r in rest for b in r for i in b]
    assert sorted(set(before + after)) == data and len(before + after) == 12  # 11 + one padding duplicate
    assert [[b.tolist() for b in loader] for loader in loaders(2)][0][:seen] == full[0][:seen]  # negative control

    other = loaders(3)
    other[0].load_state_dict(state)
    assert [b.tolist() for b in other[0]] == [b.tolist() for b in loaders(3)[0]]  # starts over...
    assert any("starts its sample order over" in str(w.message) for w in recwarn)  # ...and says so
