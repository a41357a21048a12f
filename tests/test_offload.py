"""Activation offload: saved activations to host memory and back, same loss and gradients.

Two SP ranks (gloo, CPU: the copies are host to host) compile one Llama step with SAC, with the
offload forced on, under a budget that fits, and under one that does not; each against the same
model on one device, plus a control whose backward reads the wrong host copy.
"""

import pytest
import torch
import torch.distributed as dist
from sp_harness import VOCAB, lm_loss, rel_err, spawn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_autosp import AutoSPStrategy
from autosp.backend import AutoSPBackend
from autosp.models import Llama, LlamaConfig
from autosp.passes import offload as offload_pass
from autosp.passes.offload import OffloadConfig, parse_bytes, plan_offload
from autosp.passes.sac import SACConfig

OFFLOAD_OPS = {"autosp_offload::reload": "reload"}


def test_arguments():
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("1.5 GiB") == 3 * 2**29 and parse_bytes(1024) == 1024
    for bad in ("lots", "-1GB", "5 parsecs", -3, True, None):
        with pytest.raises(ValueError, match=r"memory_budget=.*non-negative number or a string such as '60GB'"):
            parse_bytes(bad)
    assert AutoSPStrategy(sp_size=2)._step_config.offload is None  # 'auto' without a budget: nothing moves
    assert AutoSPStrategy(sp_size=2, activation_offload=False, memory_budget="1GB")._step_config.offload is None
    assert AutoSPStrategy(sp_size=2, memory_budget="1GiB")._step_config.offload == OffloadConfig("auto", 2**30)
    assert AutoSPStrategy(sp_size=2, activation_offload=True)._step_config.offload == OffloadConfig(True, None)
    with pytest.raises(ValueError, match=r"activation_offload='always'\): pass 'auto'"):
        AutoSPStrategy(sp_size=2, activation_offload="always")
    with pytest.raises(ValueError, match=r"AutoSPStrategy\(memory_budget\)='big'"):
        AutoSPStrategy(sp_size=2, memory_budget="big")
    with pytest.raises(ValueError, match=r"compile_backend='eager'.*activation offload rewrites the partitioned"):
        AutoSPStrategy(sp_size=2, compile_backend="eager", sac=False, activation_offload=True)


