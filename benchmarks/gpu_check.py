"""One-GPU check of the trainability model: real allocator peaks against its predictions.

On one device, each variant of ``autosp/memory/model.py`` trains a Llama with real shapes
(default: Llama-3.2-1B with 4 layers, bf16) and the script measures, per sequence length:

* the bytes autograd keeps for backward (``saved_tensors_hooks``) and the activation peak of
  a step (``torch.cuda.max_memory_allocated`` above the level before it, with ``.grad``
  already allocated, so it includes the gradients the compiled backward returns before they
  are accumulated), next to what the model predicts from the traced graphs (``count_grads``);
* step time and tokens/s of the device's share of the work;
* the longest sequence within ``--budget-gib`` of activation memory, by doubling, measured
  and predicted.

``sp_sac_ring`` is ``sp_sac`` with a ring level under Ulysses (``sp_layout=(sp_size/2, 2)``): the
ring's exchange and kernel - the tile kernels as unfused PyTorch ops on CUDA - on the device.

The SP variants run **rank 0 of an ``--sp-size`` group alone**, on torch's ``fake`` process
group: collectives return at once without moving data, so the memory and the compute of one
rank are real and the numbers it computes are not (nothing here checks numerics; the test
suite does that on CPU). ``no_sp`` trains the whole sequence on the device.

First (``--kernels``, on by default) it checks the attention kernel table
(``benchmarks/kernel_table.py``): each case against dense attention in fp32 math, in bf16 and
fp32, the kernels each ran, and its step time through the table against the interpreted tiles;
and a Hugging Face Llama step with its mask against ``is_causal`` (with transformers installed).
``--kernels-only`` stops there.

Without CUDA it prints one line and exits 0. ``--device cpu --tiny`` runs the same code on a
small model (resident-memory peaks instead of allocator peaks), to check the script itself;
``--device cpu --rows cuda`` runs the kernel table's CUDA rows on CPU tensors, where CPU
implementations of the CUDA ops are registered (the test suite's dry run, with its emulations).
It has not run on a GPU yet (``docs/gpu.md``).

Example (well under 10 minutes on one H100/H200)::

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_check.json
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Callable, Optional

import _common  # noqa: F401  (puts the checkout on sys.path)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    GiB, MiB, PeakRSS, SavedBytes, arguments, check_steps_and_seq_lens, finish, machine, median_seconds, parser, write_json,
)

VARIANTS = ("no_sp", "sp", "sp_sac", "sp_sac_ring", "sp_sac_tiled", "sp_sac_offload", "sp_block_offload")
#: the variants not run by default (tiled MLPs, offload and whole-block recomputation: --variants)
EXTRA_VARIANTS = ("sp_sac_tiled", "sp_sac_offload", "sp_block_offload")
#: ``sp_sac_ring``: AutoSP + SAC with a ring level, ``sp_layout=(sp_size // RING, RING)``: the
#: ring's exchanges and kernel on the device (its sends go to the fake group, so the blocks it
#: computes on are not its peers'; memory and compute are a ring rank's)
RING = 2


def _layout(variant: str, args: argparse.Namespace) -> Optional[tuple[int, int]]:
    """``(ulysses, ring)`` of a variant: Ulysses alone, or a ring of :data:`RING` for ``sp_sac_ring``."""
    return (args.sp_size // RING, RING) if variant == "sp_sac_ring" else (args.sp_size, 1)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    from autosp.memory import model as mm

    p = parser(__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", choices=list(mm.PRESETS), default="llama-3.2-1b")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (the preset's shapes, fewer blocks)")
    p.add_argument("--tiny", action="store_true", help="a small model (a dry run of this script, e.g. on CPU)")
    p.add_argument("--sp-size", type=int, default=8)
    p.add_argument("--backend", choices=["inductor", "aot_eager"], default="inductor")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=[v for v in VARIANTS if v not in EXTRA_VARIANTS])
    p.add_argument("--mlp-tile", type=int, default=1024, help="rows per MLP tile of sp_sac_tiled")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--reps", type=int, default=3, help="timed steps per length (>= 1)")
    p.add_argument("--budget-gib", type=float, default=32.0, help="activation memory budget for the length search")
    p.add_argument("--search-max", type=int, default=1 << 20)
    p.add_argument("--max-minutes", type=float, default=9.0, help="stop searching once this much time has passed")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True, help="check the attention kernel table first")
    p.add_argument("--kernels-only", action="store_true", help="the kernel table's checks alone")
    p.add_argument("--kernel-seq", type=int, default=8192, help="tokens of the kernel table's checks")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="time a Hugging Face step with its mask")
    p.add_argument("--rows", choices=["cuda"], default=None, help="on CPU: the kernel table's CUDA rows (emulated CUDA ops)")
    args = p.parse_args(argv)
    check_steps_and_seq_lens(p, args, "reps")
    return args


class Device:
    """Allocator (CUDA) or resident-memory (CPU) peaks of one step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.rss = PeakRSS()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self.sync()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.rss.start()

    def stop(self) -> int:
        self.sync()
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return self.rss.stop()


