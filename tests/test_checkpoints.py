"""Checkpoints under AutoSP: a run interrupted and resumed from a ``ModelCheckpoint`` equals the
uninterrupted run, replicated (one file) and sharded (one file per rank); a sharded checkpoint
resumes on other layouts with the same parameters and optimizer state; checkpoints go both ways
between AutoSP and Lightning's own strategies (``DDPStrategy``, ``ModelParallelStrategy``)."""

import multiprocessing

import lightning as L
import pytest
import torch
from sp_harness import LMModule, TokenData, lm_loss, make_model, make_optimizer, rel_err, run_fit

from autosp.checkpoint import read_model_state_dict

LR = 1e-2
STEPS, SAVE_AT = 8, 3  # 4 batches per epoch: the checkpoint interrupts epoch 0


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "sharded"])
@pytest.mark.full
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
    if fsdp:  # a torch distributed checkpoint directory: one file per rank, its index, Lightning's meta.pt
        assert sorted(p.name for p in ckpt.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
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
    state = read_model_state_dict(ckpt) if fsdp else torch.load(ckpt, weights_only=False)["state_dict"]
    fresh = _weights_only_losses(state, resumed.ranks[0]["batches"])
    assert abs(fresh[0] / full.ranks[0]["losses"][SAVE_AT] - 1) < 1e-5  # the weights were restored
    fresh_err = max(abs(f / w - 1) for f, w in zip(fresh[1:], full.ranks[0]["losses"][SAVE_AT + 1 :]))
    print(f"negative control, weights only (fresh AdamW): losses {fresh_err:.1e}")
    assert fresh_err > 1e-4


def _weights_only_losses(state: dict, batches: list) -> list[float]:
    """One device from a checkpoint's weights with a fresh AdamW (a resume that lost the
    optimizer's state), over ``batches``: the negative control of a resume."""
    model = make_model("llama", 1)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    opt = make_optimizer("adamw", model.parameters(), LR)
    out = []
    for batch in batches:
        loss = lm_loss(model(batch["input_ids"]), batch["labels"], False)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


EPOCH = 4  # batches per epoch: TokenData(8) in batches of 2


def _interchange(tmp_path, fit_autosp, fit_other, other: str, weights_of) -> None:
    """AutoSP trains 2 epochs and saves at the end of the first; ``fit_other`` (another strategy)
    resumes from that checkpoint. It trains 2 epochs and saves the same way; AutoSP resumes from
    that. Each resumed run must equal the uninterrupted one (losses, batches, final parameters:
    <= 1e-4, SP against one device). Each checkpoint comes from a run that was not itself resumed:
    Lightning 2.6 counts the epochs of a run resumed at an epoch's end one short in the
    checkpoints it writes, whatever the strategy. Negative control: AutoSP's checkpoint's weights
    (``weights_of(path)``) with a fresh AdamW diverge."""

    def save(run):
        return L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / run, every_n_train_steps=EPOCH, save_top_k=-1)

    def first(run):
        return tmp_path / run / f"epoch=0-step={EPOCH}.ckpt"

    autosp = fit_autosp(callbacks=[save("autosp")])
    theirs = fit_other(callbacks=[save("other")])
    to_other = fit_other(ckpt_path=str(first("autosp")))
    to_autosp = fit_autosp(ckpt_path=str(first("other")))
    errs = {}
    for name, resumed, full in ((f"AutoSP -> {other}", to_other, autosp), (f"{other} -> AutoSP", to_autosp, theirs)):
        got, want = resumed.ranks[0], full.ranks[0]
        assert len(got["losses"]) == EPOCH
        for b_batch, a_batch in zip(got["batches"], want["batches"][EPOCH:]):
            assert torch.equal(b_batch["input_ids"], a_batch["input_ids"])
        losses = max(abs(g / w - 1) for g, w in zip(got["losses"], want["losses"][EPOCH:]))
        params = max(rel_err(got["final"][k], w) for k, w in want["final"].items())
        errs[name] = (losses, params)
    fresh = _weights_only_losses(weights_of(first("autosp")), to_other.ranks[0]["batches"])
    fresh_err = max(abs(f / w - 1) for f, w in zip(fresh[1:], autosp.ranks[0]["losses"][EPOCH + 1 :]))
    print(", ".join(f"{k}: losses {v[0]:.1e}, final parameters {v[1]:.1e}" for k, v in errs.items()), f"(weights only: {fresh_err:.1e})")
    assert all(max(v) <= 1e-4 for v in errs.values()), errs
    assert fresh_err > 1e-3


