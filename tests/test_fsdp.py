"""``AutoSPStrategy(fsdp=True)``: parameters, gradients and AdamW state sharded over the whole
``dp x sp`` world, with the losses and parameters of one device.

Each run trains 3 AdamW steps and is compared with one device replaying the batches: per-step
losses, the shard gradients before the first step (this rank's elements of one device's
flattened gradient; Adam would hide a wrong gradient scale in the parameters) and the final
parameters, gathered with ``full_state_dict`` under the model's own key names. The negative
control compares the same run with one device trained on a shifted copy of the data.

Parameters are compared on the elements whose one-device gradient is not numerically zero. The
key bias of attention has an exactly zero gradient (softmax ignores a constant per query row),
which float sums leave at ~1e-11 with a sign that depends on the summation order; AdamW divides
by the root of its square and turns it into a step of ~lr (measured: 26 of 96 elements of GPT's
qkv bias, 2e-5 apart after 3 steps, while every gradient agrees to 3e-7). Those elements are
only held to Adam's bound, ``lr`` per step.
"""

import pytest
import torch
from sp_harness import FnModule, LMModule, TokenData, make_model, reference, reference_fn, rel_err, run_fit, spawn

TOL = 1e-4
LR = 1e-2
CLIP = 0.05  # below the tiny GPT's gradient norms at every step (asserted), so clipping acts
ZERO_GRAD = 1e-8  # a one-device gradient below this at every step is rounding noise of a zero


def _check_initialised_from_meta(run, kind):
    """The module was built on the meta device; setup gave it the model's own initialisation:
    the root's ``reset_parameters`` (normal(0, init_std), norms at one, the RoPE table) won over
    the defaults of its ``nn.Linear``/``nn.Embedding`` children. (The RoPE table, a buffer
    outside the state dict, is checked by the losses: the reference builds it eagerly.)"""
    assert all(rec["built_on"] == "meta" for rec in run.ranks)
    eager = make_model(kind, layers=1)
    initial = run.ranks[0]["initial"]
    assert sorted(initial) == sorted(eager.state_dict())
    std = eager.config.init_std
    for key, value in initial.items():
        assert torch.isfinite(value).all(), key
        if key.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value)), key
        elif key.endswith("tok_embeddings.weight") or key.endswith("wq.weight"):
            assert abs(value.std().item() - std) < 0.1 * std, (key, value.std())