def build(variant: str, cfg, args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, Callable]:
    from autosp.backend import AutoSPBackend
    from autosp.models import Llama
    from autosp.passes.offload import OffloadConfig
    from autosp.passes.sac import SACConfig

    from autosp.memory import model as mm

    torch.manual_seed(0)
    model = mm.keep_rope_fp32(Llama(cfg).to(device=device, dtype=torch.bfloat16))

    def step(ids, labels):
        logits = model(ids)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))

    if variant == "no_sp":
        return model, torch.compile(step, backend=args.backend)
    sac = SACConfig(block=variant.startswith("sp_block")) if variant.startswith(("sp_sac", "sp_block")) else None
    backend = AutoSPBackend(
        sp_size=args.sp_size, sp_rank=0, group_name=dist.group.WORLD.group_name, backend=args.backend, sac=sac,
        mlp_tile=args.mlp_tile if "tiled" in variant else None, offload=OffloadConfig(True) if variant.endswith("offload") else None,
        sp_layout=_layout(variant, args),
    )
    return model, torch.compile(step, backend=backend)


def measure(model, fn, dev: Device, S: int, reps: int, full: bool = True) -> dict:
    """Saved bytes, activation peak and step time at length ``S`` (after a warm-up step);
    ``full=False``: the peak of one step only."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, S), device=dev.device)
    labels = torch.randint(0, vocab, (1, S), device=dev.device)
    torch._dynamo.mark_dynamic(ids, 1)
    torch._dynamo.mark_dynamic(labels, 1)

    def step(saved: Optional[SavedBytes] = None) -> None:
        model.zero_grad(set_to_none=False)  # gradients stay allocated: not part of the peak
        if saved is None:
            loss = fn(ids, labels)
        else:
            with saved.hooks():
                loss = fn(ids, labels)
        loss.backward()

    if full:
        step()  # warm-up (and compile on the first length); allocates the gradients
    dev.start()
    step()
    peak = dev.stop()
    if not full:
        return {"peak": peak}
    saved = SavedBytes([*model.parameters(), *model.buffers(), ids, labels])
    step(saved)
    return {"saved": saved.total, "peak": peak, "step_s": median_seconds(step, reps, dev.sync, dev.sync)}


def run(args: argparse.Namespace, save: Callable[[dict], None] = lambda res: None) -> dict:
    """Every variant in turn; ``save`` gets the results so far after each one. Variants not
    started within ``--max-minutes`` are skipped (listed in ``skipped``)."""
    from autosp.memory import model as mm
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autosp.models import LlamaConfig

    device = torch.device(args.device)
    preset = mm.PRESETS[args.preset]["config"]
    cfg = LlamaConfig(**preset, max_seq_len=args.search_max)
    cfg = replace(cfg, n_layers=args.layers)
    if args.tiny:
        cfg = replace(cfg, vocab_size=512, dim=256, n_heads=8, n_kv_heads=8, ffn_hidden=512, n_layers=2)
    own_group = not dist.is_initialized() and not args.kernels_only
    if own_group:  # the SP variants' collectives: rank 0 alone (the kernel table's step makes its own)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.sp_size)
    dev = Device(device)
    t0 = time.perf_counter()
    budget = args.budget_gib * GiB
    res: dict = {
        "args": arguments(args), "machine": machine(), "device": _device_name(device), "config": cfg.__dict__,
        "variants": {}, "skipped": [],
    }
    out_of_time = lambda: time.perf_counter() - t0 > 60 * args.max_minutes  # noqa: E731
    if args.kernels or args.kernels_only:
        import kernel_table

        res["kernels"] = kernel_table.run(device, args.rows, args.kernel_seq, args.reps, args.hf, args.sp_size, args.backend)
        save(res)
    for variant in ([] if args.kernels_only else args.variants):
        if out_of_time():
            res["skipped"].append(variant)
            continue
        model_mem = mm.layer_model(cfg, variant.removesuffix("_ring"), args.sp_size, mlp_tile=args.mlp_tile, sp_layout=_layout(variant, args))
        model, fn = build(variant, cfg, args, device)
        rows = {}
        for S in args.seq_lens:
            r = measure(model, fn, dev, S, args.reps)
            r["predicted"] = model_mem.memory(S, count_grads=True)
            r["tokens_per_s"] = (S if variant == "no_sp" else S // args.sp_size) / r["step_s"]
            rows[S] = r
            print(
                f"{variant} S={S}: saved {r['saved'] / MiB:.0f} MiB (predicted {r['predicted']['saved'] / MiB:.0f}), "
                f"peak {r['peak'] / MiB:.0f} MiB (predicted {r['predicted']['peak'] / MiB:.0f}), {r['step_s']:.3f}s",
                flush=True,
            )
        longest, S, oom, cut = 0, min(args.seq_lens), None, False
        while S <= args.search_max:
            if out_of_time():
                cut = True
                break
            try:
                peak = measure(model, fn, dev, S, reps=0, full=False)["peak"]
            except torch.OutOfMemoryError:
                oom = S
                break
            if peak > budget:
                break
            longest, S = S, 2 * S
        predicted = max((S for S in (min(args.seq_lens) << k for k in range(24)) if S <= args.search_max
                         and model_mem.memory(S, count_grads=True)["peak"] <= budget), default=0)
        res["variants"][variant] = {
            "lengths": rows, "longest": longest, "longest_predicted": predicted, "oom_at": oom, "search_cut": cut,
        }
        del model, fn
        torch._dynamo.reset()
        if dev.cuda:
            torch.cuda.empty_cache()
        res["wall_s"] = time.perf_counter() - t0
        save(res)
    res["wall_s"] = time.perf_counter() - t0
    if own_group:
        dist.destroy_process_group()
    return res


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def markdown(res: dict) -> str:
    if "kernels" in res:
        import kernel_table

        k = res["kernels"]
        head = f"Attention kernel table on {res['device']}, {res['args']['kernel_seq']} tokens, tiles of {k['tile']}:"
        table = "\n".join([head, "", kernel_table.markdown(k["rows"], k["hf_step"])])
        return table if not res["variants"] else table + "\n\n" + _variants_markdown(res)
    return _variants_markdown(res)


def _variants_markdown(res: dict) -> str:
    a, c = res["args"], res["config"]
    lines = [
        f"{res['device']}; Llama dim={c['dim']} layers={c['n_layers']} heads={c['n_heads']} kv_heads={c['n_kv_heads']} "
        f"ffn={c['ffn_hidden']} vocab={c['vocab_size']}, bf16, {a['backend']}; SP variants run rank 0 of sp={a['sp_size']} "
        f"alone (fake process group). Peaks: {'allocator' if res['device'] != 'CPU' else 'resident memory'}, above the "
        "level before the step (weights and gradients excluded).",
        "",
        f"| variant | S | saved MiB, device + host (predicted) | measured / predicted | activation peak MiB (predicted) | measured / "
        f"predicted | step s | tokens/s on this device | longest S within {a['budget_gib']:g} GiB, measured (predicted) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v, r in res["variants"].items():
        for i, (S, x) in enumerate(r["lengths"].items()):
            p = x["predicted"]
            p_saved = p["saved"] + p.get("host", 0)  # autograd's saved tensors: on the device or offloaded to the host
            oom = f", out of memory at {r['oom_at']}" if r["oom_at"] else ""
            oom += " (search cut short by --max-minutes)" if r.get("search_cut") else ""
            longest = f"{r['longest']} ({r['longest_predicted']}){oom}" if i == 0 else ""
            lines.append(
                f"| {v} | {S} | {x['saved'] / MiB:.0f} ({p_saved / MiB:.0f}) | {x['saved'] / max(p_saved, 1):.2f} | "
                f"{x['peak'] / MiB:.0f} ({p['peak'] / MiB:.0f}) | {x['peak'] / p['peak']:.2f} | {x['step_s']:.3f} | "
                f"{x['tokens_per_s']:.0f} | {longest} |"
            )
    if res.get("skipped"):
        lines += ["", f"Not run (past --max-minutes): {', '.join(res['skipped'])}."]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> Optional[dict]:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: skipped, no CUDA device (use --device cpu --tiny for a dry run of the script)")
        return None
    return finish(run(args, save=lambda r: write_json(r, args.out)), args, markdown)


if __name__ == "__main__":
    main()
