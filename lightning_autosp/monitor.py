"""``ActivationMemoryMonitor``: bytes saved for backward per op kind, per training step and rank."""

from __future__ import annotations

import importlib.util
import os
import resource
import sys
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from autosp.backend import AOT_BACKENDS, CompiledStep
from autosp.passes.accounting import OP_KINDS
from autosp.memory.eager import EagerSavedTensors
from lightning_autosp.strategy import AutoSPStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ActivationMemoryMonitor", "plot_saved_bytes", "format_summary", "summarize"]

_MiB = float(1 << 20)


class ActivationMemoryMonitor(Callback):
    """Log the bytes each training step saves for backward, grouped by op kind, on every rank.

    Works with :class:`~lightning_autosp.AutoSPStrategy` and without it, so runs can be compared:

    * under AutoSP (``compile_backend="aot_eager"`` or ``"inductor"``) the figures are those of the
      compiled training graph: the tensors its forward hands to its backward, after the SAC
      partition, sized for the step's sequence length (no runtime overhead), read from
      :attr:`AutoSPStrategy.compiled_steps <lightning_autosp.AutoSPStrategy.compiled_steps>`;
    * otherwise (one device, plain DDP) one eager forward is instrumented: every allocation is
      attributed to the aten op and module that made it, and every tensor autograd saves is
      counted once per allocation (some overhead on measured steps; see ``every_n_steps``).

    Either way a saved tensor counts for the kind of op that *produced* it
    (:data:`~autosp.passes.accounting.OP_KINDS`: ``attention``, ``all_to_all``, ``linear`` - matmuls
    and MLP activations -, ``norm``, ``embedding``, ``loss``, ``other``); parameters and the
    batch are not counted.

    Metric keys, logged by rank zero through the Trainer's loggers for every rank ``r``
    (``prefix`` defaults to ``"activation_memory"``), at ``step`` = the Trainer's ``global_step``
    when the batch started (0 for the first):

    * ``{prefix}/rank{r}/saved_{kind}_bytes`` for each kind above;
    * ``{prefix}/rank{r}/saved_total_bytes``: their sum;
    * ``{prefix}/rank{r}/peak_bytes``: peak memory - on CUDA the allocator's peak during the step
      (``torch.cuda.max_memory_allocated``, reset at each measured step), on CPU the process's
      peak resident set size since it started (``ru_maxrss``).

    At the end of fit, rank zero logs a table (per kind: mean over steps, mean and max over
    ranks; :attr:`summary` holds the per-rank means) and, with ``plot_path``, writes a PNG bar
    chart of the kinds per rank (needs matplotlib: ``pip install 'lightning-autosp[plot]'``).

    Args:
        every_n_steps: measure the batches run while ``trainer.global_step % every_n_steps == 0``.
        plot_path: where rank zero writes the bar chart at the end of fit (``None``: no chart).
        prefix: first part of every metric key.
        log_summary: log the summary table at the end of fit.
    """

    def __init__(
        self,
        every_n_steps: int = 1,
        plot_path: Optional[Union[str, os.PathLike]] = None,
        prefix: str = "activation_memory",
        log_summary: bool = True,
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"ActivationMemoryMonitor(every_n_steps={every_n_steps!r}): expected an int >= 1.")
        if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
            raise ModuleNotFoundError(
                "ActivationMemoryMonitor(plot_path=...) draws its chart with matplotlib, which is not installed. "
                "Install it with `pip install 'lightning-autosp[plot]'` or pass plot_path=None."
            )
        self.every_n_steps = every_n_steps
        self.plot_path = None if plot_path is None else os.fspath(plot_path)
        self.prefix = prefix
        self.log_summary = log_summary
        #: rank zero: one entry per measured batch and rank: {"step", "rank", kinds..., "total", "peak"}
        self.history: list[dict[str, float]] = []
        #: rank zero, after fit: {"rank{r}": {kind: mean bytes, "total": ..., "peak": ...}}
        self.summary: dict[str, dict[str, float]] = {}
        self._eager = EagerSavedTensors()
        self._measuring = False
        self._step = 0
        self._mode: Optional[str] = None
        self._before: Optional[CompiledStep] = None
        self._by_kind: Optional[dict[str, int]] = None
        self._warned = False

    # ---------------------------------------------------------------- sources
    @staticmethod
    def _compiled_training_step(trainer: "pl.Trainer") -> Optional[CompiledStep]:
        """What an AutoSP strategy with an AOT backend compiled for ``training_step``, else ``None``."""
        st = trainer.strategy
        if not isinstance(st, AutoSPStrategy) or st.compile_backend not in AOT_BACKENDS:
            return None
        return st.compiled_steps.get("training_step")

    @staticmethod
    def _uses_autosp(trainer: "pl.Trainer") -> bool:
        return isinstance(trainer.strategy, AutoSPStrategy)

    # ---------------------------------------------------------------- hooks
    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        self._step = trainer.global_step
        self._measuring = self._step % self.every_n_steps == 0
        self._by_kind = None
        if not self._measuring:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        compiled = self._compiled_training_step(trainer)
        if compiled is not None:
            self._mode = "compiled"
            self._before = compiled
        elif self._uses_autosp(trainer):
            self._mode = None  # compiled with eager autograd: no saved-activation figures
            if not self._warned:
                rank_zero_warn(
                    "ActivationMemoryMonitor: per-op figures under AutoSPStrategy need compile_backend='aot_eager' "
                    "or 'inductor'; only peak memory is logged."
                )
                self._warned = True
        else:
            self._mode = "eager"
            self._eager.start(pl_module)

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        if self._measuring and self._mode == "eager" and self._eager.active:
            self._by_kind = self._eager.stop()

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._measuring:
            return
        self._measuring = False
        by_kind = self._step_by_kind(trainer)
        row = [float("nan")] * (len(OP_KINDS) + 1) if by_kind is None else [float(by_kind[k]) for k in OP_KINDS]
        if by_kind is not None:
            row.append(float(sum(by_kind.values())))
        row.append(float(_peak_bytes(pl_module.device)))
        gathered = _gather_rows(torch.tensor(row, dtype=torch.float64, device=pl_module.device))
        if trainer.global_rank != 0:
            return
        step = self._step
        metrics: dict[str, float] = {}
        for r, vals in enumerate(gathered.tolist()):
            entry = {"step": float(step), "rank": float(r)}
            for k, v in zip((*OP_KINDS, "total", "peak"), vals):
                entry[k] = v
                key = f"{self.prefix}/rank{r}/peak_bytes" if k == "peak" else f"{self.prefix}/rank{r}/saved_{k}_bytes"
                if v == v:  # not NaN
                    metrics[key] = v
            self.history.append(entry)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _step_by_kind(self, trainer: "pl.Trainer") -> Optional[dict[str, int]]:
        if self._mode == "eager":
            if self._eager.active:  # no backward this batch (skipped step)
                self._by_kind = self._eager.stop()
            return self._by_kind
        compiled = self._compiled_training_step(trainer) if self._mode == "compiled" else None
        if compiled is None:
            return None
        try:
            return compiled.saved_bytes_by_kind(since=self._before)
        except ValueError as err:  # a size that the graph inputs do not determine
            if not self._warned:
                rank_zero_warn(f"ActivationMemoryMonitor: cannot size a compiled graph's saved tensors: {err}")
                self._warned = True
            return None

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._eager.close()
        if trainer.global_rank != 0 or not self.history:
            return
        self.summary = summarize(self.history)
        if self.log_summary:
            rank_zero_info("Activation memory (bytes saved for backward per op kind):\n" + format_summary(self.summary))
        if self.plot_path is not None:
            ranks = sorted(self.summary, key=lambda r: int(r.removeprefix("rank")))
            series = {r: self.summary[r] for r in ranks} if len(ranks) <= 8 else _mean_max(self.summary)
            plot_saved_bytes(series, self.plot_path, title="Activation memory saved for backward, by op kind")
            rank_zero_info(f"ActivationMemoryMonitor: wrote {self.plot_path}")

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._eager.close()  # leave no dispatch mode or saved-tensor hooks behind

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._eager.close()


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def summarize(history: list[Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per rank, the mean over measured steps of every column of ``history``."""
    sums: dict[int, dict[str, float]] = {}
    counts: dict[int, int] = {}
    for e in history:
        r = int(e["rank"])
        acc = sums.setdefault(r, {k: 0.0 for k in (*OP_KINDS, "total", "peak")})
        for k in acc:
            acc[k] += e[k]
        counts[r] = counts.get(r, 0) + 1
    return {f"rank{r}": {k: v / counts[r] for k, v in acc.items()} for r, acc in sorted(sums.items())}


def _mean_max(summary: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    ranks = list(summary.values())
    keys = (*OP_KINDS, "total", "peak")
    return {
        "mean over ranks": {k: sum(r[k] for r in ranks) / len(ranks) for k in keys},
        "max over ranks": {k: max(r[k] for r in ranks) for k in keys},
    }


def format_summary(summary: Mapping[str, Mapping[str, float]]) -> str:
    """A plain-text table: per op kind, MiB saved for backward (mean over steps), the mean and
    max over ranks, and the kind's share of the total."""
    mm = _mean_max(summary)
    mean, peak = mm["mean over ranks"], mm["max over ranks"]
    total = mean["total"]
    lines = [f"{'op kind':<12} {'mean MiB':>12} {'max MiB':>12} {'share':>7}"]
    for k in OP_KINDS:
        share = f"{100 * mean[k] / total:6.1f}%" if total and total == total else "    n/a"
        lines.append(f"{k:<12} {mean[k] / _MiB:12.3f} {peak[k] / _MiB:12.3f} {share:>7}")
    lines.append(f"{'total':<12} {mean['total'] / _MiB:12.3f} {peak['total'] / _MiB:12.3f} {'':>7}")
    lines.append(f"{'peak memory':<12} {mean['peak'] / _MiB:12.3f} {peak['peak'] / _MiB:12.3f} {'':>7}")
    lines.append(f"({len(summary)} rank(s))")
    return "\n".join(lines)


def plot_saved_bytes(
    series: Mapping[str, Mapping[str, float]], path: Union[str, os.PathLike], title: Optional[str] = None
) -> None:
    """Write a PNG bar chart: MiB per op kind (x axis), one bar per entry of ``series``
    (e.g. ``{"rank0": {...}, "rank1": {...}}`` or ``{"SAC": {...}, "no SAC": {...}}``).

    Needs matplotlib (``pip install 'lightning-autosp[plot]'``); draws without pyplot, so it
    touches no global plotting state.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ModuleNotFoundError(
            "plot_saved_bytes needs matplotlib: `pip install 'lightning-autosp[plot]'`."
        ) from err
    labels = list(series)
    fig = Figure(figsize=(max(6.0, 1.2 * len(OP_KINDS)), 4.0), tight_layout=True)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(OP_KINDS))]
        ax.bar(xs, [series[label].get(k, 0.0) / _MiB for k in OP_KINDS], width=width, label=label)
    ax.set_xticks(range(len(OP_KINDS)), list(OP_KINDS))
    ax.set_ylabel("MiB saved for backward")
    if title:
        ax.set_title(title)
    if len(labels) > 1:
        ax.legend()
    fig.savefig(os.fspath(path), format="png", dpi=100)


def _gather_rows(row: torch.Tensor) -> torch.Tensor:
    """Every rank's ``row``, stacked in rank order, on the CPU. torch.distributed's list
    all-gather: Lightning's ``all_gather`` goes through APIs torch 2.13 deprecates (a warning
    per call)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return row[None].cpu()
    parts = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, row)
    return torch.stack(parts).cpu()
