"""AutoSPStrategy without running a job: validation, layout, SLURM, sampler, registry."""

import pytest
from lightning import Trainer
from lightning.pytorch.strategies import StrategyRegistry

from lightning_autosp import AutoSPStrategy, SequenceParallelSampler
from autosp.layout import SPLayout, validate_layout


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_sp_size_must_be_positive_int(bad):
    with pytest.raises(ValueError, match=r"AutoSPStrategy\(sp_size=.*\): sp_size must be an integer >= 1"):
        AutoSPStrategy(sp_size=bad)


def test_bad_backend_and_seq_dim():
    with pytest.raises(ValueError, match=r"compile_backend='tvm'.*choose one of \['inductor', 'aot_eager', 'eager'\]"):
        AutoSPStrategy(sp_size=2, compile_backend="tvm")
    with pytest.raises(ValueError, match=r"seq_dim=0.*dim 0 is the batch"):
        AutoSPStrategy(sp_size=2, seq_dim=0)


def test_world_size_not_divisible():
    with pytest.raises(ValueError, match=r"world size 3 is not divisible by sp_size.*valid here: \[1, 3\]"):
        Trainer(accelerator="cpu", devices=3, strategy=AutoSPStrategy(sp_size=2), logger=False)


def test_sp_groups_lie_in_a_node_or_span_whole_nodes():
    """An SP group inside a node, or over whole nodes (Ulysses inside, a ring across); never part of one."""
    assert validate_layout(sp_size=8, world_size=16, devices_per_node=4).all_sp_groups() == [list(range(8)), list(range(8, 16))]
    with pytest.raises(ValueError, match=r"devices per node \(4\) neither divide sp_size nor are divided by it.*valid here: \[1, 2, 4, 8, 12, 24\]"):
        validate_layout(sp_size=6, world_size=24, devices_per_node=4)
    with pytest.raises(ValueError, match=r"neither divide sp_size nor are divided by it"):
        Trainer(accelerator="cpu", devices=4, num_nodes=3, strategy=AutoSPStrategy(sp_size=6), logger=False)
    strategy = AutoSPStrategy(sp_layout=(2, 4))
    assert strategy.sp_size == 8 and strategy.sp_layout == (2, 4)


def test_attention_layouts():
    from autosp.layout import AttentionLayout, choose_attention_layout

    assert choose_attention_layout(8, [28], max_ulysses=8) == AttentionLayout(4, 2)  # Qwen2.5-7B on one node
    assert choose_attention_layout(32, [32], max_ulysses=8) == AttentionLayout(8, 4)  # Llama-3.1-8B on four nodes
    assert choose_attention_layout(4, [32, 32]) == AttentionLayout(4, 1)  # heads that divide: Ulysses alone
    assert choose_attention_layout(2, [3]) == AttentionLayout(1, 2)
    layout = AttentionLayout(2, 4)
    assert layout.ulysses_group(5) == [4, 5] and layout.ring_group(5) == [1, 3, 5, 7] and (layout.ring_rank(5), layout.ulysses_rank(5)) == (2, 1)


def test_layout_contiguous_sp_groups():
    layout = SPLayout(world_size=8, sp_size=4)
    assert layout.all_sp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.sp_group_ranks(6) == [4, 5, 6, 7] and layout.dp_group_ranks(6) == [2, 6]
    assert (layout.dp_size, layout.dp_rank(6), layout.sp_rank(6)) == (2, 1, 2)


SLURM_ENV = {
    "SLURM_NTASKS": "8",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_JOB_NAME": "autosp",
    "SLURM_NODELIST": "node[0-1]",
    "SLURM_JOB_ID": "1234",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "2",
}


def test_slurm_two_nodes_four_tasks(monkeypatch):
    for k, v in SLURM_ENV.items():
        monkeypatch.setenv(k, v)
    strategy = AutoSPStrategy(sp_size=4)
    trainer = Trainer(accelerator="cpu", devices=4, num_nodes=2, strategy=strategy, logger=False)
    assert type(trainer.strategy.cluster_environment).__name__ == "SLURMEnvironment"
    assert (strategy.global_rank, strategy.world_size) == (6, 8)
    assert (strategy.sp_rank, strategy.dp_rank, strategy.dp_size) == (2, 1, 2)
    assert strategy.layout.sp_group_ranks(strategy.global_rank) == [4, 5, 6, 7]  # node 1 is one SP group
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


def test_slurm_sp_size_spanning_nodes(monkeypatch):
    """sp_size=8 over two SLURM nodes of 4 is one SP group across both (a ring joins them);
    sp_size=2 x 3 would not tile the world, and is refused before any process starts."""
    for k, v in SLURM_ENV.items():
        monkeypatch.setenv(k, v)
    trainer = Trainer(accelerator="cpu", devices=4, num_nodes=2, strategy=AutoSPStrategy(sp_size=8), logger=False)
    assert trainer.strategy._validated_layout().all_sp_groups() == [list(range(8))]
    with pytest.raises(ValueError, match=r"world size 8 is not divisible by sp_size"):
        Trainer(accelerator="cpu", devices=4, num_nodes=2, strategy=AutoSPStrategy(sp_layout=(2, 3)), logger=False)