@pytest.mark.slow
def test_replicated_checkpoint_resumes_under_ddp_and_back(tmp_path):
    """Checkpoints leave with the user: AutoSP (sp=2, replicated) and plain ``DDPStrategy`` (one
    device) resume from each other's checkpoints exactly (:func:`_interchange`). AutoSP keeps its
    sampler's position apart from Lightning's loader states, which a strategy without that
    sampler would refuse."""

    def fit(devices, sp_size):
        module = lambda: LMModule("llama", lr=LR, optimizer="adamw", layers=1, log_loss=False)  # noqa: E731
        return lambda **kw: run_fit(tmp_path, module(), TokenData(8, 32), devices, sp_size, steps=2 * EPOCH, **kw)

    _interchange(tmp_path, fit(2, 2), fit(1, None), "DDP", lambda path: torch.load(path, weights_only=False)["state_dict"])
    state = torch.load(tmp_path / "autosp" / f"epoch=0-step={EPOCH}.ckpt", weights_only=False)
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [] and "loader_states" in state["autosp"]


class FullyShardedOnItsOwn(LMModule):
    """What a user of Lightning's ``ModelParallelStrategy`` writes: the module shards its model
    itself (FSDP2's ``fully_shard``, per block and whole) when that strategy runs it; under
    AutoSP it does nothing (``fsdp=True`` shards)."""

    def configure_model(self):
        from lightning.pytorch.strategies import ModelParallelStrategy

        super().configure_model()
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)


def _fit_under_model_parallel(tmp_path, **kwargs):
    """``run_fit`` under Lightning's ``ModelParallelStrategy`` on one device (in this process)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.set_num_threads(1)
    module = FullyShardedOnItsOwn("llama", lr=LR, optimizer="adamw", layers=1, log_loss=False)
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    return run_fit(tmp_path, module, TokenData(8, 32), 1, None, steps=2 * EPOCH, strategy=strategy, **kwargs)


@pytest.mark.slow
@pytest.mark.full
def test_sharded_checkpoint_resumes_under_model_parallel_strategy_and_back(tmp_path):
    """AutoSP's sharded checkpoint (a torch distributed checkpoint, ``fsdp=True``, sp=2) and one
    written by Lightning's own ``ModelParallelStrategy`` (FSDP2, one device, in a process of its
    own: a process group in this one would outlive the test) resume under each other exactly
    (:func:`_interchange`)."""

    def autosp(**kw):
        module = FullyShardedOnItsOwn("llama", lr=LR, optimizer="adamw", layers=1, log_loss=False)
        return run_fit(tmp_path, module, TokenData(8, 32), 2, 2, steps=2 * EPOCH, fsdp=True, **kw)

    def model_parallel(**kw):
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(_fit_under_model_parallel, (tmp_path,), kw)

    _interchange(tmp_path, autosp, model_parallel, "ModelParallelStrategy", read_model_state_dict)
    assert (tmp_path / "other" / f"epoch=0-step={EPOCH}.ckpt").is_dir()  # both torch distributed checkpoints


def _state_now(trainer, module) -> dict:
    """The whole model and the whole AdamW state, by parameter name, gathered from the shards
    (a collective) or read from the replica, and this rank's part of each parameter."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from autosp.modes.sharded.values import full_state_dict

    optimizer = trainer.optimizers[0]
    state = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True))["state"]
    local = {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in module.state_dict().items()}
    return {"params": full_state_dict(module), "state": state, "local": local}


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
        from torch.distributed.tensor import DTensor

        from autosp.modes.sharded.params import is_sharded

        state = {k: v.clone() for k, v in pl_module.state_dict().items()}
        dtensors = any(isinstance(v, DTensor) for v in state.values())
        torch.save({"sharded": is_sharded(pl_module) or dtensors, "params": state}, f"{self.out}/rank{trainer.global_rank}.pt")


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


