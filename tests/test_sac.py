"""Sequence-aware activation checkpointing: the policy, its invariants, and its scope.

Invariants: gradients identical with and without SAC; exactly 4 all-to-alls per
attention call in backward (no collective recomputed), also under a memory budget; fewer
bytes saved for backward; a plain ``torch.compile`` elsewhere in the process is unaffected.
"""

import logging
import operator

import pytest
import torch
import torch.distributed as dist
from sp_harness import VOCAB, lm_loss, make_model, rel_err, spawn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from lightning_autosp import AutoSPStrategy
from autosp.backend import AutoSPBackend
from autosp.passes.accounting import OP_KINDS, node_kind
from autosp.models import Llama, LlamaConfig
from autosp.passes.joint_graph import forward_nodes, op_name as _op_name
from autosp.passes.sac import RECOMPUTABLE_KINDS, SACConfig, SACPartitioner

A2A = (torch.ops.autosp.seq_gather.default, torch.ops.autosp.seq_scatter.default)


def _batch(S, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, S), generator=g), torch.randint(0, VOCAB, (2, S), generator=g)


# ----------------------------------------------------------------------------- configuration
def test_config_defaults_and_validation():
    cfg = SACConfig()
    assert cfg.recompute == ("linear", "norm") and cfg.memory_budget == 1.0
    assert SACConfig(recompute=["linear", "linear"], memory_budget=1).recompute == ("linear",)
    with pytest.raises(ValueError, match=r"cannot recompute \['attention'\]; attention and collectives are always saved"):
        SACConfig(recompute=("linear", "attention"))
    with pytest.raises(ValueError, match=r"cannot recompute \['all_to_all'\]"):
        SACConfig(recompute=("all_to_all",))
    with pytest.raises(ValueError, match=r"cannot recompute \['mlp'\]; known kinds"):
        SACConfig(recompute=("mlp",))
    with pytest.raises(ValueError, match="expected a list of op kinds"):
        SACConfig(recompute="linear")
    for bad in (0, 0.0, 1.5, -1, True, "1"):
        with pytest.raises(ValueError, match=r"sac_memory_budget=.*expected a number in \(0, 1\]"):
            SACConfig(memory_budget=bad)


def test_strategy_arguments():
    st = AutoSPStrategy(sp_size=2, sac_recompute=["linear"], sac_memory_budget=0.5)
    assert st.sac and st.sac_config == SACConfig(recompute=("linear",), memory_budget=0.5)
    assert AutoSPStrategy(sp_size=2, sac=False).sac is False
    with pytest.raises(ValueError, match=r"sac_recompute=\['attention'\]"):
        AutoSPStrategy(sp_size=2, sac_recompute=["attention"])
    with pytest.raises(ValueError, match="sac_memory_budget=0"):
        AutoSPStrategy(sp_size=2, sac_memory_budget=0)


def test_yaml(tmp_path):
    """The SAC arguments (and the memory monitor) from a LightningCLI config file."""
    from lightning.pytorch.cli import LightningCLI
    from sp_harness import LMModule

    from lightning_autosp import ActivationMemoryMonitor

    cfg = tmp_path / "sac.yaml"
    cfg.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  logger: false\n  enable_checkpointing: false\n"
        "  strategy:\n    class_path: lightning_autosp.AutoSPStrategy\n    init_args:\n      sp_size: 2\n"
        "      compile_backend: aot_eager\n      sac_recompute: [linear, norm, other]\n      sac_memory_budget: 0.5\n"
        "  callbacks:\n    - class_path: lightning_autosp.ActivationMemoryMonitor\n"
        "      init_args:\n        every_n_steps: 10\n"
        "model:\n  kind: llama\n"
    )
    cli = LightningCLI(LMModule, run=False, args=["--config", str(cfg)], save_config_kwargs={"overwrite": True})
    st = cli.trainer.strategy
    assert isinstance(st, AutoSPStrategy) and st.sac
    assert st.sac_config == SACConfig(recompute=("linear", "norm", "other"), memory_budget=0.5)
    (mon,) = [c for c in cli.trainer.callbacks if isinstance(c, ActivationMemoryMonitor)]
    assert mon.every_n_steps == 10


def test_sac_without_aot_backend_is_refused():
    """SAC partitions the AOT joint graph: with eager autograd it is an error, not a silent no-op."""
    for backend in ("autosp_test_counting", "eager"):
        with pytest.raises(ValueError, match="only the \\['inductor', 'aot_eager'\\] backends"):
            AutoSPBackend(sp_size=2, sp_rank=0, group_name="unused", backend=backend, sac=SACConfig())
    AutoSPBackend(sp_size=2, sp_rank=0, group_name="unused", backend="eager", sac=None)
    with pytest.raises(ValueError, match=r"compile_backend='eager', sac=True\).*Pass sac=False"):
        AutoSPStrategy(sp_size=2, compile_backend="eager")
    assert AutoSPStrategy(sp_size=2, compile_backend="eager", sac=False).compile_backend == "eager"