def test_plan_offloads_the_earliest_until_the_rest_fits():
    sizes = [40, 30, 20, 10]
    assert plan_offload(sizes, OffloadConfig(True)) == ([True] * 4, None)
    assert plan_offload(sizes, OffloadConfig("auto", 100)) == ([False] * 4, 100)  # fits: nothing moves
    assert plan_offload(sizes, OffloadConfig("auto", 50)) == ([True, True, False, False], 50)
    assert plan_offload(sizes, OffloadConfig("auto", 0)) == ([True] * 4, 0)
    assert plan_offload(sizes, OffloadConfig("auto")) == ([False] * 4, None)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {"reload": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = OFFLOAD_OPS.get(func._schema.name)
        if name:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _swap_two_reloads(fw, bw, num_fwd_outputs, config):
    """The control: offload as asked, then let two reloads of same-shaped tensors read each other's copy."""
    plan = _real_offload(fw, bw, num_fwd_outputs, config)
    reloads = [n for n in bw.graph.nodes if n.target is torch.ops.autosp_offload.reload.default]
    for i, a in enumerate(reloads):
        for b in reloads[i + 1 :]:
            va, vb = a.args[0].meta["val"], b.args[0].meta["val"]
            if va.shape == vb.shape and va.stride() == vb.stride() and va.dtype == vb.dtype:
                a.args, b.args = (b.args[0], *a.args[1:]), (a.args[0], *b.args[1:])
                bw.recompile()
                return plan
    raise AssertionError("no two saved tensors of the same shape to swap")


_real_offload = offload_pass.offload_saved_activations

# name -> (offload config, swap two reloads, backend)
_CASES = {
    "off": (None, False, "aot_eager"),
    "forced": (OffloadConfig(True), False, "aot_eager"),
    "fits": (OffloadConfig("auto", 10**12), False, "aot_eager"),
    "tight": ("half", False, "aot_eager"),  # a budget of half what "off" saves
    "control": (OffloadConfig(True), True, "aot_eager"),
    "inductor": (OffloadConfig(True), False, "inductor"),  # the default configuration (inductor + SAC)
}


def _worker(rank, world):
    torch.manual_seed(0)
    ref_model = Llama(LlamaConfig.tiny(vocab_size=VOCAB, n_layers=2))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, VOCAB, (2, 30), generator=g), torch.randint(0, VOCAB, (2, 30), generator=g)
    ref_loss = lm_loss(ref_model(x), y, False)
    torch._dynamo.mark_dynamic(x, 1)  # what the strategy marks: the sequence dim
    torch._dynamo.mark_dynamic(y, 1)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}
    out, saved_off = {}, None
    for name, (cfg, swap, compiler) in _CASES.items():
        torch._dynamo.reset()
        if cfg == "half":
            cfg = OffloadConfig("auto", saved_off // 2)
        offload_pass.offload_saved_activations = _swap_two_reloads if swap else _real_offload
        torch.manual_seed(0)
        model = Llama(LlamaConfig.tiny(vocab_size=VOCAB, n_layers=2))
        backend = AutoSPBackend(
            sp_size=world, sp_rank=rank, group_name=dist.group.WORLD.group_name, backend=compiler, sac=SACConfig(), offload=cfg
        )
        step = torch.compile(lambda a, b: lm_loss(model(a), b, False), backend=backend)
        loss = step(x, y)
        counter = _CountOps()  # what backward runs (a dispatch mode around the forward would keep Dynamo out)
        with counter:
            loss.backward()
        for p in model.parameters():  # what DDP does: each SP rank's gradients average to one device's
            dist.all_reduce(p.grad)
            p.grad /= world
        (rec,) = backend.compiled_step().saved_activations
        device_bytes = sum(rec.bytes_by_kind().values())
        if name == "off":
            saved_off = device_bytes
        out[name] = dict(
            loss_err=abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            grad_err=max(rel_err(p.grad, ref_grads[n]) for n, p in model.named_parameters()),
            counts={"offload": sum(t.host for t in rec.tensors), "reload": counter.counts["reload"]},
            device_bytes=device_bytes,
            host_bytes=rec.host_bytes(),
            budget=cfg.budget if cfg is not None else None,
        )
    offload_pass.offload_saved_activations = _real_offload
    return out


@pytest.mark.slow
@pytest.mark.full
def test_offload_is_exact_and_moves_what_the_budget_requires(tmp_path):
    for res in spawn(tmp_path, _worker, 2):
        off = res["off"]
        for name in ("off", "forced", "fits", "tight", "inductor"):
            r = res[name]
            assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, (name, r)
        assert off["counts"] == {"offload": 0, "reload": 0} and off["host_bytes"] == 0
        # forced: every saved activation the step computed goes to host memory and comes back once
        forced = res["forced"]
        assert forced["counts"]["offload"] == forced["counts"]["reload"] > 0
        assert forced["host_bytes"] >= 0.9 * off["device_bytes"]
        assert forced["device_bytes"] + forced["host_bytes"] == off["device_bytes"]
        assert res["inductor"]["counts"]["offload"] == res["inductor"]["counts"]["reload"] > 0
        # a budget that fits inserts nothing; a tight one moves only what it must
        assert res["fits"]["counts"] == {"offload": 0, "reload": 0} and res["fits"]["host_bytes"] == 0
        tight = res["tight"]
        assert 0 < tight["counts"]["offload"] < forced["counts"]["offload"]
        assert tight["device_bytes"] <= tight["budget"] < tight["device_bytes"] + tight["host_bytes"]
        # the control: backward reads another tensor's copy - the forward is unchanged, the gradients are not
        control = res["control"]
        assert control["loss_err"] < 1e-5 and control["grad_err"] > 1e-2, control


# ----------------------------------------------------------------------------- whole blocks (ALST's scheme)
@pytest.mark.slow
@pytest.mark.parametrize("offload", [pytest.param(False, marks=pytest.mark.full), True], ids=["block", "block-offload"])
def test_block_recompute_is_exact(tmp_path, offload):
    """``sac="block"``: every transformer block recomputed whole in backward (attention and its
    all-to-alls run again), only what each block hands on saved - with ``activation_offload=True``
    kept in host memory. Hugging Face Llama and our Llama, 31 tokens over sp=2, against one device
    and the naive-sharding control."""
    from mask_models import ModelZoo, PaddedBothSides, hf_factory, plain_call
    from sp_harness import FnModule, check_against_references, run_fit
    from test_tiled_mlp import example_call

    def factory():
        return ModelZoo([("hf_llama", hf_factory("llama", layers=2, seed=41), plain_call), ("llama", _llama, example_call)])

    run = run_fit(
        tmp_path, FnModule(factory, ModelZoo.loss, log_loss=False), PaddedBothSides(4, 31), devices=2, sp_size=2,
        sac="block", activation_offload=offload,
    )
    loss_err, grad_err, naive = check_against_references(run, 2, factory, ModelZoo.loss)
    print(f"sac=block offload={offload}: loss {loss_err:.2e} grad {grad_err:.2e} (naive: {naive:.2e})")
    (recomputed, device, host), = run.ranks[0]["saved"]
    assert recomputed.get("seq_gather", 0) >= 3 * 4 and any("attention" in op for op in recomputed), recomputed  # 4 blocks
    # offloaded: all but the generators' states the recomputed random ops replay (5 KiB each on CPU)
    assert (device <= 0.25 * host) if offload else (host == 0 < device), (device, host)


def _llama():
    from sp_harness import make_model

    return make_model("llama")
