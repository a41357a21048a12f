"""The attention kernel table on one device: each row against the math reference, fused against
the interpreted tiles, and a Hugging Face step with its mask against ``is_causal``.

For each case of the kernel table (``autosp/ops/kernels.py``, rendered in ``docs/pass.md``) this
runs AutoSP's tiled attention op, forward and backward, on ``--seq-len`` tokens (a rank's heads:
``--heads`` query heads over ``--kv-heads``, GQA) in bf16 and fp32, and

* compares its output and the gradients of q, k, v with dense attention in fp32 math (fp64 on
  CPU), written out from the same score program: the largest difference over the largest value,
  within 1e-4 (fp32) or 2e-2 (bf16); the kernels each case ran are listed (the table's);
* times it (median of ``--reps`` forward + backward steps) through the table and through the
  interpreted tiles alone (``AUTOSP_KERNEL_ROWS=tiles``): the ratio is what the fused rows buy;
* with ``--hf``: times a whole Hugging Face Llama step under AutoSP (rank 0 of ``--sp-size`` on
  torch's fake process group, as ``gpu_check.py`` runs its variants) called with
  ``use_cache=False`` - its mask, exactly causal for these rows, through the table's causal row -
  against the same model with plain ``is_causal`` attention.

``gpu_check.py`` runs it on a GPU (``--kernels``). On CPU, ``--rows cuda`` makes the CPU tensors
take the CUDA rows, which needs CPU implementations of the CUDA ops registered first (the test
suite's ``tests/cuda_emulation.py``: its dry run of this script).

Nothing here has run on a GPU yet.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional

import _common  # noqa: F401  (puts the checkout on sys.path)
import torch
import torch.nn.functional as F
from _common import median_seconds

from autosp.ops import kernels, programs
from autosp.ops.score_program import ScoreProgram, tile_positions
from autosp.ops.tiled_attention import attend, default_tile

#: name -> (program builder (seq, scale, dtype, batch) -> (text, leaves), the table cases it reaches)
CASES: dict[str, tuple[Callable, str]] = {
    "a: exactly causal (Hugging Face's mask, one document)": (lambda S, sc, dt: programs.causal(S, sc, dt), "causal"),
    "b+c: packed documents (8) with padding": (
        lambda S, sc, dt: programs.causal(S, sc, dt, documents=torch.arange(S) * 8 // S, keys=_pad(S, right=S // 64)), "bias, block"),
    "c: a sliding window of 1/8 of the row": (lambda S, sc, dt: programs.causal(S, sc, dt, window=S // 8), "bias, block"),
    "d: soft-capping (Gemma-2)": (lambda S, sc, dt: programs.soft_capped_causal(S, sc, 50.0, dt), "score"),
    "f: left padding under a finite fill": (lambda S, sc, dt: programs.padded_with_finite_fill(S, _pad(S, left=S // 64), sc, dt), "keyless"),
}


def _pad(S: int, left: int = 0, right: int = 0) -> torch.Tensor:
    keys = torch.ones(1, S, dtype=torch.bool)
    keys[:, :left] = False
    if right:
        keys[:, S - right:] = False
    return keys


def dense(text: str, leaves: list, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Attention with the program's logits over the whole ``S x S``, in ``dtype`` math (rows with
    no key: 0, as SDPA gives them)."""
    prog = ScoreProgram.parse(text)
    S, r = q.shape[2], q.shape[1] // k.shape[1]
    s = q.to(dtype) @ k.to(dtype).repeat_interleave(r, 1).transpose(-1, -2)
    z = prog.evaluate(s, leaves, tile_positions(prog, 0, S, 0, S, q.device)).to(dtype)
    dead = (z == -math.inf).all(-1, keepdim=True)
    p = torch.softmax(torch.where(dead, 0.0, z), -1).masked_fill(dead, 0.0)
    return p @ v.to(dtype).repeat_interleave(r, 1)


def _step(q, k, v, leaves, text, tile, grad):
    out = attend(q, k, v, leaves, text, tile)
    return out, torch.autograd.grad(out, (q, k, v), grad)