# ----------------------------------------------------------------------------- policy, one process
def _compile_once(model, partition_fn, S=32):
    """One compiled training step of ``model`` with ``partition_fn``; returns (loss, grads)."""
    x, y = _batch(S)
    step = torch.compile(
        lambda a, b: lm_loss(model(a), b, False),
        backend=aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition_fn),
    )
    loss = step(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_policy_tags_and_partition():
    """On a Llama joint graph (no SP): attention is MUST_SAVE, every forward matmul and norm
    op PREFER_RECOMPUTE, nothing in backward is tagged; the partition then recomputes the
    matmuls, saves no linear/norm output, saves fewer bytes, and gradients do not change."""
    x, y = _batch(32)
    model = make_model("llama")
    ref_loss = lm_loss(model(x), y, False)
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}

    results, joints = {}, {}
    for name, cfg in (("off", None), ("on", SACConfig())):
        torch._dynamo.reset()
        model = make_model("llama")
        part = SACPartitioner(cfg)

        def partition_fn(gm, joint_inputs, part=part, name=name, **kw):
            joints[name] = (gm, kw["num_fwd_outputs"])
            return part(gm, joint_inputs, **kw)

        loss, grads = _compile_once(model, partition_fn)
        assert len(part.records) == 1
        results[name] = (loss, grads, part.records[0])

    gm, n_out = joints["on"]
    fwd = forward_nodes(gm, n_out)
    tagged = {n: n.meta.get("recompute") for n in gm.graph.nodes if "recompute" in n.meta}
    sdpa = [n for n in fwd if n.op == "call_function" and node_kind(n) == "attention" and "scaled_dot_product" in str(n.target)]
    mms = [n for n in fwd if n.target is torch.ops.aten.mm.default]
    assert len(sdpa) == 2 and len(mms) == 2 * 7 + 1
    assert all(tagged.get(n) is CheckpointPolicy.MUST_SAVE for n in sdpa)
    assert all(tagged.get(u) is CheckpointPolicy.MUST_SAVE for n in sdpa for u in n.users)
    assert all(tagged.get(n) is CheckpointPolicy.PREFER_RECOMPUTE for n in mms)
    sdpa_outputs = {u for n in sdpa for u in n.users}
    assert all(n in fwd or n in sdpa_outputs for n in tagged)  # forward nodes only
    assert not any("recompute" in n.meta for n in joints["off"][0].graph.nodes)

    off, on = results["off"][2], results["on"][2]
    assert on.sac and not off.sac
    assert on.recomputed.get("mm", 0) >= 4 and "mm" not in off.recomputed
    S = {s: 32 for s in on.symbols}
    b_on, b_off = on.bytes_by_kind(S), off.bytes_by_kind(S)
    assert b_off["linear"] > 0 and b_off["norm"] > 0
    assert b_on["linear"] == 0 and b_on["norm"] == 0
    assert b_on["attention"] == b_off["attention"] > 0  # attention outputs stay saved
    assert sum(b_on.values()) < 0.6 * sum(b_off.values())
    # gradients: identical with and without SAC, and equal to eager
    for n in ref:
        assert rel_err(results["on"][1][n], results["off"][1][n]) <= 1e-6, n
        assert rel_err(results["on"][1][n], ref[n]) <= 1e-5, n
    assert abs(float(results["on"][0]) - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())


@pytest.mark.slow
def test_plain_compile_elsewhere_is_unaffected():
    """A plain aot_eager compile (default min-cut partition) saves exactly the same tensors
    before and after an SAC compile (with a memory budget) in the same process."""

    def plain():
        torch._dynamo.reset()
        seen = {}

        def partition_fn(gm, joint_inputs, **kw):
            assert not any("recompute" in n.meta for n in gm.graph.nodes)
            fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kw)
            out = fw.graph.find_nodes(op="output")[0].args[0]
            seen["saved"] = [str(n) for n in out[kw["num_fwd_outputs"]:]]
            seen["bw_mm"] = sum(n.target is torch.ops.aten.mm.default for n in bw.graph.nodes)
            return fw, bw

        _compile_once(make_model("llama"), partition_fn)
        return seen

    before = plain()
    torch._dynamo.reset()
    part = SACPartitioner(SACConfig(memory_budget=0.5))
    _compile_once(make_model("llama"), part)
    assert part.records[0].recomputed.get("mm", 0) > 0  # SAC did act
    assert torch._functorch.config.activation_memory_budget == 1.0
    assert torch._inductor.config.custom_partitioner_fn is None
    after = plain()
    assert after == before and before["saved"]


