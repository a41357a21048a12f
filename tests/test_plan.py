"""``lightning-autosp plan``: end to end on a CPU config and on Llama-3.1-8B's config, its errors,
and its memory model against what CPU runs measure.

The prediction check: two Llamas at three lengths, sp=2 on CPU (gloo), AutoSP with SAC; per rank
the bytes autograd keeps for backward (``saved_tensors_hooks``) and the peak resident memory of a
forward+backward (glibc returning large frees at once, as the benchmarks run), against the traced
model's saved bytes and peak: within 10%.
"""

from __future__ import annotations

import ctypes
import json
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _common import PeakRSS, SavedBytes  # noqa: E402
from sp_harness import spawn  # noqa: E402

from autosp.backend import AutoSPBackend  # noqa: E402
from lightning_autosp.cli import main as cli  # noqa: E402
from autosp.models import Llama, LlamaConfig  # noqa: E402
from autosp.memory import model as mm  # noqa: E402
from autosp.memory.plan import COMBINATIONS, PlanRequest, plan, render_text  # noqa: E402
from autosp.passes.sac import SACConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QWEN2_7B = {  # Qwen2.5-7B's config.json, the fields plan reads
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "vocab_size": 152064, "model_type": "qwen2",
}
LLAMA_8B = {  # Llama-3.1-8B's config.json, the fields plan reads
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "vocab_size": 128256, "model_type": "llama",
}


def _plan_json(capsys, *argv: str) -> dict:
    cli(["plan", *argv, "--json"])
    return json.loads(capsys.readouterr().out)


def _row(res: dict, variant: str, setting: str) -> dict:
    return next(r for r in res["combinations"] if r["variant"] == variant and r["setting"] == setting)


@pytest.mark.slow
def test_plan_of_the_cpu_demo_config(capsys):
    """The demo's own YAML: shapes, length and layout read from it; every combination sized."""
    res = _plan_json(capsys, "--config", str(ROOT / "configs/demo_cpu.yaml"), "--gpu-memory", "1GB")
    req = res["request"]
    assert (req["seq_len"], req["nodes"], req["gpus_per_node"], req["sp_size"]) == (1024, 1, 2, 2)
    assert req["model"]["dim"] == 64 and req["model"]["vocab_size"] > 0
    assert len(res["combinations"]) == 2 * len(COMBINATIONS)
    for setting in ("ddp", "autosp_fsdp"):
        sac, block = _row(res, "sp_sac", setting), _row(res, "sp_block", setting)
        assert block["longest"] >= sac["longest"] > 1024 and sac["fits"]
        assert block["at_seq_len"]["saved"] < sac["at_seq_len"]["saved"]
        off = _row(res, "sp_sac_offload", setting)
        assert off["at_seq_len"]["saved"] == 0 < off["at_seq_len"]["host"]
    assert _row(res, "sp_sac", "autosp_fsdp")["static"]["total"] < _row(res, "sp_sac", "ddp")["static"]["total"]
    assert res["recommended"]["arguments"].startswith("AutoSPStrategy(sp_size=2, fsdp=False, sac=True")
    out = render_text(res)  # what the command prints without --json: readable at 80 columns, nothing cut
    assert "Recommended: AutoSPStrategy(sp_size=2" in out and "M parameters, 4 heads, 1,024 tokens" in out
    assert max(len(line) for line in out.splitlines()) <= 80 and "…" not in out
    for row in res["combinations"]:  # every longest length printed whole
        assert f"{row['longest']:,}" in out


@pytest.mark.slow
@pytest.mark.full
def test_plan_of_llama_8b_on_one_node(capsys, tmp_path):
    """Llama-3.1-8B's config.json, one 8 x 80 GB node, a million tokens: replicas never fit (16
    bytes per parameter on every GPU), the sharded mode with SAC and offload does, limited by
    host memory; offload moves the saved activations off the device."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_8B))
    res = _plan_json(capsys, "--hf-config", str(config), "--nodes", "1", "--gpus-per-node", "8", "--seq-len", "1048576")
    assert abs(res["params"]["total"] - 8.03e9) < 0.01e9
    assert all(r["longest"] == 0 for r in res["combinations"] if r["setting"] == "ddp")
    sac, off = _row(res, "sp_sac", "autosp_fsdp"), _row(res, "sp_sac_tiled_offload", "autosp_fsdp")
    assert not sac["fits"] and off["fits"] and off["longest"] > 1048576 > sac["longest"] > 200_000
    tiled = _row(res, "sp_sac_tiled", "autosp_fsdp")
    assert tiled["at_seq_len"]["peak"] - tiled["at_seq_len"]["saved"] < sac["at_seq_len"]["peak"] - sac["at_seq_len"]["saved"]
    rec = res["recommended"]
    assert rec["setting"] == "autosp_fsdp" and "activation_offload='auto'" in rec["arguments"] and "memory_budget=" in rec["arguments"]
    # DeepSpeed ALST measured 3.7M tokens on one 8 x H100 node with its tiled MLPs and offloaded
    # checkpoints; blocks recomputed whole + tiled token-wise regions + offload predict more here
    alst = _row(res, "sp_block_tiled_offload", "autosp_fsdp")
    assert alst["longest"] >= 3_700_000 > _row(res, "sp_block_offload", "autosp_fsdp")["longest"], alst["longest"]


def test_plan_errors(tmp_path, capsys):
    """Every request gets a plan or one line naming what is wrong (exit status 2), never a traceback."""
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"hidden_size": 64}))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(LLAMA_8B))
    gpt = tmp_path / "gpt.yaml"
    gpt.write_text("model:\n  class_path: lightning_autosp.examples.causal_lm.CausalLMModule\n  init_args:\n    model: gpt\n")
    for argv, message in (
        (["--hf-config", str(bad)], r"--hf-config .*no 'vocab_size'; plan reads Llama-shaped configs"),
        (["--config", str(gpt)], r"plan reads the shapes of .*CausalLMModule with model: llama.*--hf-config"),
        (["--hf-config", str(good), "--gpu-memory", "eighty"], r"--gpu-memory='eighty': expected bytes per rank"),
        (["--hf-config", str(good), "--nodes", "2", "--sp-size", "12"], r"--sp-size 12: an SP group lies inside a node or spans whole nodes.*valid: \[1, 2, 4, 8, 16\]"),
        (["--hf-config", str(good), "--sp-size", "8", "--sp-layout", "4x4"], r"--sp-layout 4x4: .*ulysses x ring = 16, not sp_size=8"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli(["plan", *argv])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and re.search(message, err) and "Traceback" not in err, err
    with pytest.raises(SystemExit):  # argparse: one of --config / --hf-config
        cli(["plan"])
    with pytest.raises(SystemExit):
        cli(["plan", "--hf-config", str(good), "--sp-layout", "four"])


@pytest.mark.slow
@pytest.mark.full
def test_plan_lays_out_28_heads_on_one_node(capsys, tmp_path):
    """A Qwen2-7B-shaped config (28 query heads, 4 KV heads) on one node of 8: Ulysses alone could
    use 4 GPUs (before the ring, plan stopped with a traceback); the plan lays sp_size=8 out as
    ulysses=4 x ring=2, as the strategy does, and gives its longest length."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN2_7B))
    res = _plan_json(capsys, "--hf-config", str(config), "--nodes", "1", "--gpus-per-node", "8", "--seq-len", "262144")
    assert res["sp_size"] == 8 and res["layout"] == [4, 2] and res["sp_groups"][0]["layout"] == [4, 2]
    rec = res["recommended"]
    assert rec["arguments"].startswith("AutoSPStrategy(sp_size=8, fsdp=True") and rec["longest"] >= 262144
    assert max(r["longest"] for r in res["combinations"]) > 4_000_000
    text = render_text(res)
    assert "sp_size=8 as ulysses=4 x ring=2" in text and max(len(line) for line in text.splitlines()) <= 80


