"""ActivationMemoryMonitor: bytes saved for backward per op kind, per step and rank, under
AutoSP and without it (one device, plain DDP), through the Trainer's logger."""

import csv
import os
import re

import lightning as L
import pytest
import sympy
import torch
from sp_harness import START_METHOD, LMModule, TokenData, free_port
from torch import nn
from torch.utils.data import DataLoader

from lightning_autosp import ActivationMemoryMonitor, AutoSPStrategy
from autosp.backend import CompiledStep
from autosp.passes.accounting import OP_KINDS, SavedActivations, SavedTensor, op_kind
from autosp.memory.eager import EagerSavedTensors
from lightning_autosp.monitor import format_summary, plot_saved_bytes, summarize
from autosp.passes import SPPassStats

KEYS = [f"saved_{k}_bytes" for k in (*OP_KINDS, "total")] + ["peak_bytes"]


# ----------------------------------------------------------------------------- units
def test_op_kinds():
    assert op_kind("aten::mm") == op_kind("aten::addmm") == op_kind("aten::silu") == "linear"
    assert op_kind("autosp::seq_gather") == op_kind("autosp::seq_scatter") == op_kind("_c10d_functional::all_to_all_single") == "all_to_all"
    assert op_kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert op_kind("aten::_scaled_dot_product_efficient_attention") == "attention"
    assert op_kind("aten::native_layer_norm") == op_kind("aten::mul", "RMSNorm") == "norm"
    assert op_kind("aten::embedding") == "embedding"
    assert op_kind("aten::_log_softmax") == op_kind("aten::nll_loss_forward") == "loss"
    assert op_kind("aten::mul", "FeedForward") == op_kind("aten::mul", "LlamaMLP") == "linear"
    assert op_kind("aten::cat", "Attention") == "attention"  # RoPE inside an attention module
    assert op_kind("aten::add", "TransformerBlock") == op_kind("aten::cos") == "other"


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.norm(x)))).pow(2).sum()


def test_eager_measurement_exact():
    """Counted: every allocation made in the forward that autograd saves, once, by producer;
    not counted: the input and the parameters (they exist before the forward)."""
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(3, 8)
    tracker = EagerSavedTensors()
    tracker.start(block)
    loss = block(x)
    got = tracker.stop()
    loss.backward()
    f = 4  # float32
    want = {k: 0 for k in OP_KINDS}
    # LayerNorm saves mean and rstd ([3, 1] each); fc1 saves the norm's output [3, 8]
    want["norm"] = (3 + 3 + 3 * 8) * f
    # relu saves its output [3, 16] (fc2's input, the same allocation); pow saves fc2's output [3, 4]
    want["linear"] = (3 * 16 + 3 * 4) * f
    assert got == want
    # hooks stay (inactive) until close; a second measurement starts from zero
    tracker.start(block)
    block(x)
    assert tracker.stop() == want
    assert tracker.hooked
    tracker.close()
    assert not tracker.hooked


def test_compiled_step_snapshot_and_bytes_since():
    """The read-only view the monitor reads: a snapshot does not follow later calls, and
    ``saved_bytes_by_kind(since=...)`` counts the calls after the earlier snapshot (sized at the
    latest call's length); a graph compiled after that snapshot counts all its calls."""
    s0 = sympy.Symbol("s0")
    tensors = [
        SavedTensor(name="attn", kind="attention", nbytes=8 * s0, shape=("s0", "2"), dtype="float32"),
        SavedTensor(name="mm", kind="linear", nbytes=sympy.Integer(64), shape=("16",), dtype="float32"),
    ]
    live = SavedActivations(tensors=tensors, symbols=("s0",), binding=(10,), calls=1)

    def view(*records):
        return CompiledStep("aot_eager", None, (SPPassStats(sdpa=1, all_to_all=4),), tuple(r.snapshot() for r in records))

    before = view(live)
    live.calls, live.binding = 3, (20,)  # two more calls, the latest at s0 = 20
    late = SavedActivations(tensors=tensors[1:], calls=1)  # a graph compiled after `before`
    after = view(live, late)
    assert before.saved_activations[0].calls == 1 and before.saved_activations[0].bytes_by_kind()["attention"] == 80
    assert after.saved_activations[0].bytes_by_kind() == {**dict.fromkeys(OP_KINDS, 0), "attention": 160, "linear": 64}
    got = after.saved_bytes_by_kind(since=before)
    assert got == {**dict.fromkeys(OP_KINDS, 0), "attention": 2 * 160, "linear": 2 * 64 + 64}
    assert after.saved_bytes_by_kind()["linear"] == 3 * 64 + 64  # every call so far
    assert (after.sdpa_rewritten, after.all_to_alls, after.fallbacks) == (1, 4, ())
    with pytest.raises(AttributeError):
        after.pass_stats = ()  # frozen
    unbound = SavedActivations(tensors=tensors, calls=1)  # s0 never bound
    with pytest.raises(ValueError, match="unbound symbols"):
        view(unbound).saved_bytes_by_kind()


