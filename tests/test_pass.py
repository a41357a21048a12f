"""The SP pass on captured Dynamo graphs: what it inserts, what it refuses, and what it leaves."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sp_harness import VOCAB, lm_loss, make_model, spawn
from torch._dynamo.backends.common import aot_autograd

from lightning_autosp import AutoSPError
from autosp.backend import AutoSPBackend
from autosp.models import Llama, LlamaConfig
from autosp.passes import sequence_parallel_pass
from autosp.passes.rewrite import SPRewrite
from autosp.passes.sequence_parallel import SDPA, SEQ_GATHER, SEQ_SCATTER, _run, find_sequence_symbol
from autosp.passes.sp_rules.attention import exchanged_source

A2A = (SEQ_GATHER, SEQ_SCATTER)


def capture(model, x, y, shift=False, dynamic=True, step=None):
    """The Dynamo graph of a training-step-like function (no process group needed); ``step(model,
    x, y) -> loss`` replaces the default ``lm_loss(model(x), y, shift)``."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    if dynamic:
        torch._dynamo.mark_dynamic(x, 1)
        torch._dynamo.mark_dynamic(y, 1)
    step = step or (lambda m, a, b: lm_loss(m(a), b, shift))
    torch.compile(lambda a, b: step(model, a, b), backend=backend)(x, y)
    assert len(graphs) == 1
    return graphs[0]


def batch(S=16):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (2, S), generator=g), torch.randint(0, VOCAB, (2, S), generator=g)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("shift", [False, True])
def test_pass_rewrites_every_attention(kind, shift):
    gm = capture(make_model(kind), *batch(), shift=shift)
    out = sequence_parallel_pass(gm, sp_size=2, sp_rank=1, group_name="unused", seq_dim=1)
    stats = out.meta["autosp"]
    nodes = list(out.graph.nodes)
    sdpa = [n for n in nodes if n.target is SDPA]
    assert stats.sdpa == len(sdpa) == 2
    assert sum(n.target in A2A for n in nodes) == 4 * len(sdpa)
    for n in sdpa:
        # attention reads q, k, v through a transposed view of a seq_gather and its output
        # reaches a seq_scatter the same way
        assert all(a.target is torch.transpose and a.args[0].target is SEQ_GATHER for a in map(exchanged_source, n.args[:3]))
        assert n.users and all(u.target is torch.transpose and [v.target for v in u.users] == [SEQ_SCATTER] for u in n.users)
    assert stats.fallbacks == []
    assert stats.max_shift == (1 if shift else 0)
    # the tiny Llama repeats its 2 KV heads for 4 query heads (repeat_kv): k and v are exchanged
    # before the repeat (2 KV heads divide by sp_size=2); the GPT has as many KV heads as query heads
    assert stats.kv_exchanged_unrepeated == (2 * len(sdpa) if kind == "llama" else 0)
    # on CPU attention reads them unrepeated: enable_gqa, 1 KV head per rank for 2 query heads
    assert stats.native_gqa == (len(sdpa) if kind == "llama" else 0)
    assert all(n.kwargs.get("enable_gqa", False) == (kind == "llama") for n in sdpa)


@pytest.mark.parametrize("inputs,targets,offset", [(slice(None, -1), slice(1, None), -1), (slice(1, -1), slice(2, None), -2)])
def test_batch_sliced_before_the_model_is_the_sequence(inputs, targets, offset):
    """``model(tokens[:, :-1])`` against ``tokens[:, 1:]`` (LitGPT's and nanoGPT's pretraining
    loops): attention runs over ``S - 1`` positions, which the pass splits like the batch."""
    step = lambda m, a, b: F.cross_entropy(m(a[:, inputs]).flatten(0, 1), a[:, targets].reshape(-1))  # noqa: E731
    gm = capture(make_model("llama"), *batch(), step=step)
    out = sequence_parallel_pass(gm, sp_size=2, sp_rank=1, group_name="unused")
    stats = out.meta["autosp"]
    assert (stats.sdpa, stats.all_to_all, stats.seq_offset, stats.fallbacks) == (2, 8, offset, [])
    # negative control: the same graph read as a sequence of the batch's own length has no
    # attention input with a sequence dim
    rw = SPRewrite(gm, 2, 1, "unused", find_sequence_symbol(gm, 1), seq_offset=0)
    with pytest.raises(AutoSPError, match=r"with no sequence dim at dim 2"):
        _run(rw)