def _solver_ignoring_must_save(gm, joint_inputs, **kwargs):
    """torch's min-cut partitioner, except that under a memory budget it drops the MUST_SAVE of
    the attention op and its outputs - what torch's budget solver did with multi-output ops up
    to 2.14 in one form or another (saving the op's tuple, or recomputing it). With no budget it
    is the plain partitioner."""
    if torch._functorch.config.activation_memory_budget >= 1:
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
    for n in gm.graph.nodes:
        if n.op == "call_function" and "scaled_dot_product" in str(n.target) and "backward" not in str(n.target):
            for m in (n, *n.users):
                m.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)


def _saves_attention_recomputes_the_rest(rec):
    assert not any("scaled_dot_product" in op for op in rec.recomputed)
    by_kind = rec.bytes_by_kind({s: 32 for s in rec.symbols})
    assert by_kind["attention"] > 0 and sum(by_kind.values()) == by_kind["attention"]  # all else recomputed


def test_budget_that_would_recompute_attention_falls_back(caplog):
    """Negative control of the partition check: a budget partition that would run attention
    again in backward is caught, warned about, and replaced by the budget-free partition, which
    saves attention's outputs and recomputes every other kind. The bad partition is made on
    purpose (a solver that drops MUST_SAVE under a budget), so the control holds on every torch,
    whatever torch's own solver does."""
    calls = []

    def solver(gm, joint_inputs, **kwargs):
        calls.append(_solver_ignoring_must_save(gm, joint_inputs, **kwargs))
        return calls[-1]

    part = SACPartitioner(SACConfig(recompute=RECOMPUTABLE_KINDS, memory_budget=0.1), solver)
    with caplog.at_level("WARNING", logger="autosp.passes.sac"):
        _compile_once(make_model("llama"), part)
    assert "would recompute attention op(s) ['_scaled_dot_product_flash_attention_for_cpu (" in caplog.text
    assert "using the budget-free partition" in caplog.text
    _saves_attention_recomputes_the_rest(part.records[0])
    # the partition it replaced was a bad one: its backward runs the attention forward again (by
    # name, or replaying its RNG state as run_with_rng_state, depending on torch), the budget-free
    # one's does not
    attention_fwd_in = lambda g: [n for n in g.graph.nodes if "scaled_dot_product" in str(_op_name(n)) and "backward" not in str(_op_name(n))]  # noqa: E731
    assert len(calls) == 2 and attention_fwd_in(calls[0][1]) and not attention_fwd_in(calls[1][1])


def test_torch_budget_solver_keeps_the_invariants():
    """torch's own budget solver under a tiny budget: whether it handles attention itself (torch
    >= 2.15) or the check falls back (older torch saved the op's output tuple), the compiled
    partition saves attention and recomputes everything else."""
    part = SACPartitioner(SACConfig(recompute=RECOMPUTABLE_KINDS, memory_budget=0.1))
    _compile_once(make_model("llama"), part)
    _saves_attention_recomputes_the_rest(part.records[0])


def _fused_loss_recomputed_worker(rank, world):
    """Compile an SP step with a partition that recomputes the fused vocabulary loss in backward
    (its tags overridden to MUST_RECOMPUTE, as a solver ignoring MUST_SAVE would): the loss and
    gradients would still be right, computed twice. Returns the compile error, if any, and, as
    the control, whether the unforced partition compiles and trains."""
    import autosp.backend as backend_module
    from autosp.passes.joint_graph import is_fused_loss

    class Forcing(SACPartitioner):
        def _partition(self, gm, joint_inputs, budget, kwargs):
            for n in gm.graph.nodes:
                fused = is_fused_loss(n)
                if fused or (n.target is operator.getitem and is_fused_loss(n.args[0])):
                    n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            return super()._partition(gm, joint_inputs, budget, kwargs)

    out = {}
    for name, partitioner in (("forced", Forcing), ("control", SACPartitioner)):
        torch._dynamo.reset()
        backend_module.SACPartitioner = partitioner
        torch.manual_seed(0)
        model = Llama(LlamaConfig.tiny(vocab_size=VOCAB, n_layers=1))
        backend = AutoSPBackend(sp_size=world, sp_rank=rank, group_name=dist.group.WORLD.group_name, backend="aot_eager", sac=SACConfig())
        step = torch.compile(lambda a, b: lm_loss(model(a), b, False), backend=backend)
        x, y = _batch(32)
        torch._dynamo.mark_dynamic(x, 1)
        torch._dynamo.mark_dynamic(y, 1)
        try:
            step(x, y).backward()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the message is what the test checks
            out[name] = str(e)
    return out