def test_sampler_same_inside_sp_group_disjoint_across_dp():
    data = list(range(36))
    world, sp = 8, 4
    per_rank = [list(SequenceParallelSampler(data, sp_size=sp, world_size=world, global_rank=r, seed=3)) for r in range(world)]
    for r in range(world):
        assert per_rank[r] == per_rank[(r // sp) * sp]  # same samples, same order, in an SP group
    a, b = set(per_rank[0]), set(per_rank[4])
    assert not (a & b)
    assert a | b == set(data)


def test_sampler_bad_input():
    with pytest.raises(ValueError, match="world_size=6 is not divisible by sp_size=4"):
        SequenceParallelSampler(list(range(4)), sp_size=4, world_size=6, global_rank=0)
    with pytest.raises(ValueError, match="pass `world_size` and `global_rank`"):
        SequenceParallelSampler(list(range(4)), sp_size=2)


def test_short_name_registered():
    assert "autosp" in StrategyRegistry
    trainer = Trainer(accelerator="cpu", devices=2, strategy="autosp", logger=False)
    assert isinstance(trainer.strategy, AutoSPStrategy)
    assert trainer.strategy.sp_size == 2  # one SP group per node by default


def test_ddp_kwargs_pass_through():
    from datetime import timedelta

    s = AutoSPStrategy(sp_size=2, process_group_backend="gloo", start_method="fork", timeout=timedelta(seconds=30), find_unused_parameters=True)
    assert s.process_group_backend == "gloo" and s._start_method == "fork"
    assert s._timeout == timedelta(seconds=30) and s._ddp_kwargs == {"find_unused_parameters": True}


def test_compiled_steps_is_a_read_only_view():
    st = AutoSPStrategy(sp_size=2)
    assert dict(st.compiled_steps) == {}  # nothing compiled before setup
    with pytest.raises(TypeError):
        st.compiled_steps["training_step"] = None  # type: ignore[index]


def test_sequence_length_from_the_batch():
    """The size most batch tensors share at seq_dim; ties go to integer (token id) tensors."""
    import torch

    from autosp.errors import AutoSPError
    from autosp.steps import _sequence_length

    ids, labels = torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, 32, dtype=torch.long)
    feats = torch.zeros(2, 8)
    assert _sequence_length([("['feats']", feats), ("['ids']", ids), ("['labels']", labels)], 1) == 32
    assert _sequence_length([("['feats']", feats), ("['ids']", ids)], 1) == 32  # tie: the token ids
    with pytest.raises(AutoSPError, match=r"disagree at seq_dim=1 \(batch\['a'\]: \(2, 32\), batch\['b'\]: \(2, 8\)\)"):
        _sequence_length([("['a']", ids), ("['b']", torch.zeros(2, 8, dtype=torch.long))], 1)
    assert _sequence_length([], 1) is None


def test_sp_ranks_that_compile_different_graphs(caplog):
    """Equal counts pass; a rank that recompiled alone is a warning (once), and an error before
    Dynamo's recompile limit could make it run the step eagerly."""
    import logging

    import torch

    from autosp.errors import AutoSPError

    from autosp.steps import StepConfig, StepRunner

    strategy = StepRunner(StepConfig(), sp_size=2, sp_rank=0, sp_group=None, device=torch.device("cpu"))
    strategy._check_same_graphs("training_step", [2, 2])
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        strategy._check_same_graphs("training_step", [2, 3])
        strategy._check_same_graphs("training_step", [2, 3])
    assert [r.getMessage().count("per SP rank: [2, 3]") for r in caplog.records] == [1]
    limit = torch._dynamo.config.recompile_limit
    with pytest.raises(AutoSPError, match=rf"recompile limit \({limit}\)"):
        strategy._check_same_graphs("training_step", [limit - 2, limit - 1])


def test_self_log_in_a_compiled_step_is_made_when_the_step_returns():
    """``self.log``/``self.log_dict`` of tensors and numbers in a compiled step are recorded in
    the graph and made when the step returns (module_hooks): no graph break, so Dynamo traces the
    step once, not twice up to the call. The values are those at the call (a later in-place change
    does not reach them), in the order of the calls, with their keyword arguments. A call that
    cannot be recorded (an object logged) is a graph break (the negative control of the count) and
    runs after the calls recorded before it."""
    import torch
    from lightning import LightningModule

    from autosp._compat import graph_break_counter
    from lightning_autosp import module_hooks

    class Logged(LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.seen = []

        def log(self, name, value, **kwargs):  # what Lightning's would receive
            self.seen.append((name, float(value) if isinstance(value, torch.Tensor) else value, kwargs))

        def log_dict(self, dictionary, **kwargs):
            self.seen.append(({k: float(v) if isinstance(v, torch.Tensor) else v for k, v in dictionary.items()}, kwargs))

    def step(m, x, obj):
        loss = m.lin(x).pow(2).mean()
        m.log("loss", loss, prog_bar=True, sync_dist=True)
        scaled = loss * 2
        if obj is not None:
            m.log("object", obj)
        m.log_dict({"scaled": scaled, "tokens": x.shape[0]})
        scaled.mul_(10)  # after the call: not what was logged
        return scaled

    module = Logged()
    replaced = module_hooks.keep_out_of_graphs(module)
    try:
        compiled = torch.compile(step, backend="aot_eager")
        x = torch.randn(3, 4)
        want = float(module.lin(x).pow(2).mean().detach())
        for obj in (None, object()):
            module.seen.clear()
            before = sum(graph_break_counter().values())
            out = compiled(module, x, obj)
            module_hooks.replay_deferred()
            breaks = sum(graph_break_counter().values()) - before
            assert float(out.detach()) == pytest.approx(20 * want)
            expected = [("loss", pytest.approx(want), {"prog_bar": True, "sync_dist": True})]
            if obj is not None:
                assert module.seen.pop(1) == ("object", obj, {})
            expected.append(({"scaled": pytest.approx(2 * want), "tokens": 3}, {}))
            assert module.seen == expected
            assert (breaks > 0) == (obj is not None), breaks  # (Dynamo counts a break once per trace of the frame)
    finally:
        module_hooks.restore(replaced)
        module_hooks.drop_deferred()