def test_attention_over_a_fixed_length_is_an_error():
    """A slice up to a fixed position (``tokens[:, :8]``) leaves attention a length that is not
    the batch's: the error names the query and says how to slice instead."""
    step = lambda m, a, b: F.cross_entropy(m(a[:, :8]).flatten(0, 1), b[:, :8].reshape(-1))  # noqa: E731
    gm = capture(make_model("gpt"), *batch(), step=step)
    with pytest.raises(AutoSPError, match=r"(?s)attention runs over 8 positions.*a fixed number.*`tokens\[:, :-1\]`"):
        sequence_parallel_pass(gm, sp_size=2, sp_rank=0, group_name="unused")


@pytest.mark.parametrize("pattern", ["manual_softcap", "manual_bias"])
def test_hand_written_attention_is_rewritten(pattern):
    """``softmax(q @ k^T ..) @ v`` by hand (soft-capping, masks, a per-head bias, dtype
    conversions): the same four all-to-alls as SDPA; the per-head bias narrowed to the rank's heads."""
    from test_patterns import PatternLM

    step = lambda m, a, b: F.cross_entropy(m(a).flatten(0, 1), b.reshape(-1))  # noqa: E731
    out = sequence_parallel_pass(capture(PatternLM(pattern), *batch(), step=step), sp_size=2, sp_rank=1, group_name="unused")
    stats = out.meta["autosp"]
    assert (stats.manual_attention, stats.sdpa, stats.all_to_all, stats.fallbacks) == (2, 0, 8, [])
    narrowed = [n for n in out.graph.nodes if n.target is torch.narrow]
    assert len(narrowed) == (2 if pattern == "manual_bias" else 0)
    assert all(n.args[2:] == (2, 2) for n in narrowed)  # rank 1 of 2: heads 2 and 3 of 4


def test_hand_written_attention_with_an_unknown_step_runs_replicated():
    """Negative control of the matcher: a step it does not know between the two matmuls (the
    scores read twice) leaves the chain alone - the attention runs whole, reported as a fallback."""
    from test_patterns import PatternLM

    step = lambda m, a, b: F.cross_entropy(m(a).flatten(0, 1), b.reshape(-1))  # noqa: E731
    out = sequence_parallel_pass(capture(PatternLM("manual_stable"), *batch(), step=step), sp_size=2, sp_rank=1, group_name="unused")
    stats = out.meta["autosp"]
    assert (stats.manual_attention, stats.all_to_all) == (0, 0)
    assert any("matmul" in f for f in stats.fallbacks)


def test_heads_not_divisible_go_to_a_ring_or_are_an_error():
    """4 heads at sp_size=3: a ring of 3 by default; refused when the layout asks Ulysses for all 3."""
    out = sequence_parallel_pass(capture(make_model("gpt"), *batch(18)), sp_size=3, sp_rank=0, group_name="unused")
    assert out.meta["autosp"].layout == (1, 3) and out.meta["autosp"].ring_attention == 2
    gm = capture(make_model("gpt"), *batch(18))
    with pytest.raises(AutoSPError, match=r"4 attention heads.*not divisible by sp_size=3"):
        sequence_parallel_pass(gm, sp_size=3, sp_rank=0, group_name="unused", sp_layout=(3, 1))


@pytest.mark.parametrize("seq_len,fits", [(8, False), (12, True)])
def test_first_batch_too_short_for_the_shift_is_an_error(seq_len, fits):
    """The shift (``logits[:, :-1]``) is only known once the pass has seen the graph: the pass
    checks the batch it compiles for (8 tokens over 4 ranks leave the last rank 2, 1 after the
    shift: fewer than 2)."""
    gm = capture(make_model("gpt"), *batch(seq_len), shift=True)
    if fits:  # negative control: 12 tokens leave it 3, 2 after the shift
        assert sequence_parallel_pass(gm, sp_size=4, sp_rank=0, group_name="unused").meta["autosp"].max_shift == 1
        return
    with pytest.raises(AutoSPError, match=r"sequence of 8 tokens split over sp_size=4 ranks leaves the last rank 2 token"):
        sequence_parallel_pass(gm, sp_size=4, sp_rank=0, group_name="unused")


