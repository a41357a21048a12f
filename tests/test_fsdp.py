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
from sp_harness import FnModule, LMModule, TokenData, local_tensor, make_model, reference, reference_fn, rel_err, run_fit, scalar_err, spawn

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
            loss_err = max(loss_err, scalar_err(got, want[r // sp_size]))
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
    [("gpt", 2, 2, CLIP, False), pytest.param("llama", 4, 2, None, True, marks=[pytest.mark.slow, pytest.mark.full])],
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
    # one gather per block in forward (embeddings, the layer, final norm + head), one
    # reduce-scatter per block in backward; never one bucket for the whole model
    forward, backward = run.ranks[0]["buckets"]["training_step"]
    print(f"  collectives per step: forward {forward.all_gathers} gathers -> {forward.gather_buckets}, backward {backward.all_gathers} -> {backward.gather_buckets} gathers and {backward.reduce_scatters} -> {backward.scatter_buckets} reduce-scatters")
    from autosp._compat import BUCKETING_MERGES

    if BUCKETING_MERGES:
        assert forward.all_gathers > 10 and forward.gather_buckets == 3 and backward.scatter_buckets == 3 and backward.gather_buckets == 2
    else:  # one collective per parameter on a torch whose bucketing is not trusted (see _compat)
        assert forward.gather_buckets == forward.all_gathers > 10 and backward.scatter_buckets == backward.reduce_scatters
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


class _FromConfig(FnModule):
    """The large-model way: the model built in ``configure_model`` (on meta with fsdp)."""

    def __init__(self, factory, loss_fn, **kwargs):
        super().__init__(lambda: None, loss_fn, **kwargs)
        self.factory = factory

    def configure_model(self):
        if self.model is None:
            self.model = self.factory()


def _hf_llama_tied():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, attn_implementation="sdpa", tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config)


@pytest.mark.slow
@pytest.mark.full
def test_sharded_fine_tune_from_hugging_face_weights_matches_single_device(tmp_path):
    """A fine-tune as a Hugging Face user starts one: a Llama (tied embeddings) saved with
    ``save_pretrained`` (safetensors, the tied head stored once), built from its config in
    ``configure_model`` (meta) and read with ``pretrained={"model": dir}``, each rank reading the
    rows of its shards. The weights it starts from are the saved ones (a freshly built model's
    differ: negative control), and losses, gradients and the parameters after 3 AdamW steps equal
    one device starting from them."""
    from test_any_model import PaddedData, hf_loss

    trained = _hf_llama_tied()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    trained.save_pretrained(tmp_path / "hf")
    saved = {k: v.clone() for k, v in trained.state_dict().items()}
    assert not (tmp_path / "hf" / "pytorch_model.bin").exists() and list((tmp_path / "hf").glob("*.safetensors"))

    def factory():
        model = _hf_llama_tied()
        model.load_state_dict(saved)
        return model

    module = _FromConfig(_hf_llama_tied, hf_loss, lr=LR, optimizer="adamw", log_loss=False)
    run = run_fit(tmp_path, module, PaddedData(8, 32, "right"), 2, 2, fsdp=True, pretrained={"model": str(tmp_path / "hf")})
    initial = run.ranks[0]["initial"]
    assert sorted(initial) == sorted(saved) and all(torch.equal(initial[k], v) for k, v in saved.items())
    fresh = _hf_llama_tied().state_dict()
    assert not torch.equal(fresh["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])
    final: dict = {}
    ref_losses, ref_grads = reference_fn(factory, hf_loss, run, 2, lr=LR, optimizer="adamw", final=final)
    loss_err, grad_err, param_err = _errors(run, 2, ref_losses, ref_grads, final)
    print(f"fsdp HF llama from pretrained, sp=2: loss {loss_err:.2e}, grads {grad_err:.2e}, params {param_err:.2e}")
    assert loss_err <= TOL and grad_err <= TOL and param_err <= TOL

    # trainer.test without fit: the model is built whole on every rank (no sharding outside fit)
    # and the weights read whole; the test losses are one device's on those weights
    from sp_harness import run_eval

    tested = run_eval(tmp_path, _FromConfig(_hf_llama_tied, hf_loss), PaddedData(4, 32, "right"), 2, 2, "test", fsdp=True, pretrained={"model": str(tmp_path / "hf")})
    model = factory()
    for rec in tested.ranks:
        for loss, batch in zip(rec["test_losses"], rec["eval_batches"]):
            assert loss == pytest.approx(hf_loss(model, batch).item(), rel=1e-5)


def _shard_roundtrip(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from autosp.modes.sharded.config import ShardingPolicy

    from autosp.modes.sharded.values import full_state_dict

    from autosp.modes.sharded.params import is_sharded, shard_module, unshard_module

    model = make_model("gpt")  # its output head is tied to the token embedding
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: (tuple(p.shape), p.dim()) for n, p in model.named_parameters()}
    classes = [type(m) for m in model.modules()]
    shard_module(model, ShardingPolicy(DeviceMesh.from_group(dist.group.WORLD, "cpu")))
    sharded = {n: (tuple(p.shape), p.dim()) for n, p in model.named_parameters()}
    local = {n: p.to_local().numel() for n, p in model.named_parameters()}
    dtensors = all(isinstance(p, DTensor) for p in model.parameters())
    tied_sharded = model.head.weight is model.wte.weight and isinstance(model.head.weight, torch.nn.Parameter)
    seen_in_forward = []  # what forward reads (here an eager forward): the gathered weight, a plain tensor
    model.head.register_forward_pre_hook(lambda m, args: seen_in_forward.append(m.weight.detach().clone()))
    model(torch.randint(0, 64, (1, 6)))
    read = seen_in_forward[0]
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
    parameter with the embedding (``head.weight`` outside a forward is that parameter), and
    reading ``head.weight`` in a forward (here an eager one) gives the full weight.
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
    # the DDP wrapper's arguments would do nothing in the sharded mode: refused, naming them
    with pytest.raises(ValueError, match=r"fsdp=True.*\['ddp_comm_hook', 'find_unused_parameters'\] would do nothing.*fsdp=False"):
        AutoSPStrategy(fsdp=True, ddp_comm_hook=lambda state, bucket: None, find_unused_parameters=True)
    with pytest.raises(ValueError, match=r"fsdp='hybrid'.*\['model_averaging_period'\]"):
        AutoSPStrategy(fsdp="hybrid", model_averaging_period=4)
    with pytest.raises(ValueError, match=r"param_dtype=.*with fsdp=False parameters are replicas"):
        AutoSPStrategy(param_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"reduce_dtype='int8'.*floating-point torch dtype"):
        AutoSPStrategy(fsdp=True, reduce_dtype="int8")
    AutoSPStrategy(fsdp=False, find_unused_parameters=True)  # negative control: DDP's own arguments stay DDP's
    strategy = AutoSPStrategy(fsdp="hybrid", param_dtype="bfloat16")
    policy = strategy._mode.config.policy(mesh=None, precision="32-true")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert AutoSPStrategy(fsdp=True)._mode.config.policy(None, "bf16-mixed").param_dtype == torch.bfloat16
    assert AutoSPStrategy(fsdp=True)._mode.config.policy(None, "32-true").param_dtype is None


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
    from autosp.modes.sharded.materialize import has_meta_tensors, materialize_meta

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


class _UserCode(LMModule):
    """What ordinary Lightning code reads from the parameters: nanoGPT's weight-decay groups by
    ``p.dim()``, names ending in ``.bias``, shapes, gradient norms logged in
    ``on_before_optimizer_step`` (with ``lightning_autosp.grad_norm`` and ``self.log`` of a
    single parameter's gradient norm, a ``Partial`` DTensor when sharded)."""

    def __init__(self, out):
        super().__init__("gpt", lr=LR, optimizer="adamw", layers=1, log_loss=False)
        self.out = str(out)
        self.seen: dict = {}

    def configure_optimizers(self):
        named = list(self.named_parameters())
        decay = [p for _, p in named if p.dim() >= 2]
        self.seen.update(
            decayed=len(decay), not_decayed=len(named) - len(decay), biases=sorted(n for n, _ in named if n.endswith(".bias")),
            shapes={n: tuple(p.shape) for n, p in named},
            # the negative control: what a flat 1-D shard per rank (the former sharded mode) shows
            flat_decayed=sum(local_tensor(p).reshape(-1).dim() >= 2 for _, p in named),
        )
        no_decay = [p for _, p in named if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=LR)

    def on_before_optimizer_step(self, optimizer):
        import lightning_autosp
        from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

        norms = lightning_autosp.grad_norm(self, norm_type=2)
        self.log_dict(norms)
        self.log("wte_grad_norm", self.model.wte.weight.grad.norm())
        self.seen["grad_norm"] = {k: float(v) for k, v in norms.items()}
        self.seen["local_grad_norm"] = float(torch.stack([local_tensor(p.grad).norm() for p in self.parameters()]).norm())
        try:
            self.seen["lightning_grad_norm"] = {k: float(v) for k, v in lightning_grad_norm(self, norm_type=2).items()}
        except RuntimeError as exc:
            self.seen["lightning_grad_norm"] = str(exc)

    def on_train_end(self):
        self.seen["logged"] = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
        torch.save(self.seen, f"{self.out}/rank{self.global_rank}.pt")


@pytest.mark.slow
@pytest.mark.full
def test_user_code_sees_what_it_sees_on_one_device(tmp_path):
    """The issue's table, sharded against replicated (GPT with biases, sp=2, one step): the same
    weight-decay groups (for the 1-layer GPT: 6 matrices decayed, 10 vectors not), names,
    shapes, and gradient norms logged per parameter and in total, on every rank. Negative
    controls: flat 1-D shards would decay nothing, and one rank's shards have another norm.
    Lightning's own ``grad_norm`` cannot read DTensor gradients: it raises (not a silent wrong
    value), and AutoSP turns that error into one naming ``lightning_autosp.grad_norm``."""
    seen = {}
    for fsdp in (False, True):
        out = tmp_path / f"fsdp{fsdp}"
        out.mkdir()
        run_fit(tmp_path, _UserCode(out), TokenData(4, 32), 2, 2, steps=1, fsdp=fsdp)
        seen[fsdp] = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    model = make_model("gpt", 1)
    matrices = sum(p.dim() >= 2 for p in model.parameters())
    for rec in seen[True] + seen[False]:
        want = seen[False][0]
        assert (rec["decayed"], rec["not_decayed"]) == (want["decayed"], want["not_decayed"]) == (matrices, len(list(model.parameters())) - matrices)
        assert rec["biases"] == want["biases"] and len(rec["biases"]) > 0 and rec["shapes"] == want["shapes"]
        assert rec["grad_norm"].keys() == want["grad_norm"].keys()
        for k, v in want["grad_norm"].items():
            assert abs(rec["grad_norm"][k] / v - 1) < 1e-5, k
        total = want["grad_norm"]["grad_2.0_norm_total"]
        assert abs(rec["logged"]["grad_2.0_norm_total"] / total - 1) < 1e-5
        assert abs(rec["logged"]["wte_grad_norm"] / want["logged"]["wte_grad_norm"] - 1) < 1e-5
    for rec in seen[False]:  # replicated: Lightning's grad_norm works and agrees
        assert all(abs(rec["lightning_grad_norm"][k] / v - 1) < 1e-5 for k, v in rec["grad_norm"].items())
    for rec in seen[True]:
        assert rec["flat_decayed"] == 0  # negative control: flat shards would silently turn weight decay off
        assert abs(rec["local_grad_norm"] / rec["grad_norm"]["grad_2.0_norm_total"] - 1) > 0.1  # ... and log one rank's norm
        assert "data is not allocated" in rec["lightning_grad_norm"]


def test_lightning_grad_norm_error_names_the_fix():
    """The hook wrapper AutoSP puts around ``on_before_optimizer_step`` in the sharded mode: the
    error Lightning's ``grad_norm`` raises on DTensors becomes an AutoSPError naming the fix;
    any other error passes unchanged."""
    from lightning_autosp import AutoSPError
    from lightning_autosp.module_hooks import explaining_dtensor_errors as _explaining_dtensor_errors

    def hook(message):
        raise RuntimeError(message)

    wrapped = _explaining_dtensor_errors(hook, "on_before_optimizer_step")
    with pytest.raises(AutoSPError, match=r"lightning_autosp\.grad_norm\(self, norm_type\)"):
        wrapped("The tensor has a non-zero number of elements, but its data is not allocated yet.")
    with pytest.raises(RuntimeError, match="^other$"):
        wrapped("other")


@pytest.mark.slow
@pytest.mark.full
def test_sharded_bf16_mixed_gathers_in_bf16(tmp_path):
    """``precision="bf16-mixed"``: parameters are all-gathered in bfloat16 (half the bytes of
    fp32) and gradients reduce-scattered in float32 (read off every rank's compiled graphs), the
    shards and AdamW state stay fp32. Against one device under the same autocast with the parameters cast to bfloat16
    as they are gathered, the losses and the first step's gradients agree to 2e-2: bf16 keeps 8
    significant bits (eps 2**-7 = 7.8e-3), the sp=2 ranks run the same matmuls on other blocks
    (S/P tokens, H/P heads) and each rank's gradient share is rounded to bf16 before the fp32 sum,
    where one device rounds the whole once - a few eps (measured 1.1e-2). Later steps' gradients
    are held to 5e-2: AdamW turns those differences into parameter steps of up to lr where a
    gradient is near zero (measured 1.5e-2, 2.6e-2). Against one device under plain autocast
    (fp32 weights where autocast leaves an op in fp32: norms, embedding) the difference is
    reported. Negative control: sharding the sequence without the pass is off by ~100%."""
    from test_any_model import TinyAttentionLM, tiny_loss

    from sp_harness import compare, naive_reference_fn

    factory = lambda: TinyAttentionLM(heads=4, kv_heads=2)  # noqa: E731
    module = FnModule(factory, tiny_loss, lr=LR, optimizer="adamw", log_loss=False)
    run = run_fit(tmp_path, module, TokenData(8, 32), 2, 2, fsdp=True, precision="bf16-mixed")

    def bf16_params(model, batch):  # one device, parameters cast as the sharded mode gathers them
        params = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return tiny_loss(lambda *args: torch.func.functional_call(model, params, args), batch)

    from sp_harness import replay

    ref_losses, ref_grads = replay(factory, bf16_params, run, 2, LR, optimizer="adamw")
    loss_err, grad_err = compare(run, 2, ref_losses, ref_grads)
    first = type(run)([{**rec, "grads": rec["grads"][:1]} for rec in run.ranks])
    first_err = compare(first, 2, ref_losses, ref_grads[:1])[1]
    plain = compare(run, 2, *reference_fn(factory, tiny_loss, run, 2, lr=LR, optimizer="adamw", bf16=True))
    naive = compare(run, 2, *naive_reference_fn(factory, tiny_loss, run, 2, lr=LR))
    print(
        f"fsdp bf16-mixed sp=2: loss {loss_err:.2e}, first step's gradients {first_err:.2e}, every step's {grad_err:.2e}; "
        f"against plain autocast (fp32 weights): loss {plain[0]:.2e} gradients {plain[1]:.2e}; naive sharding: gradients {naive[1]:.2e}"
    )
    assert loss_err <= 2e-2 and first_err <= 2e-2 and grad_err <= 5e-2
    assert naive[1] > 0.2
    for rec in run.ranks:  # the compiled graphs' collectives: gathers in bf16, reduce-scatters in fp32
        stats = rec["buckets"]["training_step"]
        assert {d for s in stats for d in s.gather_dtypes} == {"torch.bfloat16"}
        assert {d for s in stats for d in s.scatter_dtypes} == {"torch.float32"}
        assert sum(s.reduce_scatters for s in stats) > 0
    held = run.ranks[0]["bytes"]  # fp32 masters: 4 bytes per element of parameter, gradient, both moments
    numel = sum(p.numel() for p in factory().parameters())
    assert abs(sum(held.values()) - 16 * numel / 2) <= 0.1 * 16 * numel / 2, held


def _node_agent(node_rank, port, out, steps):
    """One of two launcher agents on this machine, as on two nodes: ``NODE_RANK`` from the
    environment, two processes each (Lightning forks them), four ranks in all."""
    import os

    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_autosp import AutoSPStrategy
    from sp_harness import Recorder

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(node_rank))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, num_nodes=2, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[Recorder(out)],
        # the agent itself was started clean (START_METHOD), so it may fork its ranks
        strategy=AutoSPStrategy(sp_size=2, compile_backend="aot_eager", start_method="fork", fsdp="hybrid"),
    )
    module = LMModule("llama", lr=LR, optimizer="adamw", layers=1, log_loss=False)
    trainer.fit(module, DataLoader(TokenData(16, 32), batch_size=2, shuffle=False))


@pytest.mark.slow
@pytest.mark.full
def test_hybrid_sharding_two_nodes_matches_single_device(tmp_path):
    """``fsdp="hybrid"`` on two simulated nodes (two launcher agents with NODE_RANK 0 and 1, two
    processes each): dp=2 x sp=2, parameters sharded within a node (``(replicate, shard)`` mesh
    [[0, 1], [2, 3]]: a rank holds half of each parameter, the same half as its peer on the other
    node) and replicated across nodes, so gathers stay inside a node. Losses, gradients and the
    parameters after 3 AdamW steps equal one device. Negative control: one device on other batches."""
    import multiprocessing

    from sp_harness import START_METHOD, Run, free_port

    port, steps = free_port(), 3
    ctx = multiprocessing.get_context(START_METHOD)
    agents = [ctx.Process(target=_node_agent, args=(node, port, str(tmp_path), steps)) for node in (0, 1)]
    for a in agents:
        a.start()
    for a in agents:
        a.join(timeout=600)
    assert [a.exitcode for a in agents] == [0, 0]
    run = Run([torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)])
    assert [rec["sp_group"] for rec in run.ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for r, rec in enumerate(run.ranks):
        for name, (mesh, placements, local) in rec["placement"].items():
            assert mesh == [[0, 1], [2, 3]] and placements == ("R", "S(0)"), (name, mesh, placements)
            peer = run.ranks[(r + 2) % 4]["placement"][name][2]  # the same local rank on the other node
            assert torch.equal(local, peer), name
            rows = rec["initial"][name.removeprefix("model.")].shape[0]
            half = -(-rows // 2)  # local rank 0 holds the first ceil(rows / 2) rows, local rank 1 the rest
            assert local.shape[0] == (half if r % 2 == 0 else rows - half), name
    final: dict = {}
    kwargs = dict(lr=LR, optimizer="adamw", initial=run.ranks[0]["initial"], layers=1, final=final)
    ref_losses, ref_grads = reference("llama", run, 2, **kwargs)
    loss_err, grad_err, param_err = _errors(run, 2, ref_losses, ref_grads, final)
    print(f"hybrid 2 nodes x 2: loss {loss_err:.2e}, grads {grad_err:.2e}, params {param_err:.2e}")
    assert loss_err <= TOL and grad_err <= TOL and param_err <= TOL
    shifted = type(run)([{**rec, "batches": rec["batches"][1:] + rec["batches"][:1]} for rec in run.ranks])
    bad_final: dict = {}
    bad = reference("llama", shifted, 2, **{**kwargs, "final": bad_final})
    assert min(_errors(run, 2, *bad, bad_final)[1:]) > 100 * TOL


class _Block(torch.nn.Module):
    """A block with its own initialiser (over its children's defaults)."""

    def __init__(self, dim):
        super().__init__()
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
        self.reset_parameters()

    def reset_parameters(self):
        _Block.materialized.append(sum(p.numel() for p in _Block.model.parameters() if not p.is_meta and not hasattr(p, "to_local")))
        torch.nn.init.normal_(self.up.weight, std=0.02)
        torch.nn.init.zeros_(self.down.bias)

    materialized: list = []
    model: torch.nn.Module = torch.nn.Module()


def _stack(layers=4, dim=16, vocab=50):
    """No root initialiser: every unit initialises itself (an embedding, the blocks, a norm, a head)."""
    return torch.nn.Sequential(torch.nn.Embedding(vocab, dim), *[_Block(dim) for _ in range(layers)], torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab))


def _build_sharded(rank, world, path):
    """Unit by unit from meta: the values of one device built for real with the same seed, while a
    rank holds at most one unit whole; then a Llama read from a one-file state dict (its RoPE table,
    a non-persistent buffer, recomputed by its initialiser), and files that do not fit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_autosp import AutoSPError
    from autosp.modes.sharded.config import ShardingPolicy
    from autosp.modes.sharded.values import full_state_dict
    from autosp.modes.sharded.params import shard_module
    from autosp.modes.sharded.pretrained import load_pretrained
    from autosp.modes.sharded.materialize import materialize_sharded

    policy = ShardingPolicy(DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    torch.manual_seed(0)
    ref = _stack()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = _stack()
    _Block.model, _Block.materialized = model, []
    report = materialize_sharded(model, torch.device("cpu"), policy)
    shard_module(model, policy)
    built = full_state_dict(model)
    out = {
        "units": report.units, "largest": report.largest_unit_bytes, "model_bytes": report.model_bytes,
        "materialized": list(_Block.materialized), "block": sum(p.numel() for p in ref[1].parameters()),
        "equal": sorted(built) == sorted(ref.state_dict()) and all(torch.equal(built[k], v) for k, v in ref.state_dict().items()),
    }
    llama = make_model("llama", 1)
    with torch.no_grad():
        for p in llama.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    if rank == 0:
        torch.save(llama.state_dict(), path)
    dist.barrier()
    with torch.device("meta"):
        again = make_model("llama", 1)
    out["read"] = load_pretrained(again, path, policy, torch.device("cpu"))
    shard_module(again, policy)
    loaded = full_state_dict(again)
    out["llama_equal"] = all(torch.equal(loaded[k], v) for k, v in llama.state_dict().items())
    out["rope_equal"] = torch.equal(again.inv_freq, llama.inv_freq)
    errors = []
    for state in ({k: v for k, v in llama.state_dict().items() if "wq" not in k}, {**llama.state_dict(), "norm.weight": torch.ones(3)}):
        dist.barrier()
        if rank == 0:
            torch.save(state, path)
        dist.barrier()
        with torch.device("meta"):
            bad = make_model("llama", 1)
        try:
            load_pretrained(bad, path, policy, torch.device("cpu"))
        except AutoSPError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    return out


def test_meta_model_built_unit_by_unit_and_read_from_a_file(tmp_path):
    """Item 6 without a GPU: a model whose every part has its own initialiser is materialised one
    unit at a time (an embedding, 4 blocks, a norm, a head: 7 units), each sharded before the next,
    so at a block's initialiser at most that block's parameters are whole on a rank (the
    materialised-but-unsharded count, recorded from inside the initialisers); its values are those
    of one device built for real with the same seed. A Llama read from a one-file state dict gets
    every weight and its RoPE table; files that lack a weight or hold another shape are refused
    naming it."""
    from sp_harness import spawn

    for r in spawn(tmp_path, _build_sharded, 2, str(tmp_path / "llama.pt")):
        assert r["units"] == 7 and r["equal"], r
        assert r["materialized"] and max(r["materialized"]) <= r["block"], (r["materialized"], r["block"])
        assert r["largest"] == 4 * r["block"] < r["model_bytes"] / 3
        assert r["llama_equal"] and r["rope_equal"] and r["read"] == len(make_model("llama", 1).state_dict())
        assert "lack 1 parameter(s)" in r["errors"][0] and "layers.0.attention.wq.weight" in r["errors"][0]
        assert "shapes differ: norm.weight: file [3], model [32]" in r["errors"][1]


def test_pretrained_needs_a_model_built_on_meta():
    """``pretrained`` names an attribute built in ``configure_model`` (on meta with fsdp); one
    built for real would keep its values, so it is refused, not ignored; without fsdp, or not a
    dict, it is a ValueError at construction."""
    import lightning as L

    from lightning_autosp import AutoSPError, AutoSPStrategy

    with pytest.raises(ValueError, match=r"pretrained='x'.*dict from a LightningModule attribute.*fsdp=True"):
        AutoSPStrategy(fsdp=True, pretrained="x")
    with pytest.raises(ValueError, match=r"pretrained=\{'model': 'x'\}.*with fsdp=True or 'hybrid'"):
        AutoSPStrategy(pretrained={"model": "x"})
    strategy = AutoSPStrategy(sp_size=1, fsdp=True, pretrained={"model": "unused"})
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, max_steps=1)
    module = LMModule("gpt", layers=1)  # built in __init__, for real
    trainer.strategy._lightning_module = module
    with pytest.raises(AutoSPError, match=r"pretrained=\{'model': \.\.\.\}.*must be a module built on the meta device.*configure_model"):
        trainer.strategy.model_to_device()


def test_duplicate_waits_on_one_gather_become_one():
    """torch >= 2.14 traces a tied parameter (embedding and head) as one all-gather with a wait per
    read; bucketing needs one wait per collective. The later wait's users move to the first;
    collectives with one wait each are left alone (the control)."""
    from autosp.passes.bucketing import merge_duplicate_waits

    c10d = torch.ops._c10d_functional
    g = torch.fx.Graph()
    tied, other = g.placeholder("tied"), g.placeholder("other")
    gathers = [g.call_function(c10d.all_gather_into_tensor.default, (x, 2, "0")) for x in (tied, other)]
    first = g.call_function(c10d.wait_tensor.default, (gathers[0],))
    embed = g.call_function(torch.ops.aten.embedding.default, (first, tied))
    second = g.call_function(c10d.wait_tensor.default, (gathers[0],))
    head = g.call_function(torch.ops.aten.mm.default, (embed, second))
    alone = g.call_function(c10d.wait_tensor.default, (gathers[1],))
    g.output((head, alone))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert merge_duplicate_waits(gm) == 1
    gm.graph.lint()
    assert list(gathers[0].users) == [first] and head.args == (embed, first)
    assert list(gathers[1].users) == [alone] and merge_duplicate_waits(gm) == 0