def test_summary_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    hist = []
    for step in range(2):
        for r in range(2):
            e = {"step": step, "rank": r, **{k: float((i + 1) << 20) for i, k in enumerate(OP_KINDS)}}
            e["total"] = sum(e[k] for k in OP_KINDS)
            e["peak"] = float(100 << 20) + r
            hist.append(e)
    summary = summarize(hist)
    assert set(summary) == {"rank0", "rank1"} and summary["rank0"]["linear"] == 3 << 20
    table = format_summary(summary)
    assert re.search(r"attention\s+1\.000\s+1\.000\s+3\.6%", table)
    assert re.search(r"total\s+28\.000\s+28\.000", table) and re.search(r"peak memory\s+100\.000", table)
    path = tmp_path / "kinds.png"
    plot_saved_bytes({"SAC": summary["rank0"], "no SAC": summary["rank1"]}, path, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_arguments():
    with pytest.raises(ValueError, match="every_n_steps=0"):
        ActivationMemoryMonitor(every_n_steps=0)


# ----------------------------------------------------------------------------- with a Trainer
def _fit(tmp_path, strategy, devices, monitor, steps=2):
    os.environ["MASTER_PORT"] = str(free_port())
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="logs", version=0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=logger,
        callbacks=[monitor],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(LMModule("llama"), DataLoader(TokenData(8, 32), batch_size=2))
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]
    return [r for r in rows if any(k.startswith("activation_memory/") for k in r)]


def _by_rank(rows, step, world):
    (row,) = [r for r in rows if r["step"] == step]
    return [{k: row[f"activation_memory/rank{r}/{k}"] for k in KEYS} for r in range(world)]


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    """The eager one-device figures, shared by the DDP comparison."""
    tmp = tmp_path_factory.mktemp("single")
    monitor = ActivationMemoryMonitor(plot_path=tmp / "kinds.png")
    rows = _fit(tmp, "auto", 1, monitor)
    return tmp, monitor, rows


def test_single_device(single_device):
    tmp, monitor, rows = single_device
    assert [r["step"] for r in rows] == [0, 1]
    (m,) = _by_rank(rows, 0, 1)
    for k in ("attention", "linear", "norm", "embedding", "loss", "other"):
        assert m[f"saved_{k}_bytes"] > 0, k
    assert m["saved_all_to_all_bytes"] == 0
    assert m["saved_total_bytes"] == sum(m[f"saved_{k}_bytes"] for k in OP_KINDS)
    assert m["peak_bytes"] > 0
    assert _by_rank(rows, 1, 1) [0]["saved_total_bytes"] == m["saved_total_bytes"]  # same shapes, same bytes
    assert monitor.summary["rank0"]["total"] == m["saved_total_bytes"]
    assert (tmp / "kinds.png").read_bytes()[:4] == b"\x89PNG"


def test_plain_ddp_matches_single_device(tmp_path, single_device):
    """Two DDP ranks run the same shapes as one device: every rank reports its figures, equal
    to the one-device ones."""
    rows = _fit(tmp_path, L.pytorch.strategies.DDPStrategy(start_method=START_METHOD), 2, ActivationMemoryMonitor())
    ref = _by_rank(single_device[2], 0, 1)[0]
    for m in _by_rank(rows, 0, 2):
        for k in KEYS[:-1]:
            assert m[k] == ref[k], k


@pytest.mark.slow
def test_autosp_with_sac(tmp_path):
    """Under AutoSP the figures come from the compiled graph: SP collectives show up, SAC leaves
    no linear/norm output saved, and both ranks of the SP group report the same."""
    monitor = ActivationMemoryMonitor()
    strategy = AutoSPStrategy(sp_size=2, compile_backend="aot_eager", start_method=START_METHOD)
    rows = _fit(tmp_path, strategy, 2, monitor)
    ranks = _by_rank(rows, 0, 2)
    for m in ranks:
        assert m["saved_all_to_all_bytes"] > 0 and m["saved_attention_bytes"] > 0
        assert m["saved_linear_bytes"] == m["saved_norm_bytes"] == 0
        assert m["saved_total_bytes"] == sum(m[f"saved_{k}_bytes"] for k in OP_KINDS)
    assert ranks[0] == {**ranks[1], "peak_bytes": ranks[0]["peak_bytes"]}