@pytest.mark.slow
@pytest.mark.full
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
    assert sorted(p.name for p in ckpt.iterdir()) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)] + ["meta.pt"]
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

    from sp_harness import START_METHOD, free_port
    from torch.utils.data import DataLoader

    from lightning_autosp import AutoSPStrategy

    os.environ["MASTER_PORT"] = str(free_port())
    (tmp_path / "done").mkdir()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[_AtTeardown(tmp_path / "done")],
        strategy=AutoSPStrategy(sp_size=2, compile_backend="aot_eager", start_method=START_METHOD, fsdp=True),
    )
    trainer.fit(LMModule(**kwargs), DataLoader(data, batch_size=2), ckpt_path=str(ckpt))
    for r in range(2):
        got = torch.load(tmp_path / "done" / f"rank{r}.pt", weights_only=False)
        assert not got["sharded"] and all(torch.equal(got["params"][k], v) for k, v in saved["params"].items())

    # negative controls: the restore is what made them equal, and the layout matters: rank 1 of
    # 2 holds the second half of the rows, rank 1 of the saving 4 the second quarter
    fresh = make_model("llama", 1).state_dict()
    assert all(not torch.equal(fresh[k.removeprefix("model.")], v) for k, v in saved["params"].items() if "norm" not in k)
    key = "model.layers.0.attention.wq.weight"
    rows = saved["params"][key].shape[0]
    two = torch.load(tmp_path / "dp1xsp2" / "rank1.pt", weights_only=False)["local"][key]
    assert torch.equal(two, saved["params"][key][rows // 2 :])
    assert not torch.equal(saved["local"][key], saved["params"][key][rows // 2 : rows // 2 + rows // 4])  # rank 0 of 4: the first quarter
    assert torch.equal(torch.load(tmp_path / "saved" / "rank1.pt", weights_only=False)["local"][key], saved["params"][key][rows // 4 : rows // 2])


def _sharded(kind, seed):
    """A model of ``kind`` with random values (seeded alike on every rank), sharded over the world."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from autosp.modes.sharded.config import ShardingPolicy

    from autosp.modes.sharded.params import shard_module

    model = make_model(kind, 1)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    shard_module(model, ShardingPolicy(DeviceMesh.from_group(dist.group.WORLD, "cpu")))
    return model


def _save_sharded_gpt(rank, world, path):
    """GPT (tied head) sharded over ``world`` ranks with AdamW state, saved as Trainer.save_checkpoint
    builds it (twice: the second over the first); then loaded back into a fresh sharded GPT, and
    into a Llama (refused; its values stay)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from lightning_autosp import AutoSPError
    from autosp.checkpoint import load_distributed, save_distributed
    from autosp.modes.sharded.values import full_state_dict

    model = _sharded("gpt", 0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randint(0, 64, (2, 8))).square().mean().backward()
    opt.step()
    checkpoint = {"epoch": 3, "state_dict": model.state_dict(), "optimizer_states": [get_optimizer_state_dict(model, opt)]}
    for _ in range(2):
        save_distributed(checkpoint, path, rank=rank, barrier=lambda name: dist.barrier())

    again = _sharded("gpt", 1)
    opt2 = torch.optim.AdamW(again.parameters(), lr=0.1)
    meta = load_distributed(path, again, [opt2])
    same_shards = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), again.parameters()))
    same_state = all(
        torch.equal(opt.state[a][k].to_local() if k != "step" else opt.state[a][k], opt2.state[b][k].to_local() if k != "step" else opt2.state[b][k])
        for a, b in zip(model.parameters(), again.parameters()) for k in opt.state[a]
    )
    llama = _sharded("llama", 2)
    before = [p.to_local().clone() for p in llama.parameters()]
    try:
        load_distributed(path, llama, [])
        refused = None
    except AutoSPError as exc:
        refused = str(exc)
    untouched = all(torch.equal(a, b.to_local()) for a, b in zip(before, llama.parameters()))
    return {"full": full_state_dict(model), "same_shards": same_shards, "same_state": same_state, "refused": refused, "untouched": untouched,
            "tied": again.head._parameters["weight"] is again.wte._parameters["weight"], "meta": meta}


def _load_damaged(rank, world, path):
    from lightning_autosp import AutoSPError
    from autosp.checkpoint import load_distributed

    model = _sharded("gpt", 1)
    before = [p.to_local().clone() for p in model.parameters()]
    try:
        load_distributed(path, model, [])
        error = None
    except AutoSPError as exc:
        error = str(exc)
    return {"error": error, "untouched": all(torch.equal(a, b.to_local()) for a, b in zip(before, model.parameters()))}


def test_sharded_checkpoint_files_and_bad_input(tmp_path):
    """3 ranks (GPT's rows do not divide by 3), AdamW state: the directory is a torch distributed
    checkpoint (one file per rank and its index) plus Lightning's meta.pt; a fresh sharded model
    reads back the same shards, ties and optimizer state; DCP's own reader sees the whole model.
    Bad input names the file and changes nothing: a model that does not fit, a truncated shard
    file, a missing one, a save that never finished."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from sp_harness import spawn

    from lightning_autosp import AutoSPError

    path = tmp_path / "last.ckpt"
    results = spawn(tmp_path, _save_sharded_gpt, 3, str(path))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("last")) == ["last.ckpt"]  # no .partial left
    assert sorted(p.name for p in path.iterdir()) == [".metadata"] + [f"__{r}_0.distcp" for r in range(3)] + ["meta.pt"]
    for r in results:
        assert r["same_shards"] and r["same_state"] and r["tied"] and r["meta"] == {"epoch": 3}
        assert r["refused"] is not None and str(path) in r["refused"] and "does not fit this model" in r["refused"]
        assert r["untouched"]
    full = results[0]["full"]
    assert any(v.shape[0] % 3 for v in full.values())  # uneven shards exercised
    dcp_to_torch_save(path, tmp_path / "whole.pt")  # another DCP reader: torch's own conversion
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert sorted(whole["state_dict"]) == sorted(full) and all(torch.equal(whole["state_dict"][k], v) for k, v in full.items())
    assert set(whole["optimizer_0"]["state"]["wte.weight"]) == {"step", "exp_avg", "exp_avg_sq"}

    shard1 = path / "__1_0.distcp"
    data = shard1.read_bytes()
    shard1.write_bytes(data[: len(data) // 10])  # the model's tensors come first in it
    for r in spawn(tmp_path, _load_damaged, 3, str(path)):
        assert r["error"] is not None and "cannot read the model from" in r["error"] and str(path) in r["error"] and r["untouched"], r
    shard1.unlink()
    for r in spawn(tmp_path, _load_damaged, 3, str(path)):
        assert r["error"] is not None and str(path) in r["error"] and r["untouched"], r
    (path / "meta.pt").rename(tmp_path / "meta.pt")
    with pytest.raises(AutoSPError, match=r"not a complete AutoSP checkpoint: meta\.pt missing"):
        read_model_state_dict(path)
    partial = tmp_path / "next.ckpt.partial"
    partial.mkdir()
    with pytest.raises(AutoSPError, match=r"next\.ckpt\.partial is not a complete AutoSP checkpoint \(a save that did not finish\)"):
        read_model_state_dict(partial)


def _save_sharded_hf(rank, world, path):
    """A small HF Llama held as ``self.model`` (as a LightningModule holds it), compiled
    (``_orig_mod.``) and sharded, saved as a distributed checkpoint; returns its full weights."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from test_any_model import hf_model

    from autosp.checkpoint import save_distributed
    from autosp.modes.sharded.config import ShardingPolicy
    from autosp.modes.sharded.values import full_state_dict
    from autosp.modes.sharded.params import shard_module

    holder = torch.nn.Module()
    holder.model = hf_model("llama", 1)()
    with torch.no_grad():  # trained weights, not the init: every tensor different
        for p in holder.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    shard_module(holder, ShardingPolicy(DeviceMesh.from_group(dist.group.WORLD, "cpu")))
    state = {k.replace("model.", "model._orig_mod.", 1): v for k, v in holder.state_dict().items()}
    save_distributed({"state_dict": state}, path, rank=rank, barrier=lambda name: dist.barrier())
    return {k.removeprefix("model."): v for k, v in full_state_dict(holder).items()}


@pytest.mark.slow
@pytest.mark.full
def test_export_to_one_file_and_to_hugging_face(tmp_path):
    """``python -m autosp.export``: a sharded checkpoint of a Hugging Face Llama (keys
    ``model._orig_mod.*`` as a compiled module inside a LightningModule saves them) becomes (a)
    one file with the model's own keys that ``load_state_dict`` takes strictly on one device and
    (b) ``save_pretrained`` files that ``from_pretrained`` loads: logits equal the trained
    model's. A replicated single-file checkpoint exports the same way. Negative control: the
    freshly initialised model's logits differ."""
    import subprocess
    import sys

    from sp_harness import spawn
    from test_any_model import hf_model

    from autosp.export import export_state_dict, main

    transformers = pytest.importorskip("transformers")
    ckpt = tmp_path / "hf.ckpt"
    trained = spawn(tmp_path, _save_sharded_hf, 2, str(ckpt))[0]
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = hf_model("llama", 1)()
    reference.load_state_dict(trained)
    want = reference(input_ids=ids).logits

    main([str(ckpt), str(tmp_path / "model.pt")])
    one_file = torch.load(tmp_path / "model.pt", weights_only=True)
    assert sorted(one_file) == sorted(trained)  # own names: no model., _orig_mod.
    model = hf_model("llama", 1)()
    assert (model(input_ids=ids).logits - want).abs().max() > 1e-2  # negative control: init weights
    model.load_state_dict(one_file)  # strict
    assert torch.equal(model(input_ids=ids).logits, want)

    reference.config.save_pretrained(tmp_path / "config")
    cmd = [sys.executable, "-m", "autosp.export", str(ckpt), str(tmp_path / "hf"), "--hf-config", str(tmp_path / "config")]
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

    from autosp.sampler import make_resumable

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
