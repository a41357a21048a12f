"""Ops the SP pass cannot run on the rank's tokens: run replicated (exact), loud when they hold a
real share of the step's memory, and an error with ``strict=True``."""

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from sp_harness import VOCAB, trace_rank

from lightning_autosp import AutoSPStrategy
from autosp.errors import AutoSPError
from lightning_autosp.fabric import AutoSPStrategy as FabricAutoSP
from autosp.passes.rewrite import SPPassStats
from autosp.steps import LOUD_FALLBACK, StepConfig, StepRunner

B, S, H, D = 2, 24, 4, 8


class CumsumLM(nn.Module):
    """Attention, then a running sum over the sequence (no SP rule: it runs replicated) - or, with
    ``along_features``, over the features (token-wise: split)."""

    def __init__(self, along_features=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(VOCAB, H * D), nn.Linear(H * D, VOCAB)
        self.dim = 2 if along_features else 1

    def forward(self, ids):
        x = self.emb(ids)
        q = x.view(B, -1, H, D).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(B, -1, H * D)
        return self.head(torch.cumsum(y, dim=self.dim))


def _trace(model, **kwargs):
    ids = torch.randint(0, VOCAB, (B, S))
    torch._dynamo.reset()
    return trace_rank(lambda i: model(i).logsumexp(-1).sum(), [ids], **kwargs)["stats"]


def test_a_replicated_op_is_counted_and_strict_refuses_it():
    stats = _trace(CumsumLM())
    (what,) = [f for f in stats.fallbacks if "cumsum" in f]
    i = stats.fallbacks.index(what)
    # the gathered input [B, S, H*D] and the replicated output, whole, in fp32
    assert stats.fallback_bytes[i] == 2 * B * S * H * D * 4
    assert "test_fallbacks.py" in stats.fallback_sources[i] and "cumsum" in stats.fallback_sources[i]
    with pytest.raises(Exception, match=r"(?s)strict=True.*cumsum.*0\.01 MiB per rank.*test_fallbacks\.py.*strict=False") as info:
        _trace(CumsumLM(), strict=True)
    cause = info.value  # Dynamo wraps the backend's error (the strategy unwraps it)
    while cause is not None and not isinstance(cause, AutoSPError):
        cause = cause.__cause__ or getattr(cause, "inner_exception", None)
    assert cause is not None
    # control: the same model summing over the features has nothing replicated, and strict passes
    stats = _trace(CumsumLM(along_features=True), strict=True)
    assert stats.fallbacks == [] and stats.fallback_bytes == [] and stats.sdpa == 1


def test_large_replicated_ops_warn_small_ones_inform(caplog):
    runner = StepRunner(StepConfig(), 2, 0, None, torch.device("cpu"))
    stats = SPPassStats(
        fallbacks=["big (cumsum): no sequence-parallel rule", "small (flip): no sequence-parallel rule"],
        fallback_bytes=[int(LOUD_FALLBACK * 2**20) + 1, int(LOUD_FALLBACK * 2**20) - 1],
        fallback_sources=['File "model.py", line 3\n    y.cumsum(1)', 'File "model.py", line 4\n    y.flip(1)'],
    )
    with caplog.at_level(logging.INFO, logger="autosp.steps"):
        runner._report_fallbacks("training_step", stats, saved=2**20)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(warnings) == 1 and "big (cumsum)" in warnings[0] and "flip" not in warnings[0]
    assert "model.py" in warnings[0] and "MiB per rank" in warnings[0] and "strict=True" in warnings[0]
    assert len(infos) == 1 and "small (flip)" in infos[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="autosp.steps"):  # saved bytes unknown: both are loud
        runner._report_fallbacks("training_step", stats, saved=None)
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and "flip" in caplog.records[0].getMessage()


def test_strict_argument():
    for cls in (AutoSPStrategy, FabricAutoSP):
        assert cls()._step_config.strict is False and cls(strict=True)._step_config.strict is True
        with pytest.raises(ValueError, match=r"strict='yes'.*True.*False"):
            cls(strict="yes")
