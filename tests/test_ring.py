"""The ring level under Ulysses (``sp_layout=(ulysses, ring)``) end to end: losses and gradients
against one device with the naive sharding as the negative control, for explicit and automatic
layouts, models, masks, the default configuration, a launch over simulated nodes, checkpoints
across layouts, and the refusals. The kernel alone: tests/test_ring_attention.py."""

import multiprocessing
from functools import partial

import pytest
import torch
import torch.nn as nn
from mask_models import hf_factory, packed_call
from sp_harness import (
    START_METHOD,
    FnModule,
    LMModule,
    Run,
    TokenData,
    check_against_references,
    compare,
    free_port,
    lm_loss,
    make_model,
    reference,
    run_fit,
)
from test_masks import GridZoo, OneRow, Probe, ZooData, probe_loss, zoo_loss

from autosp.errors import AutoSPError
from autosp.models import GPT, GPTConfig

TOL = 1e-4


def shifted_loss(model, batch):
    return lm_loss(model(batch["input_ids"]), batch["labels"], True)


def gpt_with_heads(heads):
    return partial(_gpt, heads)  # (picklable: ranks started by a fork server receive it)


def _gpt(heads):
    torch.manual_seed(1234)
    return GPT(GPTConfig.tiny(vocab_size=64, n_layers=1, n_heads=heads, dim=8 * heads))


def llama():
    return make_model("llama", 1)


def gpt():
    return make_model("gpt", 1)


#: (model, devices, sp_size, sp_layout, sequence length, expected layout): explicit layouts, and
#: automatic ones where the heads do not divide sp_size (6 heads at sp=4, 3 heads at sp=2)
CASES = {
    "llama-gqa-ulysses2xring2-31": (llama, 4, 4, (2, 2), 31, (2, 2)),
    "gpt-ulysses1xring4-37": (gpt, 4, 4, (1, 4), 37, (1, 4)),
    "auto-6heads-sp4": (gpt_with_heads(6), 4, 4, None, 30, (2, 2)),
    "auto-3heads-sp2": (gpt_with_heads(3), 2, 2, None, 33, (1, 2)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == "auto-3heads-sp2" else pytest.mark.full) for c in CASES])
def test_ring_layouts_match_one_device(tmp_path, case):
    """Lengths not divisible by sp_size or by 2 x ring; a shifted loss, so the label shift crosses
    shard boundaries. Every attention runs in the ring kernel, nothing replicated."""
    factory, devices, sp_size, layout, seq, expected = CASES[case]
    step = shifted_loss
    run = run_fit(tmp_path, FnModule(factory, step, log_loss=False), TokenData(4 * devices, seq), devices, sp_size, sp_layout=layout)
    loss_err, grad_err, naive = check_against_references(run, sp_size, factory, step, TOL)
    print(f"{case}: loss {loss_err:.2e} grad {grad_err:.2e} (naive: grad {naive:.2e})")
    for graph in run.ranks[0]["graphs"]["training_step"]:
        assert graph.layout == expected and graph.ring_attention == graph.attention == 1 and not graph.fallbacks


