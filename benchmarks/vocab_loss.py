"""The vocabulary projection and loss with and without the full logits (``chunked_loss``).

Two processes (sp=2, CPU/gloo) train the part of a language model where the logits live - a
token embedding, an RMSNorm, an untied ``dim x vocab`` output projection and the token-mean
cross-entropy - under the AutoSP backend (aot_eager, SAC on), once with the fused, chunked loss
(``chunked_loss=True``) and once keeping the logits (``chunked_loss=False``), side by side on
the same batches and weights. Per configuration (sequence length S, vocabulary V), rank 0:

* **saved**: the bytes the forward keeps for backward (the compile's record, at this S);
* **step peak**: the resident-memory peak of one forward+backward above the level before it
  (``/proc/self/status`` high-water mark; glibc returns large frees at once);
* **step time**: the median of ``--steps`` timed steps (the slower rank's; the two variants
  alternate; one step where only the fused variant runs);
* the loss and gradient differences between the two (the fused loss is exact).

A configuration whose logits would not fit (``--max-logits-gib`` per process for the fp32
logits, their gradient and softmax) is not run with ``chunked_loss=False``; its saved bytes
then come from its compile's record, which is symbolic in S (compiled on a run length, or on a
2048-token step where no length of that V fits). The table shows what was measured and what was derived.

Example (the figures in BENCHMARKS.md)::

    .venv/bin/python benchmarks/vocab_loss.py --out benchmarks/results/vocab_loss.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import _common  # noqa: F401  (puts the checkout on sys.path)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import GiB, MiB, PeakRSS, arguments, finish, machine, parser, ratio, run_distributed

from autosp.backend import AutoSPBackend
from autosp.ops.fused_loss import auto_chunk_rows
from autosp.passes.sac import SACConfig

VARIANTS = {"fused": 0, "logits": None}  # chunked_loss=True / False


class Head(torch.nn.Module):
    """Embedding, RMSNorm and an untied output projection: the logits' end of a decoder."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.RMSNorm(dim)
        self.out = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.embed(ids)))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = parser(__doc__, threads=True)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--vocabs", type=int, nargs="+", default=[32768, 128256])
    p.add_argument("--dim", type=int, default=64, help="hidden size (small: the logits are what is measured)")
    p.add_argument("--sp-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant and configuration (>= 1)")
    p.add_argument("--max-logits-gib", type=float, default=3.0,
                   help="run chunked_loss=False only where 3 fp32 logits-sized tensors per process fit in this")
    args = p.parse_args(argv)
    _common.check_steps_and_seq_lens(p, args, "steps")
    return args