@pytest.mark.slow
@pytest.mark.full
def test_plan_of_llama_8b_on_four_nodes_reaches_alst():
    """Llama-3.1-8B on 4 x 8 x 80 GB, one SP group over all 32 GPUs (Ulysses over a node's 8, a
    ring of 4 across the nodes): blocks recomputed whole, tiled regions and offload predict at least
    the 15M tokens DeepSpeed ALST measured there (Ulysses across nodes)."""
    from autosp.memory import model as mm

    cfg = LlamaConfig(**mm.PRESETS["llama-3.1-8b"]["config"], max_seq_len=1 << 27)
    req = PlanRequest(model=cfg, seq_len=15_000_000, nodes=4, gpus_per_node=8, variants=("sp_block_tiled_offload",), settings=("autosp_fsdp",))
    res = plan(req)
    assert [g["sp_size"] for g in res["sp_groups"]] == [8, 16, 32] and res["layout"] == [8, 4]
    (row,) = res["combinations"]
    print(f"Llama-3.1-8B, 4 nodes x 8, ulysses=8 x ring=4: longest {row['longest']:,} ({row['limit']})")
    assert row["fits"] and row["longest"] >= 15_000_000


# ----------------------------------------------------------------------------- prediction vs measurement
CFGS = {
    "llama-128": LlamaConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=448, max_seq_len=1 << 14),
    "llama-256": LlamaConfig(vocab_size=512, dim=256, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=768, max_seq_len=1 << 14),
}
LENGTHS = (2048, 4096, 8192)


def _measure(rank, world):
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: large frees go back at once
    out = {}
    for name, cfg in CFGS.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Llama(cfg)
        backend = AutoSPBackend(sp_size=world, sp_rank=rank, group_name=dist.group.WORLD.group_name, backend="aot_eager", sac=SACConfig())
        step = torch.compile(lambda a, b: F.cross_entropy(model(a).flatten(0, 1), b.flatten()), backend=backend)
        for S in LENGTHS:
            x = torch.randint(0, cfg.vocab_size, (1, S))
            torch._dynamo.mark_dynamic(x, 1)
            step(x, x).backward()  # compiles (the first length only) and warms up
            model.zero_grad(set_to_none=True)
            saved, peak = SavedBytes([*model.parameters(), *model.buffers(), x]), PeakRSS()
            peak.start()
            with saved.hooks():
                loss = step(x, x)
            loss.backward()
            out[(name, S)] = (saved.total, peak.stop())
            model.zero_grad(set_to_none=True)
    return out


@pytest.mark.slow
@pytest.mark.full
def test_predictions_within_ten_percent_of_cpu_runs(tmp_path):
    # fresh processes: a rank forked from the test process would touch the pages it inherited
    # (reference counts) and count them in its resident peak
    measured = spawn(tmp_path, _measure, 2, start_method="spawn")[0]
    for name, cfg in CFGS.items():
        # the model plan uses, for this run: fp32, rank 0 of sp=2, KV heads as the CPU pass reads them
        predicted = mm.trace(cfg, "sp_sac", sp_size=2, dtype=torch.float32, native_gqa=None)
        for S in LENGTHS:
            kept, peak = measured[(name, S)]
            m = predicted.memory(S)
            print(f"{name} S={S}: saved {m['saved'] / kept:.3f}, peak {m['peak'] / peak:.3f} (predicted / measured)")
            assert abs(m["saved"] - kept) <= 0.1 * kept, (name, S, m["saved"], kept)
            assert abs(m["peak"] - peak) <= 0.1 * peak, (name, S, m["peak"], peak)