def check_rows(
    device: torch.device, rows: Optional[str], seq: int, heads: int, kv_heads: int, head_dim: int, tile: int, reps: int,
    dtypes: tuple = (torch.bfloat16, torch.float32), sync: Callable[[], None] = lambda: None,
) -> list[dict]:
    """Every case of :data:`CASES` in every dtype: its kernels, its errors against :func:`dense`,
    and its step time through the table and through the tiles alone."""
    ref_dtype = torch.float64 if device.type == "cpu" else torch.float32
    out_rows = []
    for name, (build, cases) in CASES.items():
        for dtype in dtypes:
            text, leaves = build(seq, 1 / math.sqrt(head_dim), dtype)
            leaves = [x.to(device) for x in leaves]
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(1, seq, h, head_dim, generator=g, device=device).to(dtype).transpose(1, 2).requires_grad_()
                       for h in (heads, kv_heads, kv_heads))  # laid out as the SP pass's exchange hands them
            grad = torch.randn(1, heads, seq, head_dim, generator=g, device=device).to(dtype)
            kernels.KERNEL_COUNTS.clear()
            with kernels.kernel_rows(rows):
                out, grads = _step(q, k, v, leaves, text, tile, grad)
            used = sorted({f"{case}: {kernel}" for case, kernel in kernels.KERNEL_COUNTS})
            x = [t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v)]
            ref = dense(text, leaves, *x, ref_dtype)
            ref_grads = torch.autograd.grad(ref, x, grad.to(ref_dtype))
            ref = ref.detach()
            err = float((out.detach().to(ref_dtype) - ref).abs().max() / ref.abs().max())
            grad_err = max(float((a.to(ref_dtype) - b).abs().max() / b.abs().max()) for a, b in zip(grads, ref_grads))
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            del ref, ref_grads, x
            timed = {}
            for label, forced in (("table", rows), ("tiles", "tiles")):
                with kernels.kernel_rows(forced):
                    timed[label] = median_seconds(lambda: _step(q, k, v, leaves, text, tile, grad), reps, sync, sync) if reps else None
            out_rows.append({
                "case": name, "table_cases": cases, "dtype": str(dtype).removeprefix("torch."), "kernels": used,
                "out_err": err, "grad_err": grad_err, "tol": tol, "ok": err <= tol and grad_err <= tol,
                "table_s": timed["table"], "tiles_s": timed["tiles"],
            })
    return out_rows


def hf_mask_step(
    device: torch.device, seq: int, sp_size: int, reps: int, backend: str, sync: Callable[[], None], hidden: int = 1024,
    layers: int = 4,
) -> dict:
    """Step time of a Hugging Face Llama (``layers`` of ``hidden``, 16 heads over 4 KV heads, bf16)
    under AutoSP, rank 0 of ``sp_size`` on torch's fake process group: called with
    ``use_cache=False`` (its mask, exactly causal here: the table's causal row) and with plain
    ``is_causal`` attention."""
    try:
        import transformers
    except ImportError:
        return {"skipped": "transformers is not installed"}
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autosp.backend import AutoSPBackend
    from autosp.passes.sac import SACConfig

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sp_size)
    transformers.AttentionInterface.register("autosp_bench_is_causal", _is_causal_attention)
    res = {}
    for label, impl in (("mask", "sdpa"), ("is_causal", "autosp_bench_is_causal")):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(
            vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers, num_attention_heads=16,
            num_key_value_heads=4, max_position_embeddings=seq, attn_implementation=impl,
        )
        model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
        ids = torch.randint(0, 8192, (1, seq), device=device)
        torch._dynamo.mark_dynamic(ids, 1)
        be = AutoSPBackend(sp_size=sp_size, sp_rank=0, group_name=dist.group.WORLD.group_name, backend=backend, sac=SACConfig())
        fn = torch.compile(lambda m, x: m(input_ids=x, labels=x, use_cache=False).loss, backend=be)

        def step() -> None:
            fn(model, ids).backward()

        step()  # compile
        kernels.KERNEL_COUNTS.clear()
        step()
        res[label] = {"step_s": median_seconds(step, reps, sync, sync), "kernels": sorted(f"{c}: {k}" for c, k in kernels.KERNEL_COUNTS)}
        del model, fn
        torch._dynamo.reset()
    res["ratio"] = res["mask"]["step_s"] / res["is_causal"]["step_s"]
    if own_group:
        dist.destroy_process_group()
    return res


def _is_causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def markdown(rows: list[dict], hf: Optional[dict]) -> str:
    lines = [
        "| case | dtype | kernels run | out err | grad err | tolerance | step s (table) | step s (tiles) | tiles / table |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['tiles_s'] / r['table_s']:.2f}" if r["table_s"] else ""
        times = (f"{r['table_s']:.4f}", f"{r['tiles_s']:.4f}") if r["table_s"] else ("", "")
        lines.append(
            f"| {r['case']} | {r['dtype']} | {', '.join(r['kernels'])} | {r['out_err']:.1e} | {r['grad_err']:.1e} | "
            f"{r['tol']:g}{'' if r['ok'] else ' FAILED'} | {times[0]} | {times[1]} | {ratio} |"
        )
    if hf:
        if "skipped" in hf:
            lines += ["", f"Hugging Face step: skipped ({hf['skipped']})."]
        else:
            lines += ["", f"Hugging Face Llama step, its mask (use_cache=False) / is_causal: {hf['mask']['step_s']:.3f} s / "
                          f"{hf['is_causal']['step_s']:.3f} s = {hf['ratio']:.2f}x (kernels: {', '.join(hf['mask']['kernels'])})"]
    return "\n".join(lines)


def run(device: torch.device, rows: Optional[str], seq: int, reps: int, hf: bool, sp_size: int, backend: str,
        heads: int = 8, kv_heads: int = 2, head_dim: int = 128) -> dict:
    """:func:`check_rows` (and :func:`hf_mask_step` with ``hf``) with the device's default tile."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    tile = default_tile(torch.device("cuda") if rows == "cuda" else device)
    res = {"rows": check_rows(device, rows, seq, heads, kv_heads, head_dim, tile, reps, sync=sync), "tile": tile}
    res["hf_step"] = hf_mask_step(device, seq, sp_size, reps, backend, sync) if hf else None
    res["wall_s"] = time.perf_counter() - t0
    return res
