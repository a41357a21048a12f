"""Run the benchmarks behind ``BENCHMARKS.md`` and write it (``make benchmarks``).

Steps: ``sp_throughput.py`` (CPU, 2 and 4 processes), ``trainability.py`` (traced real
shapes), ``checkpoint_io.py`` (save/load, replicated against sharded), ``sp_throughput.py``
again (sharded against replicated) and ``sharded_mode.py`` (the sharded mode's working set,
collectives and building from meta), ``vocab_loss.py`` (the
fused loss against full logits), ``compile_time.py`` (first step against depth), ``masks.py`` (packed
documents and sliding windows, dense against tiled masks), ``long_rows.py`` (tiled MLPs and offload at 32k),
``sp_split.py`` (per-rank saved bytes at sp=2 and 4
against sp=1, and the ops run replicated), ``ring_costs.py`` (a ring level's bytes, time and memory against
Ulysses alone), ``gpu_check.py`` (only with CUDA; without it the last GPU results in
``benchmarks/results/gpu_check.json`` are shown, if any). Results go to
``benchmarks/results/`` (JSON and PNG) and the page is rendered from them.
``sac_memory.py`` is run on its own; its figures are in ``docs/memory.md``.

``--reuse`` renders the page from the JSON files already there, running nothing. The prose
is ``benchmarks/report_template.md``; this script only computes the figures it names.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import string
import time
from typing import Optional

import _common
import checkpoint_io
import compile_time
import gpu_check
import long_rows
import masks
import ring_costs
import sp_split
import sharded_mode
import sp_throughput
import torch
import trainability
import vocab_loss

RESULTS = _common.ROOT / "benchmarks" / "results"
PAGE = _common.ROOT / "BENCHMARKS.md"
#: the page's prose, with ``$name`` placeholders for the figures
TEMPLATE = _common.ROOT / "benchmarks" / "report_template.md"


def _load(name: str) -> Optional[dict]:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def run_all() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    sp_throughput.main(["--out", str(RESULTS / "sp_throughput.json"), "--plot", str(RESULTS / "sp_memory.png")])
    trainability.main(["--out", str(RESULTS / "trainability.json"), "--plot", str(RESULTS / "trainability.png")])
    checkpoint_io.main(["--out", str(RESULTS / "checkpoint_io.json")])
    sp_throughput.main(["--variants", "autosp_sac", "autosp_sac_fsdp", "--long-seq-len", "0", "--out", str(RESULTS / "sp_throughput_fsdp.json")])
    sharded_mode.main(["--out", str(RESULTS / "sharded_mode.json")])
    vocab_loss.main(["--out", str(RESULTS / "vocab_loss.json")])
    compile_time.main(["--out", str(RESULTS / "compile_time.json")])
    masks.main(["--out", str(RESULTS / "masks.json")])
    masks.main(["--seq-lens", "16384", "--cases", "plain", "causal mask", "--steps", "8", "--out", str(RESULTS / "masks_causal.json")])
    sp_split.main(["--seq-len", "1024", "--sp", "2", "4", "--out", str(RESULTS / "sp_split.json")])
    long_rows.main(["--seq-len", "32768", "--out", str(RESULTS / "long_rows.json")])
    ring_costs.main(["--seq-len", "8192", "--out", str(RESULTS / "ring_costs.json")])
    if torch.cuda.is_available():
        gpu_check.main(["--out", str(RESULTS / "gpu_check.json")])


def _sections() -> dict[str, string.Template]:
    """The sections of ``report_template.md``, by name, as templates."""
    parts = re.split(r"^<!-- section: (\w+) -->\n", TEMPLATE.read_text(), flags=re.M)
    return {name: string.Template(body.removesuffix("\n")) for name, body in zip(parts[1::2], parts[2::2])}


def _key_ratios(tp: dict, section: string.Template) -> str:
    budget = tp["args"]["budget_mib"]
    out = []
    for n, run in tp["runs"].items():
        v = run["variants"]
        tps = {k: x["tokens_per_s"] for k, x in v.items()}
        at = {k: sp_throughput.at_budget(x, budget) for k, x in v.items()}
        saved = {k: x["saved_bytes"] for k, x in v.items()}

        def gain(a: str, b: str) -> str:
            return f"{at[a] / at[b]:.2f}x" if at[a] and at[b] else "-"

        def speed(name: str, r: dict = v) -> str:  # against compiled hand-written Ulysses, per-round median
            x = r[name]
            if x.get("vs_compiled"):
                return f"{statistics.median(x['vs_compiled']):.2f}x"
            return f"{x['tokens_per_s'] / r['ulysses_compiled']['tokens_per_s']:.2f}x"

        long = {k: x["long"] for k, x in v.items() if "long" in x}
        long_line = ""
        if {"autosp", "autosp_sac", "ulysses_compiled"} <= set(long):
            long_line = (
                f" At S={long['autosp']['seq_len']}: AutoSP without SAC / compiled hand-written Ulysses "
                f"**{speed('autosp', long)}**, with SAC **{speed('autosp_sac', long)}**."
            )
        a2a = {k: x.get("all_to_all_bytes") for k, x in v.items()}
        a2a_line = ""
        if a2a.get("autosp") and a2a.get("ulysses_compiled"):
            a2a_line = (
                f" Bytes sent by all-to-alls per step: compiled hand-written Ulysses / AutoSP "
                f"**{a2a['ulysses_compiled'] / a2a['autosp']:.2f}x**."
            )
        out.append(section.substitute(
            n=n,
            a2a=a2a_line,
            autosp_vs_compiled=speed("autosp"),
            autosp_vs_eager=f"{tps['autosp'] / tps['ulysses_eager']:.2f}x",
            sac_vs_compiled=speed("autosp_sac"),
            long=long_line,
            sac_vs_eager=f"{tps['autosp_sac'] / tps['ulysses_eager']:.2f}x",
            saved_eager_vs_sac=f"{saved['ulysses_eager'] / saved['autosp_sac']:.2f}x",
            saved_nosac_vs_sac=f"{saved['autosp'] / saved['autosp_sac']:.2f}x",
            lengths=", ".join(f"{k} {at[k]:.0f}" for k in v if at[k]),
            sac_gain=gain("autosp_sac", "autosp"),
            handwritten_gain=gain("autosp_sac", "ulysses_eager"),
        ))
    return "\n".join(out)


def _oversubscribed(tp: dict, section: string.Template) -> str:
    """The note on oversubscription (on a new line), or ``""`` when there were enough cores."""
    cores = re.search(r"(\d+) cores", tp["machine"])
    n = max(int(k) for k in tp["runs"])
    if not cores or n <= int(cores.group(1)):
        return ""
    return "\n" + section.substitute(n=n, cores=cores.group(1))


def _impls(tp: dict) -> str:
    return " / ".join(sorted({run["ulysses"] for run in tp["runs"].values()}))


def _previous_checkpoints(ckpt: dict) -> str:
    """The sharded rows of the format before DCP (lightning-autosp 0.1's own shard files, kept in
    ``checkpoint_io_own_format.json``) next to this run's, each as a ratio to its own run's
    replicated row (the runs may be on other machines)."""
    old = _load("checkpoint_io_own_format")
    if not old:
        return ""
    ratios = []
    for results in (old, ckpt):
        rep, sh = results["rows"]["replicated"], results["rows"]["sharded"]
        ratios.append((sh["save_s"], sh["load_s"], sh["save_s"] / rep["save_s"], sh["load_s"] / rep["load_s"]))
    (os_, ol, osr, olr), (ns, nl, nsr, nlr) = ratios
    return (
        f"Against the sharded format before DCP (lightning-autosp 0.1's own shard files, the same script, results kept in "
        f"`benchmarks/results/checkpoint_io_own_format.json`): save {os_:.2f} s -> {ns:.2f} s, load {ol:.2f} s -> {nl:.2f} s; "
        f"as a ratio to the replicated row of each run, save {osr:.2f}x -> {nsr:.2f}x, load {olr:.2f}x -> {nlr:.2f}x."
    )


def render() -> str:
    tp, tr, gpu, ckpt = _load("sp_throughput"), _load("trainability"), _load("gpu_check"), _load("checkpoint_io")
    vocab, ct = _load("vocab_loss"), _load("compile_time")
    t = _sections()
    page = [t["header"].substitute()]
    if tp:
        a = tp["args"]
        page.append(t["throughput"].substitute(
            machine=tp["machine"], wall_min=f"{tp['wall_s'] / 60:.0f}", impls=_impls(tp), table=sp_throughput.markdown(tp),
            key_ratios=_key_ratios(tp, t["key_ratio"]), threads=a["threads"], reps=a["reps"],
            budget_mib=f"{a['budget_mib']:.0f}", oversubscribed=_oversubscribed(tp, t["oversubscribed"]),
        ))
    if tr:
        page.append(t["trainability"].substitute(table=trainability.markdown(tr)))
    if ckpt:
        page.append(t["checkpoints"].substitute(table=checkpoint_io.markdown(ckpt), previous=_previous_checkpoints(ckpt)))
    if vocab:
        page.append(t["vocab_loss"].substitute(table=vocab_loss.markdown(vocab)))
    if ct:
        page.append(t["compile_time"].substitute(table=compile_time.markdown(ct), wall_min=f"{ct['wall_s'] / 60:.0f}"))
    tp_fsdp, sm = _load("sp_throughput_fsdp"), _load("sharded_mode")
    if tp_fsdp and sm:
        page.append(t["sharded"].substitute(
            throughput=sp_throughput.markdown(tp_fsdp), table=sharded_mode.markdown(sm),
            tp_wall_min=f"{tp_fsdp['wall_s'] / 60:.0f}", sm_wall_min=f"{sm['wall_s'] / 60:.0f}",
        ))
    page.append(t["gpu"].substitute())
    if gpu:
        page.append(t["gpu_results"].substitute(device=gpu["device"], machine=gpu["machine"], table=gpu_check.markdown(gpu)))
    else:
        page.append(t["gpu_missing"].substitute())
    mk, causal = _load("masks"), _load("masks_causal")
    if mk:
        c = mk["config"]
        page.append(t["masks"].substitute(
            table=masks.report(mk), wall_min=f"{mk['wall_s'] / 60:.0f}", doc_len=f"{c['doc_len']:,}", window=f"{c['window']:,}",
            machine=mk["machine"], causal=masks.report(causal).split("\n\n| S | mask")[0] if causal else "(not run)",
        ))
    split = _load("sp_split")
    if split:
        page.append(t["split"].substitute(
            table=sp_split.report(split), wall_min=f"{split['wall_s'] / 60:.0f}", seq_len=f"{split['config']['seq_len']:,}",
            machine=split["machine"],
        ))
    lr = _load("long_rows")
    if lr:
        page.append(t["long_rows"].substitute(
            table=long_rows.report(lr), wall_min=f"{lr['wall_s'] / 60:.0f}", seq_len=f"{lr['config']['seq_len']:,}",
            machine=lr["machine"],
        ))
    ring = _load("ring_costs")
    if ring:
        page.append(t["ring"].substitute(table=ring_costs.markdown(ring), wall_min=f"{ring['wall_s'] / 60:.0f}", machine=ring["machine"]))
    page.append(t["reproduce"].substitute(date=time.strftime("%Y-%m-%d")))
    return "\n".join(page)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reuse", action="store_true", help="render from existing results only")
    args = p.parse_args(argv)
    if not args.reuse:
        run_all()
    PAGE.write_text(render())
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
