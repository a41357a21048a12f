"""``lightning_autosp.fabric.AutoSPStrategy`` on a LitGPT-style Fabric pretraining loop: LitGPT's
``GPT`` (Llama configuration: GQA, RoPE), the batch sliced before the model, AdamW with weight
decay, gradient accumulation under ``fabric.no_backward_sync``, ``fabric.clip_gradients``, and a
``fabric.save`` after the first step from which fresh objects resume the second. At sp=2 and
dp=2 x sp=2, replicated and sharded, every loss, the synced gradients, the clipped norms and the
parameters after the steps equal one device's; the naive sharding (each rank's part of the
sequence on its own) must not, and neither may a run that skips the resume's optimizer state.
"""

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from sp_harness import START_METHOD, Run, TokenData, compare, free_port, full_tensor, naive_reference_fn, replay
from torch.utils.data import DataLoader

pytest.importorskip("litgpt")
from test_litgpt import pretrain_loss, tiny_gpt  # noqa: E402

from lightning_autosp.fabric import AutoSPStrategy  # noqa: E402

LR, CLIP, ACCUMULATE, STEPS = 1e-2, 0.5, 2, 2


def _build(fabric, fsdp):
    with fabric.init_module(empty_init=bool(fsdp)):  # sharded: on the meta device, initialised in setup
        model = tiny_gpt("llama")
    if fsdp == "hybrid":  # the optimizer built over the meta parameters, set up with the model
        return fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    return model, optimizer


def _train(fabric, model, optimizer, loss_fn, batches, rec):
    for i, batch in enumerate(batches):
        last = (i + 1) % ACCUMULATE == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = loss_fn(model, batch)
            fabric.backward(loss / ACCUMULATE)
        rec["batches"].append({k: v.clone() for k, v in batch.items()})
        rec["losses"].append(float(loss))
        if last:
            rec["grads"].append({n: full_tensor(p.grad).detach().clone() for n, p in model.module.named_parameters()})
            rec["norms"].append(float(fabric.clip_gradients(model, optimizer, max_norm=CLIP)))
            optimizer.step()
            optimizer.zero_grad()


def fabric_loop(fabric, out_dir, fsdp):
    """What each rank runs (``fabric.launch``): two optimizer steps, a save after the first, and
    the second step again from the checkpoint in fresh objects."""
    torch.set_num_threads(1)
    loader = fabric.setup_dataloaders(DataLoader(TokenData(16, 18), batch_size=1, shuffle=False))
    batches = [b for _, b in zip(range(ACCUMULATE * STEPS), loader)]
    model, optimizer = _build(fabric, fsdp)
    loss_fn = fabric.strategy.compile_step(pretrain_loss)
    rec = {"batches": [], "losses": [], "grads": [], "norms": []}
    _train(fabric, model, optimizer, loss_fn, batches[:ACCUMULATE], rec)
    ckpt = os.path.join(out_dir, "step1.ckpt")
    fabric.save(ckpt, {"model": model, "optimizer": optimizer, "step": 1})
    _train(fabric, model, optimizer, loss_fn, batches[ACCUMULATE:], rec)
    rec["final"] = {k: full_tensor(v).detach().clone() for k, v in model.module.state_dict().items()}
    rec["graphs"] = {k: list(c.pass_stats) for k, c in fabric.strategy.compiled_steps.items()}
    # resume: fresh model and optimizer, the checkpoint, the second step again
    model, optimizer = _build(fabric, fsdp)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(ckpt, state)
    resumed = {"batches": [], "losses": [], "grads": [], "norms": [], "step": state["step"]}
    _train(fabric, model, optimizer, fabric.strategy.compile_step(pretrain_loss), batches[ACCUMULATE:], resumed)
    resumed["final"] = {k: full_tensor(v).detach().clone() for k, v in model.module.state_dict().items()}
    rec["resumed"] = resumed
    torch.save(rec, os.path.join(out_dir, f"rank{fabric.global_rank}.pt"))


def run_fabric(tmp_path: Path, devices: int, fsdp) -> Run:
    os.environ["MASTER_PORT"] = str(free_port())
    strategy = AutoSPStrategy(sp_size=2, compile_backend="aot_eager", fsdp=fsdp, start_method=START_METHOD)
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch(fabric_loop, str(tmp_path), fsdp)
    return Run([torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(devices)])


def rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in b)


