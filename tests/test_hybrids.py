"""Hybrid models: sequence mixers next to attention.

* Short causal convolutions (LFM2's, the one in front of every Mamba scan) run on each rank's
  shard with a halo of ``kernel - 1`` positions from the previous rank
  (:mod:`autosp.passes.sp_rules.convolution`): LFM2 runs with ``strict=True``, nothing replicated.
* Mamba-2's chunked scan, Mamba-1's selective scan and Qwen3-Next's gated delta rule run as one
  node of the graph on the rank's heads over the whole sequence, between all-to-alls
  (:mod:`autosp.passes.sp_rules.mixers`): Bamba, Falcon-H1, Mamba-2 alone, Jamba and Qwen3-Next
  run with ``strict=True``. A mixer of one's own takes one ``register_mixer`` call.
* A scan traced inline (not registered) runs replicated where the pass has no rule; the pass
  follows a sequence padded to a multiple of the scan's chunk and cut back, where Dynamo's guards
  prove the padding 0 (it stopped with an internal error there)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from sp_harness import START_METHOD, VOCAB, FnModule, TokenData, check_against_references, compare, reference_fn, rel_err, run_fit, trace_rank

import autosp
import autosp.passes.placement as placement
import autosp.passes.sac as sac
from autosp.passes.sp_rules import convolution, mixers


def hybrid(family: str):
    """A tiny Hugging Face hybrid: LFM2 (a short convolution layer, an attention layer), Bamba (a
    Mamba-2 layer, an attention layer), Nemotron-H (Mamba-2, MLP, attention, MLP layers), Mamba-2
    alone, Jamba (a Mamba-1 layer, an attention layer with a mixture of experts), Qwen3-Next (a
    gated delta rule layer, a gated attention layer, both with a mixture of experts) or Kimi Linear
    (Kimi's delta attention, MLA attention, a mixture of experts)."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa")
    if family == "lfm2":
        cls, config = transformers.Lfm2ForCausalLM, transformers.Lfm2Config(
            **common, layer_types=["conv", "full_attention"], conv_L_cache=3,
        )
    elif family == "qwen3_next":
        cls, config = transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig(
            **common, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"], num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        )
    elif family == "mamba2":
        cls, config = transformers.Mamba2ForCausalLM, transformers.Mamba2Config(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=1,
            chunk_size=16, expand=2, conv_kernel=4,
        )
    elif family == "jamba":
        cls, config = transformers.JambaForCausalLM, transformers.JambaConfig(
            **common, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
            num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False,
        )
    elif family == "nemotron_h":
        cls, config = transformers.NemotronHForCausalLM, transformers.NemotronHConfig(
            **{k: v for k, v in common.items() if k != "num_hidden_layers"}, head_dim=8, ssm_state_size=8, mamba_num_heads=4,
            mamba_head_dim=16, n_groups=2, conv_kernel=4, expand=2, chunk_size=16, use_mamba_kernels=False,
            layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
        )
    elif family == "kimi_linear":
        cls, config = transformers.KimiLinearForCausalLM, transformers.KimiLinearConfig(
            **{**common, "num_key_value_heads": 4}, moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, num_experts_per_tok=2, num_local_experts=4, n_group=1,
            topk_group=1, linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"], pad_token_id=0,
            bos_token_id=1, eos_token_id=2,
        )
    else:
        cls, config = transformers.BambaForCausalLM, transformers.BambaConfig(
            **common, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16, mamba_expand=2,
            mamba_d_conv=4, attn_layer_indices=[1],
        )

    def build():
        torch.manual_seed(3)
        return cls(config)

    return build


def hf_loss(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss


class Tokens(TokenData):
    """Hugging Face batches: the labels are the ids (the model shifts them)."""

    def __init__(self, n, seq_len):
        super().__init__(n, seq_len, ignore="none")
        self.y = self.x.clone()


def _step(model):
    return lambda ids, labels: model(input_ids=ids, labels=labels, use_cache=False).loss


def test_a_length_the_guards_prove_equal_to_the_sequence_is_followed(monkeypatch):
    """Bamba at 64 tokens, traced as rank 0 of sp=2: Mamba-2 pads the sequence to a multiple of its
    chunk (16) and cuts it back only when the padding is not 0, so at 64 the scan's output is as
    long as ``s + Mod(16 - Mod(s, 16), 16)``, which Dynamo's guards make ``s``: the pass reads it as
    the sequence; its convolution runs on the rank's shard, and the scan - traced inline here, not
    registered as a mixer (this process registers Bamba's only in a later test) - runs replicated
    where the pass has no rule, reported. The control: without the guards' proof the pass stops on
    that size with an internal error."""
    model = hybrid("bamba")()
    ids = torch.randint(0, VOCAB, (2, 64))
    found = trace_rank(_step(model), [ids, ids.clone()])
    assert found["stats"].sequence_mixers == 0 and found["stats"].fallbacks
    assert not any("tensor_split" in f for f in found["stats"].fallbacks)  # the split off of no positions is placed
    assert found["stats"].sdpa == 1 and found["stats"].halo_convolutions == 1
    torch._dynamo.reset()
    monkeypatch.setattr(placement, "_proved_symbol", lambda d, expr, sym: expr)
    with pytest.raises(Exception, match=r"internal: .* is not outer \* s\d+ \* 1"):
        trace_rank(_step(model), [ids, ids.clone()])


#: per family: the mixers placed over heads, attention calls and halo convolutions of its step
_SPLIT = {"nemotron_h": (1, 1, 1), "mamba2": (2, 0, 2), "jamba": (1, 1, 1), "kimi_linear": (1, 1, 1)}


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("family,seq", [("nemotron_h", 64), ("mamba2", 61), ("jamba", 61), ("kimi_linear", 61)])
def test_hybrids_equal_one_device_with_every_mixer_split(tmp_path, family, seq):
    """Nemotron-H at 64 tokens (a multiple of its scan's chunk; two groups of B/C, one per rank),
    Mamba-2 alone (no attention), Jamba (Mamba-1, a mixture of experts) and Kimi Linear (Kimi's
    delta attention beside MLA attention) at 61, sp=2, ``strict=True`` (nothing may run
    replicated): loss and gradients equal one device, the naive sharding does not. Every scan runs
    on the rank's heads (Mamba-1: channels) over the whole sequence, between all-to-alls; the
    convolutions in front of them take a halo. (Bamba: the tests below and the default tier's
    Qwen3-Next.)"""
    factory = hybrid(family)
    run = run_fit(tmp_path, FnModule(factory, hf_loss, log_loss=False), Tokens(4, seq), devices=2, sp_size=2, steps=2, strict=True)
    loss_err, grad_err, naive = check_against_references(run, 2, factory, hf_loss)
    print(f"{family} {seq} tokens sp2 strict: loss {loss_err:.2e} grad {grad_err:.2e} (naive: grad {naive:.2e})")
    graphs = run.ranks[0]["graphs"]["training_step"]
    found = tuple(sum(getattr(g, k) for g in graphs) for k in ("sequence_mixers", "sdpa", "halo_convolutions"))
    assert found == _SPLIT[family] and not any(g.fallbacks for g in graphs)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("devices,sp_size", [(4, 2), (4, 4)], ids=["dp2xsp2-left-padding", "sp4"])
def test_bamba_at_dp2_x_sp2_with_padding_and_at_sp4(tmp_path, devices, sp_size):
    """Bamba at 61 tokens, ``strict=True``: two SP groups of 2 (each its own batches) with left
    padding (2 to 5 positions a row: Hugging Face zeroes them before each scan and convolution,
    ``apply_mask_to_padding_states``, and masks them in attention), and one group of 4 (a rank's
    15 or 16 tokens, its scan's 4 heads one per rank): equal to one device."""
    from test_any_model import PaddedData
    from test_any_model import hf_loss as padded_loss

    factory = hybrid("bamba")
    data, loss = (PaddedData(8, 61, "left"), padded_loss) if sp_size == 2 else (Tokens(8, 61), hf_loss)
    run = run_fit(tmp_path, FnModule(factory, loss, log_loss=False), data, devices=devices, sp_size=sp_size, steps=2, strict=True)
    loss_err, grad_err, naive = check_against_references(run, sp_size, factory, loss)
    print(f"bamba 61 tokens devices={devices} sp={sp_size} strict: loss {loss_err:.2e} grad {grad_err:.2e} (naive: grad {naive:.2e})")
    assert sum(g.sequence_mixers for g in run.ranks[0]["graphs"]["training_step"]) == 1


@pytest.mark.slow
@pytest.mark.full
def test_a_hybrid_with_sharded_parameters_and_padding(tmp_path):
    """Qwen3-Next at 61 tokens with left padding, sp=2, ``fsdp=True``, ``strict=True``: parameters,
    gradients and optimizer state sharded, the gated delta rule on the rank's heads (its inputs'
    padded positions zeroed as on one device): equal to one device."""
    from test_any_model import PaddedData
    from test_any_model import hf_loss as padded_loss

    factory = hybrid("qwen3_next")
    tol = max(1e-4, 10 * rounding_floor(factory, 61))
    run = run_fit(tmp_path, FnModule(factory, padded_loss, log_loss=False), PaddedData(4, 61, "left"), devices=2, sp_size=2, steps=2,
                  strict=True, fsdp=True)
    loss_err, grad_err, naive = check_against_references(run, 2, factory, padded_loss, tol=tol)
    print(f"qwen3_next 61 tokens left padding sp2 fsdp strict: loss {loss_err:.2e} grad {grad_err:.2e} (bound {tol:.1e}; naive: grad {naive:.2e})")
    assert sum(g.sequence_mixers for g in run.ranks[0]["graphs"]["training_step"]) == 1


@pytest.mark.slow
@pytest.mark.full
def test_sac_saves_fewer_bytes_of_a_hybrid():
    """Bamba at 512 tokens, rank 0 of sp=2 (traced): SAC saves fewer bytes for backward than the
    partition without it, with the scan on the rank's heads."""
    model = hybrid("bamba")()
    mixers.register_hf_mixers(model)
    ids = torch.randint(0, VOCAB, (2, 512))
    saved = {}
    for sac_on in (True, False):
        torch._dynamo.reset()
        found = trace_rank(_step(model), [ids, ids.clone()], sac=sac_on)
        assert found["stats"].sequence_mixers == 1 and not found["stats"].fallbacks
        saved[sac_on] = found["saved"]
    print(f"bamba 512 tokens sp2, saved per rank: SAC {saved[True] / 2**20:.2f} MiB, without {saved[False] / 2**20:.2f} MiB")
    assert saved[True] < 0.9 * saved[False]


# ------------------------------------------------------------------ a mixer of one's own
def decay_scan(x, decay):
    """A per-head linear recurrence ``h[t] = decay * h[t-1] + x[t]`` written without a loop:
    ``x`` is ``[B, S, H, D]``, ``decay`` ``[H]`` in (0, 1)."""
    t = torch.arange(x.shape[1], dtype=x.dtype)
    lag = t[:, None] - t[None, :]  # [S, S]: how far back position u lies from t
    weights = torch.exp(lag[..., None] * torch.log(decay)).masked_fill((lag < 0)[..., None], 0.0)  # [S, S, H]
    return torch.einsum("tuh,buhd->bthd", weights, x)


autosp.register_mixer(decay_scan, inputs={"x": autosp.Heads(seq=1, head=2), "decay": autosp.PerHead(0)}, outputs=autosp.Heads(seq=1, head=2))


class ScanLM(nn.Module):
    """Embedding, a projection to 4 heads of 8, :func:`decay_scan` with a learned decay per head, an
    output projection, the vocabulary: no attention."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.proj = nn.Linear(32, 32)
        self.decay = nn.Parameter(torch.linspace(-1.0, 2.0, 4))
        self.out = nn.Linear(32, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        h = decay_scan(self.proj(x).unflatten(-1, (4, 8)), torch.sigmoid(self.decay))
        return self.head(x + self.out(h.flatten(2)))


def scan_lm():
    torch.manual_seed(7)
    return ScanLM()


@pytest.mark.slow
@pytest.mark.skipif(START_METHOD != "fork", reason="the wrong heads are patched in this process: only forked ranks see it")
@pytest.mark.parametrize("backend", ["inductor", pytest.param("aot_eager", marks=pytest.mark.full)])
def test_a_registered_mixer_runs_on_the_ranks_heads_and_the_wrong_heads_are_caught(tmp_path, monkeypatch, backend):
    """:class:`ScanLM` at 37 tokens, sp=2, ``strict=True``, also in the default configuration
    (Inductor, SAC): :func:`decay_scan`, registered with one ``register_mixer`` call, equals one
    device on loss and gradients (its decay parameter's too). The control: every rank reading the
    first heads' decays is caught."""
    run = run_fit(tmp_path, FnModule(scan_lm, conv_loss, log_loss=False), Tokens(4, 37), devices=2, sp_size=2, steps=2, strict=True,
                  backend=backend)
    loss_err, grad_err, naive = check_against_references(run, 2, scan_lm, conv_loss)
    print(f"ScanLM 37 tokens sp2 strict: loss {loss_err:.2e} grad {grad_err:.2e} (naive: grad {naive:.2e})")
    (graph,) = run.ranks[0]["graphs"]["training_step"]
    assert graph.sequence_mixers == 1 and graph.mixer_all_to_alls == 2 and not graph.fallbacks
    real = mixers._block
    monkeypatch.setattr(mixers, "_block", lambda rw, node, spec, what, count: (0, real(rw, node, spec, what, count)[1]))
    broken = run_fit(tmp_path, FnModule(scan_lm, conv_loss, log_loss=False), Tokens(4, 37), devices=2, sp_size=2, steps=2)
    broken_err = max(compare(broken, 2, *reference_fn(scan_lm, conv_loss, broken, 2)))
    print(f"with the first heads' decays on every rank: {broken_err:.2e}")
    assert broken_err > 1e-2


def test_a_mixer_the_pass_cannot_place_is_refused_naming_it():
    """Three heads over sp=2, one head (nothing to split), and a recurrent state passed in: refused
    before training, naming the mixer, the argument and the user's line; registering a function
    with a parameter it lacks is refused at the call."""
    def three_heads(ids):
        x = torch.nn.functional.one_hot(ids, 12).float().unflatten(-1, (3, 4))
        return decay_scan(x, torch.full((3,), 0.5)).sum()

    def one_head(ids):
        return decay_scan(torch.nn.functional.one_hot(ids, 4).float().unsqueeze(2), torch.full((1,), 0.5)).sum()

    ids = torch.randint(0, VOCAB, (2, 16))
    with pytest.raises(Exception, match=r"(?s)AutoSPError: .*sequence mixer decay_scan: x has 3 heads.*not divisible by sp_size=2.*test_hybrids.py"):
        trace_rank(lambda ids, labels: three_heads(ids), [ids, ids.clone()])
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"(?s)AutoSPError: .*sequence mixer decay_scan: its output 0 \[2, s\d+, 1, 4\] has one head"):
        trace_rank(lambda ids, labels: one_head(ids), [ids, ids.clone()])
    torch._dynamo.reset()

    def stateful(x, state=None):
        return x.cumsum(1) + (0 if state is None else state)

    autosp.register_mixer(stateful, inputs={"x": autosp.Heads(1, 2)}, outputs=autosp.Heads(1, 2), require={"state": None})

    def step(ids, labels):
        x = torch.nn.functional.one_hot(ids, 8).float().unflatten(-1, (2, 4))
        return stateful(x, state=torch.ones(2, 4)).sum()

    with pytest.raises(Exception, match=r"(?s)AutoSPError: .*sequence mixer stateful: state=a tensor; AutoSP accepts only state=None"):
        trace_rank(step, [ids, ids.clone()])
    with pytest.raises(TypeError, match=r"has no parameter\(s\) \['h'\]"):
        autosp.register_mixer(stateful, inputs={"h": autosp.Heads(1, 2)}, outputs=autosp.Heads(1, 2))


# ------------------------------------------------------------------ short convolutions, with a halo
class ConvLM(nn.Module):
    """Two causal convolutions written as Hugging Face writes them, ``conv(x)[..., :seq_len]``:
    one grouped and dilated with a bias (it reads 4 positions back), one depthwise (3 back), then
    causal attention."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.dilated = nn.Conv1d(16, 16, 3, padding=4, dilation=2, groups=2)
        self.depthwise = nn.Conv1d(16, 16, 4, padding=3, groups=16, bias=False)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        n = ids.shape[1]
        h = F.silu(self.dilated(x.transpose(1, 2))[..., :n])
        h = self.depthwise(h)[:, :, :n]
        x = x + h.transpose(1, 2)
        q = x.view(x.shape[0], n, 2, 8).transpose(1, 2)
        x = x + F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).flatten(2)
        return self.head(x)


def conv_lm():
    torch.manual_seed(5)
    return ConvLM()


def conv_loss(model, batch):
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten())


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_lfm2_runs_its_convolutions_on_each_ranks_shard(tmp_path, backend):
    """LFM2 at 61 tokens, sp=2, ``strict=True`` (nothing may run replicated), also in the default
    configuration (Inductor, SAC): loss and gradients equal one device, the naive sharding does
    not; its convolution takes a halo of 2 positions."""
    factory = hybrid("lfm2")
    run = run_fit(tmp_path, FnModule(factory, hf_loss, log_loss=False), Tokens(4, 61), devices=2, sp_size=2, steps=2, strict=True,
                  backend=backend)
    loss_err, grad_err, naive = check_against_references(run, 2, factory, hf_loss)
    print(f"lfm2 61 tokens sp2 strict: loss {loss_err:.2e} grad {grad_err:.2e} (naive: grad {naive:.2e})")
    (graph,) = run.ranks[0]["graphs"]["training_step"]
    assert graph.halo_convolutions == 1 and graph.sdpa == 1 and not graph.fallbacks


@pytest.mark.slow
@pytest.mark.skipif(START_METHOD != "fork", reason="the broken halo is patched in this process: only forked ranks see it")
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.full)])
def test_convolutions_with_dilation_groups_and_bias_and_a_missing_halo_is_caught(tmp_path, monkeypatch, backend):
    """:class:`ConvLM` at 37 tokens, sp=2, ``strict=True``, also in the default configuration
    (Inductor, SAC): equal to one device. The control: the same rewrite with the halo replaced by
    zeros (the first rank's padding everywhere) is caught."""
    run = run_fit(tmp_path, FnModule(conv_lm, conv_loss, log_loss=False), Tokens(4, 37), devices=2, sp_size=2, steps=2, strict=True,
                  backend=backend)
    loss_err, grad_err, naive = check_against_references(run, 2, conv_lm, conv_loss)
    print(f"ConvLM 37 tokens sp2: loss {loss_err:.2e} grad {grad_err:.2e} (naive: grad {naive:.2e})")
    (graph,) = run.ranks[0]["graphs"]["training_step"]
    assert graph.halo_convolutions == 2 and not graph.fallbacks
    monkeypatch.setattr(convolution, "SEQ_PASS", lambda tail, *args: torch.zeros_like(tail))
    broken = run_fit(tmp_path, FnModule(conv_lm, conv_loss, log_loss=False), Tokens(4, 37), devices=2, sp_size=2, steps=2)
    broken_err = max(compare(broken, 2, *reference_fn(conv_lm, conv_loss, broken, 2)))
    print(f"without the halo: {broken_err:.2e}")
    assert broken_err > 1e-2


@pytest.mark.slow
@pytest.mark.full
def test_a_rank_saves_about_half_at_sp2_once_every_mixer_is_split():
    """Bytes saved for backward by rank 0 at 512 tokens, sp=2 against sp=1 (the pass, traced): LFM2
    and Bamba, every mixer split (Bamba's Mamba-2 scans registered as the strategy registers them),
    save at most 0.6 of them. The control: Bamba with its scans' placement taken away (they run
    replicated) saves more than that."""
    ratios = {}
    for family in ("lfm2", "bamba", "bamba replicated"):
        model = hybrid(family.split()[0])()
        mixers.register_hf_mixers(model)
        ids = torch.randint(0, VOCAB, (2, 512))
        saved = {}
        for sp_size in (1, 2):
            torch._dynamo.reset()
            with pytest.MonkeyPatch.context() as patch:
                if family.endswith("replicated"):
                    patch.setattr(mixers, "_SPECS", {})
                saved[sp_size] = trace_rank(_step(model), [ids, ids.clone()], sp_size=sp_size)["saved"]
        ratios[family] = saved[2] / saved[1]
    print(f"saved per rank, sp2 / sp1 at 512 tokens: {ratios}")
    assert max(ratios["lfm2"], ratios["bamba"]) <= 0.6 < ratios["bamba replicated"]


@pytest.mark.slow
@pytest.mark.full
def test_the_halo_bytes_do_not_grow_with_the_length():
    """``benchmarks/hybrid_bytes.py`` at 256 and 1024 tokens: each convolution sends ``B x channels
    x (kernel-1)`` fp32 values forward (rank 0) and their gradient back (rank 1), the same at both
    lengths, while the all-to-alls - around LFM2's attention, around Mamba-2's scans - grow 4x;
    the losses equal one device."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import hybrid_bytes

    res = hybrid_bytes.main(["--seq-lens", "256", "1024", "--hidden", "64"])
    channels = {"lfm2": 64, "mamba2": 2 * 64 + 2 * 16}  # Mamba-2 convolves x, B and C: 2*hidden + 2 * n_groups * state
    for family, f in res["families"].items():
        short, long = f["lengths"][256], f["lengths"][1024]
        assert short["halo"] == long["halo"] == 2 * 1 * channels[family] * 2 * 4, family  # two convolutions, batch 1, kernel 3
        assert long["exchange"] == 4 * short["exchange"], family
        for r in (short, long):
            assert abs(r["loss"] - r["reference"]) <= 1e-5 * abs(r["reference"])
    assert [res["families"]["mamba2"]["lengths"][256][k] for k in ("attention", "mixers")] == [0, 2]


# ------------------------------------------------------------------ Qwen3-Next: a gated delta rule
def rounding_floor(factory, seq: int) -> float:
    """How far one device's gradients move when every parameter moves by a relative 1e-7 (fp32's
    rounding, which a split computation's other summation order adds too), at the largest
    relative error over the parameters: the floor of the model's worst conditioned gradient."""
    model = factory()
    ids = Tokens(2, seq).x

    def grads():
        model.zero_grad()
        _step(model)(ids, ids).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    exact = grads()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 1e-7 * torch.randn(p.shape, generator=g))
    moved = grads()
    return max(rel_err(moved[n], exact[n]) for n in exact)


@pytest.mark.slow
@pytest.mark.parametrize("seq", [61, pytest.param(64, marks=pytest.mark.full)])
def test_qwen3_next_equals_one_device_with_its_gated_delta_rule_split(tmp_path, seq):
    """Qwen3-Next at 61 tokens and at 64 (a multiple of the gated delta rule's chunk: its pad is 0
    there, see ``contiguous_before_variable_pads``), sp=2, ``strict=True``: loss and gradients equal
    one device, the naive sharding does not. Attention and the convolution are split, the delta rule
    runs on the rank's value heads (its two key heads split with them) over the whole sequence. The gradients of ``A_log`` and ``dt_bias`` are sums with heavy cancellation: moving
    every parameter by fp32's rounding on one device moves them far more than 1e-7
    (:func:`rounding_floor`), so the bound is 10x that floor, measured here, where it exceeds 1e-4."""
    factory = hybrid("qwen3_next")
    tol = max(1e-4, 10 * rounding_floor(factory, seq))
    run = run_fit(tmp_path, FnModule(factory, hf_loss, log_loss=False), Tokens(4, seq), devices=2, sp_size=2, steps=2, strict=True)
    loss_err, grad_err, naive = check_against_references(run, 2, factory, hf_loss, tol=tol)
    print(f"qwen3_next {seq} tokens sp2 strict: loss {loss_err:.2e} grad {grad_err:.2e} (bound {tol:.1e}; naive: grad {naive:.2e})")
    graphs = run.ranks[0]["graphs"]["training_step"]
    assert [sum(getattr(g, k) for g in graphs) for k in ("sdpa", "halo_convolutions", "sequence_mixers")] == [1, 1, 1]
    assert sum(g.mixer_all_to_alls for g in graphs) == 6  # q, k, v, g, beta in, the output back


@pytest.mark.slow
@pytest.mark.full
def test_without_a_contiguous_input_a_pad_of_zero_breaks_the_step(tmp_path, monkeypatch):
    """The control of the test above at 64 tokens: without AutoSP's contiguous input to the pads by
    a size of the batch, torch's own step fails inside the compiled graph (a ``view`` traced on a
    contiguous pad result meets the strided clone torch returns for a pad of 0)."""
    monkeypatch.setattr(sac, "contiguous_before_variable_pads", lambda joint: 0)
    with pytest.raises(Exception, match="view size is not compatible"):
        run_fit(tmp_path, FnModule(hybrid("qwen3_next"), hf_loss, log_loss=False), Tokens(4, 64), devices=2, sp_size=2, steps=1)
