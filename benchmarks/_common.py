"""Helpers shared by the benchmark scripts: arguments and the end of ``main``, process launch,
memory probes, formatting.

Benchmarks run from a source checkout (``python benchmarks/<script>.py``); importing this
module puts the checkout on ``sys.path``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = float(1 << 20)
GiB = float(1 << 30)

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


#: the Llama shape flags (``--dim``, ...) of the scripts that train a small Llama
MODEL_FLAGS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size")


def parser(
    doc: Optional[str], *, plot: Optional[str] = None, threads: bool = False, model: Optional[dict[str, int]] = None
) -> argparse.ArgumentParser:
    """A benchmark script's argument parser: ``doc`` (its docstring) as the description and
    ``--out`` (the results as JSON); with ``plot`` (what the chart shows) ``--plot``; with
    ``threads`` ``--threads``; with ``model`` (a default per :data:`MODEL_FLAGS` entry) the
    Llama shape flags."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (model or {}).items():
        if name not in MODEL_FLAGS:
            raise ValueError(f"parser(model=...): unknown flag {name!r}; known: {list(MODEL_FLAGS)}")
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    if threads:
        p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    p.add_argument("--out", type=str, default=None, help="write the results as JSON here")
    if plot is not None:
        p.add_argument("--plot", type=str, default=None, help=f"{plot} (PNG)")
    return p


def check_steps_and_seq_lens(p: argparse.ArgumentParser, args: argparse.Namespace, steps: str) -> None:
    """Stop with a usage error unless ``--<steps>`` is >= 1 and every ``--seq-lens`` value
    is divisible by ``--sp-size``."""
    if getattr(args, steps) < 1:
        p.error(f"--{steps} must be >= 1")
    for S in args.seq_lens:
        if S % args.sp_size:
            p.error(f"--seq-lens: {S} is not divisible by --sp-size {args.sp_size}")


def llama_config(args: Any, **extra: Any) -> Any:
    """The ``LlamaConfig`` of the shape flags in ``args`` (a namespace or a results file's
    ``args`` dict), with ``extra`` fields (``max_seq_len``)."""
    from autosp.models import LlamaConfig

    values = args if isinstance(args, dict) else vars(args)
    return LlamaConfig(**{k: values[k] for k in MODEL_FLAGS}, **extra)


def arguments(args: argparse.Namespace) -> dict[str, Any]:
    """``vars(args)`` for a results file, with ``--out``/``--plot`` relative to the checkout
    (a results file names no machine's directories)."""
    out = dict(vars(args))
    for key in ("out", "plot"):
        if out.get(key):
            path = Path(out[key]).resolve()
            out[key] = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    return out


def finish(
    results: dict, args: argparse.Namespace, markdown: Callable[[dict], str],
    plot: Optional[Callable[[dict, str], None]] = None,
) -> dict:
    """The end of every script's ``main``: print the table (and the wall time, if measured),
    write the JSON (``--out``) and the chart (``--plot``)."""
    print(markdown(results))
    if "wall_s" in results:
        print(f"wall time {results['wall_s']:.0f}s")
    write_json(results, args.out)
    if plot is not None and getattr(args, "plot", None):
        plot(results, args.plot)
    return results


def median_seconds(fn: Callable[[], Any], reps: int, before: Callable[[], Any], after: Optional[Callable[[], Any]] = None) -> float:
    """The median wall time of ``reps`` calls of ``fn``, each timed from ``before()`` (a barrier,
    a device sync) to the end of ``after()`` (if given)."""
    times = []
    for _ in range(reps):
        before()
        t = time.perf_counter()
        fn()
        if after is not None:
            after()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker: Callable[..., Any], nprocs: int, *args: Any) -> Any:
    """Run ``worker(rank, nprocs, port, out_dir, *args)`` in ``nprocs`` forked processes and
    return what rank 0 saved with ``torch.save(result, out_dir / "result.pt")``."""
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(worker, args=(nprocs, free_port(), d, *args), nprocs=nprocs, start_method="fork")
        return torch.load(os.path.join(d, "result.pt"), weights_only=False)


def _run_worker(rank: int, world: int, port: int, out_dir: str, run: Callable[..., dict], threads: int, args: Any) -> None:
    init_worker(rank, world, port, threads)
    try:
        result = run(rank, world, args)
        if rank == 0:
            torch.save(result, os.path.join(out_dir, "result.pt"))
    finally:
        torch.distributed.destroy_process_group()


def run_distributed(run: Callable[[int, int, Any], dict], nprocs: int, args: Any, threads: int = 1) -> dict:
    """``run(rank, world, args)`` in ``nprocs`` forked processes with a gloo group
    (:func:`init_worker`); rank 0's result, with the wall time of the whole launch as ``wall_s``."""
    t = time.perf_counter()
    res = launch(_run_worker, nprocs, run, threads, args)
    res["wall_s"] = time.perf_counter() - t
    return res


def init_worker(rank: int, world_size: int, port: int, threads: int) -> None:
    """Per-process setup: threads, a gloo group, and glibc returning large frees to the OS
    at once (so that resident memory follows live tensors and peaks are comparable)."""
    torch.set_num_threads(threads)
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    except OSError:  # not glibc: peaks stay measurable, only noisier
        pass
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)


def _status_kib(field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(m.group(1)) if m else 0


class PeakRSS:
    """Peak resident memory of this process above its level at :meth:`start` (Linux).

    ``start`` resets the kernel's high-water mark (``/proc/self/clear_refs``), so the
    peak of one step is measured on its own, in bytes."""

    def start(self) -> None:
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        self.base = _status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")

    def stop(self) -> int:
        return max(0, _status_kib("VmHWM") - self.base) * 1024


class SavedBytes:
    """Bytes autograd keeps for backward during a forward (``saved_tensors_hooks``), each
    storage once, leaving out ``exclude`` (parameters and inputs)."""

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        from autosp.modes.sharded.values import local_tensor  # (a sharded parameter's storage is its shard's)

        self.exclude = {local_tensor(t).untyped_storage().data_ptr() for t in exclude}
        self.kept: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        from autosp.modes.sharded.values import local_tensor

        storage = local_tensor(t).untyped_storage()
        if storage.data_ptr() not in self.exclude:
            self.kept[storage.data_ptr()] = storage.nbytes()
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.kept.values())


def ratio(a: float, b: float) -> str:
    return "inf" if b == 0 and a > 0 else ("1.00x" if a == b == 0 else f"{a / b:.2f}x")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        model = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = model.group(1) if model else cpu
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


def plot_panels(panels: dict[str, dict[str, tuple[list, list]]], path: str, ylabel: str, hline: tuple[float, str]) -> None:
    """One log-log panel per entry of ``panels`` (title -> label -> (xs, ys)), a dashed
    horizontal line at ``hline = (y, label)``, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, (title, curves) in zip(axes[0], panels.items()):
        for label, (xs, ys) in curves.items():
            ax.plot(xs, ys, marker="o", label=label)
        ax.axhline(hline[0], color="gray", linestyle="--", label=hline[1])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(results: dict, path: Optional[str]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=1, default=str))