@pytest.mark.slow
@pytest.mark.parametrize(
    "devices,fsdp", [(2, False), pytest.param(2, True, marks=pytest.mark.full), pytest.param(4, "hybrid", marks=pytest.mark.full)],
    ids=["sp2", "sp2-sharded", "dp2xsp2-hybrid"],
)
def test_fabric_pretraining_loop_matches_one_device(tmp_path, devices, fsdp):
    run = run_fabric(tmp_path, devices, fsdp)
    final, norms = {}, []
    factory = lambda: tiny_gpt("llama")  # noqa: E731
    opt = dict(optimizer="adamw", accumulate=ACCUMULATE, clip=CLIP)
    ref_losses, ref_grads = replay(factory, pretrain_loss, run, 2, LR, final=final, norms=norms, **opt)
    loss_err, grad_err = compare(run, 2, ref_losses, ref_grads)
    assert loss_err <= 1e-4 and grad_err <= 1e-4, (loss_err, grad_err)
    for rec in run.ranks:
        assert rec["norms"] == pytest.approx(norms, rel=1e-4)
        assert rel(rec["final"], final) <= 1e-4
        # the second step again, from the checkpoint in fresh objects: the same losses and parameters
        resumed = rec["resumed"]
        assert resumed["step"] == 1 and resumed["losses"] == pytest.approx(rec["losses"][ACCUMULATE:], rel=1e-5)
        assert rel(resumed["final"], final) <= 1e-4
    graphs = run.ranks[0]["graphs"]["pretrain_loss"]
    assert sum(g.attention for g in graphs) == 2
    # negative controls: sharding without the pass; the second step without the optimizer state
    naive = compare(run, 2, *naive_reference_fn(factory, pretrain_loss, run, 2, LR, **opt))
    assert max(naive) > 1e-2, naive
    first, fresh = {}, {}
    replay(factory, pretrain_loss, _steps(run, 0), 2, LR, final=first, **opt)
    replay(factory, pretrain_loss, _steps(run, 1), 2, LR, final=fresh, initial=first, **opt)  # a fresh AdamW
    update = {k: final[k] - first[k] for k in final if final[k].is_floating_point()}
    assert rel({k: fresh[k] - first[k] for k in update}, update) > 0.05


def _steps(run: Run, step: int) -> Run:
    """The batches of one optimizer step of ``run``."""
    return Run([{"batches": r["batches"][step * ACCUMULATE : (step + 1) * ACCUMULATE]} for r in run.ranks])


def test_compile_step_refuses_a_model():
    """Compiling the model alone would all-gather its sharded logits: the error says what to pass."""
    strategy = AutoSPStrategy(sp_size=1)
    with pytest.raises(RuntimeError, match=r"fabric.launch\(\)"):
        strategy.compile_step(pretrain_loss)
    strategy._runner = object()  # as after the launch
    with pytest.raises(Exception, match=r"compile_step\(GPT\): pass the function that computes the loss"):
        strategy.compile_step(tiny_gpt("llama"))
    with pytest.raises(ValueError, match=r"fsdp=True.*\['find_unused_parameters'\]"):
        AutoSPStrategy(fsdp=True, find_unused_parameters=True)


def test_a_model_compiled_by_the_user_is_refused():
    """``fabric.setup(torch.compile(model))``: Fabric compiles the model again after setup, and that
    compiled region would run unsplit outside AutoSP's graph (the step then found no attention).
    Now the step says so first; the same model uncompiled passes the check (the control)."""
    from lightning_autosp.fabric import _refuse_compiled_modules

    model = torch.nn.Linear(4, 4)
    _refuse_compiled_modules("loss_fn", (model, {"input_ids": torch.zeros(1, 4)}))
    with pytest.raises(Exception, match=r"compiled with torch.compile.*Give fabric.setup the model uncompiled"):
        _refuse_compiled_modules("loss_fn", (torch.compile(model), {}))


class _Holder(torch.nn.Module):
    """A LightningModule's layout: the model as ``self.model`` (checkpoint keys ``model.*``)."""

    def __init__(self):
        super().__init__()
        self.model = tiny_gpt("llama")


def _stepped(module):
    """Moved away from the fresh initialisation, with AdamW state after one step."""
    model = module.model if isinstance(module, _Holder) else module
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    model(torch.randint(0, 64, (1, 8))).sum().backward()
    optimizer.step()
    return optimizer


def _cross_load(rank, world, out_dir):
    """A run moves between the front doors: a DCP checkpoint of the model itself (Fabric) loads
    into a module holding it as ``self.model`` (the Trainer's LightningModule), and back."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from autosp.checkpoint import load_distributed, save_distributed

    results = {}
    for name, writer, reader in (("fabric->trainer", tiny_gpt("llama"), _Holder()), ("trainer->fabric", _Holder(), tiny_gpt("llama"))):
        optimizer = _stepped(writer)
        path = os.path.join(out_dir, name)
        save_distributed({"state_dict": writer.state_dict(), "optimizer_states": [get_optimizer_state_dict(writer, optimizer)], "step": 3},
                         path, rank=rank, barrier=lambda _: torch.distributed.barrier())
        assert set(writer.state_dict()) != set(reader.state_dict())  # the keys differ by the "model." root
        before = max(float((a - b).abs().max()) for a, b in zip(reader.parameters(), writer.parameters()))
        target = torch.optim.AdamW(reader.parameters(), lr=LR)
        meta = load_distributed(path, reader, [target])
        got = [p.detach().clone() for p in reader.parameters()]
        want = [p.detach().clone() for p in writer.parameters()]
        moments = [target.state[p]["exp_avg"].clone() for p in reader.parameters()]
        expected = [optimizer.state[p]["exp_avg"].clone() for p in writer.parameters()]
        results[name] = (before, meta["step"], max(float((a - b).abs().max()) for a, b in zip(got, want)),
                         max(float((a - b).abs().max()) for a, b in zip(moments, expected)))
    return results


def test_checkpoints_move_between_fabric_and_the_trainer(tmp_path):
    from sp_harness import spawn

    (results,) = spawn(tmp_path, _cross_load, 1, str(tmp_path))
    for name, (before, step, params, moments) in results.items():
        assert before > 1e-3, name  # control: the reader starts elsewhere
        assert step == 3 and params == 0 and moments == 0, (name, params, moments)