@pytest.mark.slow
@pytest.mark.full
def test_partition_that_recomputes_the_fused_loss_is_refused(tmp_path):
    for res in spawn(tmp_path, _fused_loss_recomputed_worker, 2):
        assert "would recompute the fused vocabulary loss" in res["forced"], res["forced"]
        assert res["control"] is None, res["control"]


# ----------------------------------------------------------------------------- SP, two processes
class _CountAllToAll(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in A2A
        return func(*args, **(kwargs or {}))


# a memory budget < 1 lets the partitioner recompute custom-op collectives unless they are MUST_SAVE
_CONFIGS = {"off": None, "on": SACConfig(), "on_budget": SACConfig(memory_budget=0.1)}


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _sp_worker(rank, world):
    out = {}
    warnings = _ListHandler()
    logging.getLogger("autosp.passes.sac").addHandler(warnings)
    for name, cfg in _CONFIGS.items():
        torch._dynamo.reset()
        torch.manual_seed(1234)
        model = Llama(LlamaConfig.tiny(vocab_size=VOCAB, n_layers=1))  # one layer: compile time
        backend = AutoSPBackend(sp_size=world, sp_rank=rank, group_name=dist.group.WORLD.group_name, backend="aot_eager", sac=cfg)
        step = torch.compile(lambda a, b: lm_loss(model(a), b, False), backend=backend)
        x, y = _batch(32)
        torch._dynamo.mark_dynamic(x, 1)
        torch._dynamo.mark_dynamic(y, 1)
        step(x, y)  # compiles
        first = backend.compiled_step()  # a snapshot: the calls below leave it alone
        # a new sequence length, same graph: what autograd really keeps, and the backward's collectives
        x, y = _batch(48, seed=1)
        inputs = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), x, y)}
        kept = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in inputs:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step(x, y)
        count = _CountAllToAll()
        with count:
            loss.backward()
        compiled = backend.compiled_step()
        (rec,) = compiled.saved_activations
        out[name] = dict(
            loss=loss.item(),
            grads={n: p.grad.clone() for n, p in model.named_parameters()},
            bw_all_to_all=count.n,
            sdpa=compiled.sdpa_rewritten,
            calls=rec.calls,
            first_calls=first.saved_activations[0].calls,
            since_first=compiled.saved_bytes_by_kind(since=first),
            kept_bytes=sum(kept.values()),
            by_kind=rec.bytes_by_kind(),
            recomputed=rec.recomputed,
            collectives=(rec.fw_collectives, rec.bw_collectives),
            warnings=list(warnings.messages),
        )
        warnings.messages.clear()
    return out


@pytest.mark.slow
def test_sp_invariants(tmp_path):
    ranks = spawn(tmp_path, _sp_worker, 2)
    for r, res in enumerate(ranks):
        off, on, budget = res["off"], res["on"], res["on_budget"]
        for name, x in res.items():
            assert x["sdpa"] == 1 and x["calls"] == 2, name  # one graph serves both lengths
            assert x["first_calls"] == 1 and x["since_first"] == x["by_kind"], name  # the call after the snapshot
            assert not x["warnings"], x["warnings"]  # the tags held: no fallback partition
            assert x["bw_all_to_all"] == 4 * x["sdpa"], (name, x["bw_all_to_all"])  # none recomputed
            assert x["collectives"] == off["collectives"], name
            # the record sizes what autograd actually keeps, at the new length
            assert sum(x["by_kind"].values()) == x["kept_bytes"], (name, x["by_kind"], x["kept_bytes"])
            assert set(x["by_kind"]) == set(OP_KINDS)
        assert "mm" in on["recomputed"] and "mm" not in off["recomputed"]
        assert on["by_kind"]["linear"] == on["by_kind"]["norm"] == 0 < off["by_kind"]["linear"]
        assert on["by_kind"]["all_to_all"] == off["by_kind"]["all_to_all"] > 0
        assert on["kept_bytes"] < 0.6 * off["kept_bytes"]
        assert budget["kept_bytes"] < on["kept_bytes"]  # the budget recomputes more
        # gradients identical with and without SAC (same rank, same shard)
        for other in (on, budget):
            assert abs(other["loss"] - off["loss"]) <= 1e-6 * abs(off["loss"])
            for n, g in off["grads"].items():
                assert rel_err(other["grads"][n], g) <= 1e-6, (r, n)