def test_attention_without_dynamic_sequence_is_an_error():
    gm = capture(make_model("gpt"), *batch(), dynamic=False)
    with pytest.raises(AutoSPError, match="no input with a symbolic sequence length"):
        sequence_parallel_pass(gm, sp_size=2, sp_rank=0, group_name="unused")


def test_graph_without_sequence_is_left_alone():
    def backend(gm, example_inputs):
        backend.gm = gm
        return gm.forward

    w = torch.randn(4, 4, requires_grad=True)
    torch.compile(lambda a: (a @ w).sum(), backend=backend)(torch.randn(3, 4))
    assert sequence_parallel_pass(backend.gm, sp_size=2, sp_rank=0, group_name="unused") is backend.gm


def test_unknown_op_on_shards_runs_replicated():
    """An op without a rule gets its inputs all-gathered (correct, reported), never sharded silently."""
    model = make_model("gpt")

    def step(a, b):
        logits = model(a)
        return torch.flip(logits, dims=[1]).float().mean()

    graphs = []
    x, _ = batch()
    torch._dynamo.mark_dynamic(x, 1)
    torch.compile(step, backend=lambda gm, ex: graphs.append(gm) or gm.forward)(x, None)
    out = sequence_parallel_pass(graphs[0], sp_size=2, sp_rank=0, group_name="unused")
    assert any("flip" in f for f in out.meta["autosp"].fallbacks)


# ------------------------------------------------------------ all-to-alls in AOT fw/bw graphs
_COUNTS: dict = {}


def _counter(tag):
    def compiler(gm, example_inputs):
        _COUNTS[tag] = sum(n.target in A2A for n in gm.graph.nodes)
        return gm.forward if not hasattr(gm, "_boxed_call") else gm

    return compiler


torch._dynamo.register_backend(
    aot_autograd(fw_compiler=_counter("fw"), bw_compiler=_counter("bw")), name="autosp_test_counting"
)


def _count_worker(rank, world):
    model = Llama(LlamaConfig.tiny(vocab_size=VOCAB, n_layers=3))
    backend = AutoSPBackend(sp_size=world, sp_rank=rank, group_name=dist.group.WORLD.group_name, backend="autosp_test_counting")
    x, y = batch(32)
    torch._dynamo.mark_dynamic(x, 1)
    torch._dynamo.mark_dynamic(y, 1)
    loss = torch.compile(lambda a, b: lm_loss(model(a), b, False), backend=backend)(x, y)
    loss.backward()
    return dict(_COUNTS)


@pytest.mark.slow
def test_four_all_to_alls_per_attention_forward_and_backward(tmp_path):
    counts = spawn(tmp_path, _count_worker, 2)
    assert counts[0] == counts[1] == {"fw": 12, "bw": 12}  # 3 attention calls x 4


def test_kv_exchanged_as_attention_reads_them_when_asked():
    """``kv_before_repeat=False`` (the memory model's hand-written baseline) leaves the model's
    repeat_kv before the exchange: still 4 all-to-alls per attention, none before a repeat."""
    gm = capture(make_model("llama"), *batch())
    for before, moved in ((True, 4), (False, 0)):
        out = sequence_parallel_pass(gm, sp_size=2, sp_rank=0, group_name="unused", kv_before_repeat=before)
        assert out.meta["autosp"].kv_exchanged_unrepeated == moved
        assert out.meta["autosp"].native_gqa == moved // 2
        assert sum(n.target in A2A for n in out.graph.nodes) == 8
    # native_gqa=False (the default off CPU) repeats the exchanged heads instead
    out = sequence_parallel_pass(gm, sp_size=2, sp_rank=0, group_name="unused", native_gqa=False)
    sdpa = out.graph.find_nodes(op="call_function", target=SDPA)
    assert out.meta["autosp"].native_gqa == 0 and out.meta["autosp"].kv_exchanged_unrepeated == 4
    assert all(not n.kwargs.get("enable_gqa", False) and exchanged_source(n.args[1]) is not n.args[1] for n in sdpa)