def _logits_gib(S: int, V: int, sp: int) -> float:
    return 3 * (S // sp) * V * 4 / GiB



def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    group = dist.group.WORLD.group_name
    out: dict = {"args": arguments(args), "machine": machine(), "configs": []}
    for V in args.vocabs:
        torch.manual_seed(0)
        model = Head(V, args.dim)
        backends = {
            name: AutoSPBackend(sp_size=args.sp_size, sp_rank=rank, group_name=group, backend="aot_eager", sac=SACConfig(),
                                loss_chunk=chunk)
            for name, chunk in VARIANTS.items()
        }

        def make_step(backend):
            def step(ids, labels):
                logits = model(ids)
                return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
            return torch.compile(step, backend=backend)

        steps = {name: make_step(b) for name, b in backends.items()}
        if not any(_logits_gib(S, V, args.sp_size) <= args.max_logits_gib for S in args.seq_lens):
            # no length of this V runs with the logits: one short step compiles it, so that its
            # (symbolic) record gives the saved bytes at every length
            short, short_labels = torch.randint(0, V, (1, 2048)), torch.randint(0, V, (1, 2048))
            torch._dynamo.mark_dynamic(short, 1)
            torch._dynamo.mark_dynamic(short_labels, 1)
            steps["logits"](short, short_labels).backward()
        for S in sorted(args.seq_lens):
            g = torch.Generator().manual_seed(S)
            ids = torch.randint(0, V, (1, S), generator=g)
            labels = torch.randint(0, V, (1, S), generator=g)
            labels[:, ::7] = -100
            torch._dynamo.mark_dynamic(ids, 1)
            torch._dynamo.mark_dynamic(labels, 1)
            fits = _logits_gib(S, V, args.sp_size) <= args.max_logits_gib
            row: dict = {"S": S, "V": V, "chunk_rows": auto_chunk_rows(V), "run": {}}
            grads, losses = {}, {}
            names = [name for name in VARIANTS if name == "fused" or fits]
            times: dict = {name: [] for name in names}
            peaks: dict = {name: [] for name in names}
            reps = args.steps if fits else 1  # nothing to compare the time with
            for rep in range(reps + 1):  # the first call compiles (or checks guards); variants alternate
                for name in names:
                    model.zero_grad(set_to_none=True)
                    probe = PeakRSS()
                    dist.barrier()
                    probe.start()
                    t = time.perf_counter()
                    loss = steps[name](ids, labels)
                    loss.backward()
                    dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
                    peak = probe.stop()
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                    if rep:
                        times[name].append(float(dt))
                        peaks[name].append(peak)
                    if rep == reps:
                        losses[name] = float(loss.detach())
                        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
            for name in names:
                record = backends[name].saved_activations[-1]
                row["run"][name] = {
                    "step_s": statistics.median(times[name]), "peak_bytes": max(peaks[name]),
                    "saved_bytes": sum(record.bytes_by_kind().values()), "saved_by_kind": record.bytes_by_kind(),
                }
            if "logits" not in row["run"]:  # saved bytes from the (symbolic) record of a run length
                record = backends["logits"].saved_activations[-1] if backends["logits"].saved_activations else None
                if record is not None:
                    row["derived_logits_saved_bytes"] = sum(record.bytes_by_kind(record.binding_at(S)).values())
            if len(losses) == 2:
                row["loss_rel_diff"] = abs(losses["fused"] - losses["logits"]) / abs(losses["logits"])
                row["grad_rel_diff"] = max(
                    float((grads["fused"][n] - grads["logits"][n]).norm() / grads["logits"][n].norm()) for n in grads["logits"]
                )
            out["configs"].append(row)
            if rank == 0:
                r = row["run"]
                print(f"S={S} V={V}: " + ", ".join(f"{n} {v['step_s']:.2f}s peak {v['peak_bytes'] / MiB:.0f} MiB"
                                                   for n, v in r.items()), flush=True)
        steps = backends = {}  # free this vocabulary's compiled steps before the next
        torch._dynamo.reset()
    return out


def markdown(res: dict) -> str:
    a = res["args"]
    lines = [
        f"sp={a['sp_size']} on CPU ({res['machine']}), {a['threads']} thread(s) per process; rank 0 of an embedding + "
        f"RMSNorm + untied dim={a['dim']} x V projection + token-mean cross-entropy (every 7th target ignored), fp32, "
        "AutoSP backend (aot_eager, SAC on). `fused`: `chunked_loss=True`; `logits`: `chunked_loss=False`.",
        "",
        "| S | V | rows per chunk | saved, fused MiB | saved, logits MiB | saved ratio | step peak, fused MiB | "
        "step peak, logits MiB | peak ratio | step time ratio (fused / logits) | loss / grad rel. diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in res["configs"]:
        f, l = row["run"]["fused"], row["run"].get("logits")
        if l is not None:
            saved_l, peak_l = f"{l['saved_bytes'] / MiB:,.0f}", f"{l['peak_bytes'] / MiB:,.0f}"
            ratios = (ratio(f["saved_bytes"], l["saved_bytes"]), ratio(f["peak_bytes"], l["peak_bytes"]),
                      ratio(f["step_s"], l["step_s"]))
            diff = f"{row['loss_rel_diff']:.1e} / {row['grad_rel_diff']:.1e}"
        else:
            derived = row.get("derived_logits_saved_bytes")
            saved_l = f"{derived / MiB:,.0f} (from the record)" if derived is not None else "-"
            need = _logits_gib(row["S"], row["V"], a["sp_size"])
            peak_l = f"not run (logits and gradient {need:.0f} GiB)"
            ratios = (ratio(f["saved_bytes"], derived) if derived else "-", "-", "-")
            diff = "-"
        lines.append(
            f"| {row['S']:,} | {row['V']:,} | {row['chunk_rows']} | {f['saved_bytes'] / MiB:,.0f} | {saved_l} | {ratios[0]} | "
            f"{f['peak_bytes'] / MiB:,.0f} | {peak_l} | {ratios[1]} | {ratios[2]} | {diff} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    res = run_distributed(run, args.sp_size, args, threads=args.threads)
    return finish(res, args, markdown)


if __name__ == "__main__":
    main()