@pytest.mark.slow
@pytest.mark.full
def test_mask_families_on_a_ring(tmp_path):
    """Four families of the mask zoo at ulysses=2 x ring=2 over 31 tokens - Hugging Face Llama with
    packed documents, Mistral with a sliding window inside them, Qwen2 with padding on either side,
    hand-written document ids with ALiBi (tests/test_masks.py's dp x sp grid; plain causal is in the
    layouts above, all nine families at ring=1 there): every attention in the ring kernel."""
    run = run_fit(tmp_path, FnModule(GridZoo, zoo_loss, log_loss=False), ZooData(8, 31), devices=4, sp_size=4, tiled_attention=8, sp_layout=(2, 2))
    loss_err, grad_err, naive = check_against_references(run, 4, GridZoo, zoo_loss)
    print(f"mask zoo ulysses2 x ring2: loss {loss_err:.2e} grad {grad_err:.2e} (naive: grad {naive:.2e})")
    (graph,) = run.ranks[0]["graphs"]["training_step"]
    assert graph.dense_masks == [] and graph.fallbacks == [] and graph.ring_attention == graph.attention == 4


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, pytest.param(4, marks=pytest.mark.full)], ids=["sp2", "dp2xsp2"])
def test_default_configuration_on_a_ring(tmp_path, devices):
    """What users run (inductor, SAC) with a ring level: a Hugging Face Llama with packed documents,
    ``ulysses=1 x ring=2``, at sp=2 and at dp=2 x sp=2."""
    factory = hf_factory("llama", seed=8)
    run = run_fit(tmp_path, FnModule(factory, packed_call, log_loss=False), ZooData(4 * devices // 2, 29), devices=devices, sp_size=2,
                  backend="inductor", sp_layout=(1, 2))
    loss_err, grad_err, naive = check_against_references(run, 2, factory, packed_call)
    print(f"inductor + SAC, ring=2: loss {loss_err:.2e} grad {grad_err:.2e} (naive: grad {naive:.2e})")
    (graph,) = run.ranks[0]["graphs"]["training_step"]
    assert graph.ring_attention == 1 and graph.layout == (1, 2)


# ------------------------------------------------------------------ documents never leak across ring steps
DOCS = [(0, 6), (6, 26), (26, 31)]  # the middle document spans all four chunks of ring=2: both ring ranks


@pytest.mark.slow
@pytest.mark.full
def test_documents_never_leak_across_ring_steps(tmp_path):
    """ring=2, the middle document spanning both ring ranks (head and tail chunks): the gradient of
    its loss with respect to the other documents' embeddings is exactly 0, and that loss equals one
    device's. Negative control: the model called with its cache (Hugging Face then builds no
    document mask) leaks."""
    from autosp.layout import ring_segment

    (a, b) = DOCS[1]
    owners = {r for r in range(2) for lo, hi in ring_segment(31, 2, r) if lo < b and hi > a}
    assert owners == {0, 1}, "precondition: the middle document spans both ring ranks"
    run = run_fit(tmp_path, FnModule(Probe, probe_loss, log_loss=False), OneRow(DOCS), devices=2, sp_size=2, steps=1, batch_size=1,
                  tiled_attention=8, sp_layout=(1, 2))
    offset = run.ranks[0]["grads"][0]["model.offset"]
    assert offset[:a].abs().max() == 0 and offset[b:].abs().max() == 0
    assert offset[a : b - 1].abs().sum(-1).min() > 0
    torch.manual_seed(0)
    alone = Probe()
    data = OneRow(DOCS)
    want = alone(data.ids[None], data.pos[None], data.labels[None]).item()
    assert abs(run.ranks[0]["losses"][0] - want) <= 1e-5 * abs(want)
    leaky = run_fit(tmp_path, FnModule(lambda: Probe(use_cache=True), probe_loss, log_loss=False), OneRow(DOCS), devices=2, sp_size=2,
                    steps=1, batch_size=1, sp_layout=(1, 2))
    assert leaky.ranks[0]["grads"][0]["model.offset"][:a].abs().max() > 1e-4


# ------------------------------------------------------------------ nodes
def _node_agent(node_rank, nodes, port, out, fsdp):
    """One of ``nodes`` launcher agents on this machine, as on separate nodes (``NODE_RANK``), two
    processes each: sp=4 spans two nodes, dp=2."""
    import os

    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_autosp import AutoSPStrategy
    from sp_harness import Recorder

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(node_rank))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, num_nodes=nodes, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[Recorder(out)],
        strategy=AutoSPStrategy(sp_size=4, compile_backend="aot_eager", start_method="fork", fsdp=fsdp),
    )
    module = LMModule("llama", layers=1, log_loss=False, shift=True)
    trainer.fit(module, DataLoader(TokenData(8, 30), batch_size=2, shuffle=False))


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, pytest.param(True, marks=pytest.mark.full)], ids=["replicated", "sharded"])
def test_sp_groups_across_nodes(tmp_path, fsdp):
    """Four simulated nodes of two processes (four launcher agents with NODE_RANK 0..3), sp_size=4:
    each SP group spans two nodes; the automatic layout keeps Ulysses inside a node (ulysses=2) and
    puts the ring across them (ring=2); dp=2. Losses and gradients equal one device; the naive
    sharding does not."""
    port, nodes = free_port(), 4
    ctx = multiprocessing.get_context(START_METHOD)
    agents = [ctx.Process(target=_node_agent, args=(node, nodes, port, str(tmp_path), fsdp)) for node in range(nodes)]
    for agent in agents:
        agent.start()
    for agent in agents:
        agent.join(timeout=600)
    assert [agent.exitcode for agent in agents] == [0] * nodes
    run = Run([torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2 * nodes)])
    assert [rec["sp_group"] for rec in run.ranks] == [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4
    assert run.ranks[0]["graphs"]["training_step"][0].layout == (2, 2)
    step = shifted_loss
    initial = run.ranks[0]["initial"] if fsdp else None  # what the sharded run started from
    ref_losses, ref_grads = reference("llama", run, 4, layers=1, shift=True, initial=initial)
    loss_err, grad_err = compare(run, 4, ref_losses, ref_grads)
    print(f"4 nodes x 2, sp=4 (ulysses=2 x ring=2), dp=2, fsdp={fsdp}: loss {loss_err:.2e} grad {grad_err:.2e}")
    assert loss_err <= TOL and grad_err <= TOL
    from sp_harness import naive_reference_fn

    naive = compare(run, 4, *naive_reference_fn(llama, step, run, 4, initial=initial))
    assert max(naive) > 100 * TOL


# ------------------------------------------------------------------ checkpoints across layouts
@pytest.mark.slow
@pytest.mark.full
def test_checkpoints_resume_from_ring_to_ulysses_and_back(tmp_path):
    """A run at ulysses=1 x ring=2 and one at ulysses=2 x ring=1 (plain Ulysses) resume from each
    other's checkpoints exactly (tests/test_checkpoints.py's interchange, weights-only control)."""
    from test_checkpoints import EPOCH, LR, _interchange

    def fit(layout):
        module = lambda: LMModule("llama", lr=LR, optimizer="adamw", layers=1, log_loss=False)  # noqa: E731
        return lambda **kw: run_fit(tmp_path, module(), TokenData(8, 32), 2, 2, steps=2 * EPOCH, sp_layout=layout, **kw)

    _interchange(tmp_path, fit((1, 2)), fit((2, 1)), "Ulysses", lambda path: torch.load(path, weights_only=False)["state_dict"])


# ------------------------------------------------------------------ refusals (traced, no process group)
def test_layouts_that_cannot_work_are_refused_with_those_that_would():
    from test_pass import batch, capture

    from autosp.passes import sequence_parallel_pass
    from lightning_autosp import AutoSPStrategy

    def rewrite(sp_size, layout):  # the tiny Llama: 4 query heads
        return sequence_parallel_pass(capture(make_model("llama", 1), *batch(64)), sp_size=sp_size, sp_rank=0, group_name="unused", sp_layout=layout)

    with pytest.raises(AutoSPError, match=r"4 attention heads .* not divisible by sp_size=8.*valid sp_size values for this model: "
                       r"\[1, 2, 4\], or a layout with a ring level: sp_layout=\[\(4, 2\), \(2, 4\), \(1, 8\)\]"):
        rewrite(8, (8, 1))
    with pytest.raises(AutoSPError, match=r"4 attention heads .* not divisible by the Ulysses degree 8 of sp_layout=\(8, 2\)"
                       r".*sp_layout=\[\(4, 4\), \(2, 8\), \(1, 16\)\]"):
        rewrite(16, (8, 2))
    assert rewrite(8, None).meta["autosp"].layout == (4, 2)  # the automatic layout takes what divides
    with pytest.raises(ValueError, match=r"sp_layout=\(3, 2\)\): ulysses x ring = 6, not sp_size=4"):
        AutoSPStrategy(sp_size=4, sp_layout=(3, 2))
    with pytest.raises(ValueError, match=r"sp_layout must be \(ulysses, ring\)"):
        AutoSPStrategy(sp_layout=(2,))
    with pytest.raises(ValueError, match=r"tiled_attention=False\): a ring level"):
        AutoSPStrategy(sp_layout=(1, 2), tiled_attention=False)


class DenseMaskLM(nn.Module):
    """Attention whose mask is a buffer (data, not a function of positions)."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.register_buffer("mask", torch.rand(64, 64) > 0.5)

    def forward(self, ids):
        x = self.emb(ids)
        B, S, _ = x.shape
        q = x.view(B, S, 4, 8).transpose(1, 2)
        out = nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=self.mask[:S, :S])
        return self.out(out.transpose(1, 2).reshape(B, S, 32))


def test_a_mask_that_is_data_is_refused_on_a_ring():
    from test_pass import batch, capture

    from autosp.passes import sequence_parallel_pass

    with pytest.raises(AutoSPError, match=r"(?s)runs as a ring over the sequence, which needs its mask as a function of positions.*sp_layout=\(2, 1\)"):
        sequence_parallel_pass(capture(DenseMaskLM(), *batch()), sp_size=2, sp_rank=0, group_name="unused", sp_layout=(1, 2))
    # the same model keeps its dense mask under Ulysses alone (reported, not refused)
    out = sequence_parallel_pass(capture(DenseMaskLM(), *batch()), sp_size=2, sp_rank=0, group_name="unused", sp_layout=(2, 1))
    assert out.meta["autosp"].dense_masks