def _errors(run, sp_size, ref_losses, ref_grads, ref_final):
    loss_err = grad_err = param_err = 0.0
    for r, rec in enumerate(run.ranks):
        for got, want in zip(rec["losses"], ref_losses):
            loss_err = max(loss_err, abs(got - want[r // sp_size]) / abs(want[r // sp_size]))
        first = rec["grads"][0]
        assert sorted(n.removeprefix("model.") for n in first) == sorted(ref_grads[0]), "gradients missing"
        for name, g in first.items():
            grad_err = max(grad_err, rel_err(g, ref_grads[0][name.removeprefix("model.")]))
        assert sorted(rec["final"]) == sorted(ref_final)  # the model's own key names
        for key, value in rec["final"].items():
            want = ref_final[key]
            live = torch.zeros_like(want, dtype=torch.bool)
            for step in ref_grads:
                live |= step[key].abs() > ZERO_GRAD if key in step else True
            param_err = max(param_err, rel_err(value[live], want[live]))
            assert ((value - want).abs()[~live] <= LR * len(ref_grads)).all()
    return loss_err, grad_err, param_err


@pytest.mark.parametrize(
    "kind,devices,sp_size,clip,in_configure_model",
    [("gpt", 2, 2, CLIP, False), ("llama", 4, 2, None, True)],
    ids=["gpt-sp2-clipped", "llama-dp2xsp2-configure_model"],
)
def test_sharded_matches_single_device(tmp_path, kind, devices, sp_size, clip, in_configure_model):
    """GPT: built in ``__init__``, ``gradient_clip_val`` active. Llama: built in
    ``configure_model``, so on the meta device, and initialised by the strategy."""
    module = LMModule(kind, lr=LR, optimizer="adamw", in_configure_model=in_configure_model, layers=1, log_loss=False)
    run = run_fit(tmp_path, module, TokenData(16, 32), devices, sp_size, fsdp=True, gradient_clip_val=clip)
    initial = run.ranks[0]["initial"]
    assert all(all(torch.equal(rec["initial"][k], v) for k, v in initial.items()) for rec in run.ranks)
    if in_configure_model:
        _check_initialised_from_meta(run, kind)
    final: dict = {}
    norms: list = []
    kwargs = dict(lr=LR, optimizer="adamw", initial=initial, clip=clip, layers=1)
    ref_losses, ref_grads = reference(kind, run, sp_size, final=final, norms=norms, **kwargs)
    loss_err, grad_err, param_err = _errors(run, sp_size, ref_losses, ref_grads, final)
    print(f"fsdp {kind} devices={devices} sp={sp_size}: loss {loss_err:.2e}, grads {grad_err:.2e}, params {param_err:.2e}")
    assert loss_err <= TOL and grad_err <= TOL and param_err <= TOL
    if clip is not None:
        # clipping acted (Lightning's own path: torch's clip_grad_norm_ on the DTensor gradients),
        # and by the whole model's norm: the gradients the optimizer stepped with have norm `clip`.
        # Negative control: one rank's shards alone have another norm, so clipping by it would
        # leave another norm (Adam's scale invariance would hide it in the parameters)
        print(f"  total gradient norms {norms} (clipped to {clip}); stepped with {run.ranks[0]['stepped_norms']}")
        assert all(n > 1.5 * clip for n in norms)
        for rec in run.ranks:
            assert all(abs(n / clip - 1) < 1e-5 for n in rec["stepped_norms"]), rec["stepped_norms"]
            assert all(abs(loc / clip - 1) > 0.1 for loc in rec["local_norms"]), rec["local_norms"]
    graphs = run.ranks[0]["graphs"]["training_step"]
    assert sum(g.sdpa for g in graphs) == 1 and all(not g.fallbacks for g in graphs)
    # SAC gathers the parameters again in backward rather than saving full weights (before it
    # did: the tiny Llama saved 452004 bytes, 204324 with the gathers recomputed)
    gathered = [n for n in run.ranks[0]["saved_names"] if n.startswith(("wait_tensor", "all_gather"))]
    assert run.ranks[0]["saved_names"] and not gathered, gathered

    # memory: each rank holds 1/world of parameters, gradients and AdamW state (+ padding)
    numel = sum(g.numel() for g in ref_grads[0].values())  # each parameter once (tied ones too)
    expected = 4 * numel * 4 / run.world  # fp32 parameter, gradient, exp_avg, exp_avg_sq
    for rec in run.ranks:
        held = sum(rec["bytes"].values())
        print(f"  rank bytes {rec['bytes']} = {held} vs total/world {expected:.0f}")
        assert abs(held - expected) <= 0.10 * expected

    # negative control: one device trained on other batches does not match
    shifted = type(run)([{**rec, "batches": rec["batches"][1:] + rec["batches"][:1]} for rec in run.ranks])
    bad_final: dict = {}
    bad = reference(kind, shifted, sp_size, final=bad_final, **kwargs)
    bad_loss, bad_grad, bad_param = _errors(run, sp_size, *bad, bad_final)
    assert bad_grad > 100 * TOL and bad_param > 100 * TOL


def test_sharded_hugging_face_llama_matches_single_device(tmp_path):
    from test_any_model import PaddedData, hf_loss, hf_model

    factory = hf_model("llama")
    run = run_fit(tmp_path, FnModule(factory, hf_loss, lr=LR, optimizer="adamw", log_loss=False), PaddedData(8, 32, "right"), 2, 2, fsdp=True)
    final: dict = {}
    ref_losses, ref_grads = reference_fn(factory, hf_loss, run, 2, lr=LR, optimizer="adamw", final=final)
    loss_err, grad_err, param_err = _errors(run, 2, ref_losses, ref_grads, final)
    print(f"fsdp HF llama sp=2: loss {loss_err:.2e}, grads {grad_err:.2e}, params {param_err:.2e}")
    assert loss_err <= TOL and grad_err <= TOL and param_err <= TOL


def _shard_roundtrip(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from lightning_autosp.fsdp import ShardingPolicy, full_state_dict, is_sharded, shard_module, unshard_module

    model = make_model("gpt")  # its output head is tied to the token embedding
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: (tuple(p.shape), p.dim()) for n, p in model.named_parameters()}
    classes = [type(m) for m in model.modules()]
    shard_module(model, ShardingPolicy(DeviceMesh.from_group(dist.group.WORLD, "cpu")))
    sharded = {n: (tuple(p.shape), p.dim()) for n, p in model.named_parameters()}
    local = {n: p.to_local().numel() for n, p in model.named_parameters()}
    dtensors = all(isinstance(p, DTensor) for p in model.parameters())
    tied_sharded = model.head._parameters["weight"] is model.wte._parameters["weight"]
    read = model.head.weight  # what forward reads: the gathered weight, a plain tensor
    gathered = full_state_dict(model)
    unshard_module(model)
    return {
        "same_params": sharded == params, "dtensors": dtensors, "local": local, "tied_sharded": tied_sharded,
        "read": (type(read).__name__, tuple(read.shape), torch.equal(read, before["head.weight"])),
        "gathered_equal": sorted(gathered) == sorted(before) and all(torch.equal(gathered[k], before[k]) for k in before),
        "names_back": {n: (tuple(p.shape), p.dim()) for n, p in model.named_parameters()} == params, "sharded_after": is_sharded(model),
        "tied_after": model.head.weight is model.wte.weight, "classes_back": [type(m) for m in model.modules()] == classes,
        "equal_after": all(torch.equal(model.state_dict()[k], before[k]) for k in before),
        "plain_after": not any(isinstance(p, DTensor) for p in model.parameters()),
    }


def test_shard_and_unshard_round_trip(tmp_path):
    """What fit does to the module and gives back at its end (``on_train_end``). While sharded:
    the model's own parameter names, shapes and dims, each a DTensor of which a rank holds 1/world
    of the rows (3 ranks: the rows do not divide, the last ranks hold fewer), the tied head one
    parameter with the embedding, and reading ``head.weight`` in forward gives the full weight.
    After: the same parameters, names, ties and classes, plain tensors again."""
    results = spawn(tmp_path, _shard_roundtrip, 3)
    model = make_model("gpt")
    for rank, r in enumerate(results):
        assert r["same_params"] and r["dtensors"] and r["tied_sharded"]
        assert r["read"] == ("Tensor", (64, 32), True)
        for name, p in model.named_parameters():
            rows = p.shape[0]
            assert r["local"][name] == len(range(rows)[rank * -(-rows // 3) : (rank + 1) * -(-rows // 3)]) * p[0].numel(), name
        assert r["gathered_equal"] and r["names_back"] and r["tied_after"] and r["equal_after"] and r["classes_back"] and r["plain_after"]
        assert not r["sharded_after"]
    assert sum(r["local"]["blocks.0.attn.qkv.bias"] for r in results) == 96 and results[2]["local"]["blocks.0.attn.qkv.bias"] == 32
    assert any(p.shape[0] % 3 for p in model.parameters())  # uneven shards exercised


def test_fsdp_argument_is_checked():
    from lightning_autosp import AutoSPStrategy

    with pytest.raises(ValueError, match=r"fsdp='yes'.*True or 'full'.*'hybrid'.*False"):
        AutoSPStrategy(fsdp="yes")


class _TableWithoutInit(torch.nn.Module):
    """A RoPE-style table computed in ``__init__`` that no initialiser rebuilds."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0), persistent=False)


def test_materialize_meta_runs_the_models_own_initialisers():
    """Built on meta, then given storage: the model's initialisers run children first, parents
    last (the root's init wins, as when built for real), ties survive, and a tensor no initialiser
    writes is an error naming it, not uninitialised memory."""
    from test_any_model import hf_model

    from lightning_autosp import AutoSPError
    from lightning_autosp.fsdp import has_meta_tensors, materialize_meta

    with torch.device("meta"):
        gpt = make_model("gpt")
    assert has_meta_tensors(gpt) and materialize_meta(gpt, torch.device("cpu")) > 0 and not has_meta_tensors(gpt)
    assert gpt.head.weight is gpt.wte.weight
    eager = make_model("gpt")
    for key, value in gpt.state_dict().items():  # normal(0, 0.02), zero biases, unit norms: GPT.reset_parameters
        want = eager.state_dict()[key]
        assert value.shape == want.shape and abs(value.std() - want.std()) <= 0.1 * want.std() + 1e-7, key
        assert (value.mean() - want.mean()).abs() <= 0.1 * want.std() + 0.01 * want.abs().max(), key

    with torch.device("meta"):
        hf = hf_model("llama")()  # Hugging Face: PreTrainedModel.init_weights, RoPE buffers included
    materialize_meta(hf, torch.device("cpu"))
    assert all(torch.isfinite(t).all() for t in [*hf.parameters(), *hf.buffers()])

    with torch.device("meta"):
        bad = _TableWithoutInit()
    with pytest.raises(AutoSPError, match=r"no initialiser wrote table.*reset_parameters.*empty_init=False"):
        materialize_meta(bad, torch.device("cpu"))
    real = _TableWithoutInit()  # negative control: built for real, nothing to materialise
    assert materialize_meta(real, torch.device("cpu")) == 0 and torch.equal(real.table, torch.arange(4.0))

    # real weights next to meta ones keep their values; one initialiser over both is refused
    pretrained = torch.nn.Linear(4, 4)
    with torch.device("meta"):
        head = torch.nn.Linear(4, 4)
    before = pretrained.weight.detach().clone()
    materialize_meta(torch.nn.Sequential(pretrained, head), torch.device("cpu"))
    assert torch.equal(pretrained.weight, before) and torch.isfinite(head.weight).all()
    with torch.device("meta"):
        mixed = _TableWithoutInit()
    mixed.proj = torch.nn.Linear(4, 4)  # real, under a parent whose initialiser covers it
    mixed.reset_parameters = lambda: None
    with pytest.raises(AutoSPError, match=r"meta device next to real ones.*overwrite"):
        materialize_meta(mixed, torch.device("cpu"))


def test_init_module_builds_on_meta_only_in_sharded_mode():
    """``Trainer.init_module()`` (and ``configure_model``, which Lightning calls under the same
    context): meta with ``fsdp=True`` unless ``empty_init=False``; replicas are built for real."""
    import lightning as L

    from lightning_autosp import AutoSPStrategy

    def device_of(fsdp, **kwargs):
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=AutoSPStrategy(sp_size=1, fsdp=fsdp), logger=False)
        with trainer.init_module(**kwargs):
            return next(make_model("gpt", layers=1).parameters()).device.type

    assert device_of(True) == "meta" and device_of(True, empty_init=True) == "meta"
    assert device_of(True, empty_init=False) == "cpu" and device_of(False) == "cpu"
