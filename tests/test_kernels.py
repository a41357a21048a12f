"""The attention kernel table (``autosp/ops/kernels.py``): which kernel runs each case on each
device - checked by counting the calls - with the CUDA rows run on CPU through emulations of the
CUDA ops that keep their conventions (``tests/cuda_emulation.py``); each convention catching its
misuse; and fake-CUDA traces of every row at the sizes of a Llama-3.1-8B layer at 131,072 tokens."""

import math

import cuda_emulation
import pytest
import torch
import torch.nn.functional as F
from test_opcheck import _causal_program, _keyless_program, _qkv, _softcap_program
from test_tiled_attention import dense
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from autosp.ops import kernels, programs
from autosp.ops.tiled_attention import attend

S = 37


def _reference(case, q, k, v):
    """fp64 dense attention of a case (``_qkv``'s inputs)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    pos = torch.arange(S)
    causal = pos[None, :] <= pos[:, None]
    if case == "causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), (q, k, v)
    if case == "documents":
        doc = (pos >= S // 2).long()
        pad = torch.ones(2, S, dtype=torch.bool)
        pad[1, -3:] = False
        keep = causal & (doc[:, None] == doc[None, :]) & pad[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True), (q, k, v)
    if case == "softcap":
        return dense(q, k, v, lambda s: torch.where(causal, torch.tanh(s * 0.3 / 5.0) * 5.0, -math.inf)), (q, k, v)
    pad = torch.ones(2, S, dtype=torch.bool)
    pad[0, :5] = False
    keep = causal & pad[:, None, None, :]
    return dense(q, k, v, lambda s: s * 0.25 + torch.where(keep, 0.0, torch.finfo(torch.float32).min)), (q, k, v)


PROGRAMS = {
    "causal": lambda d: _causal_program(d),
    "documents": lambda d: _causal_program(d, docs=True, padded=True),
    "softcap": _softcap_program,
    "keyless": _keyless_program,
}

#: (rows, dtype, case) -> the (table case, kernel) calls expected; "tiles": the interpreted tiles only
EXPECTED = {
    ("cpu", torch.float32, "causal"): {("causal", "cpu_flash")},
    ("cpu", torch.float32, "documents"): {("bias", "cpu_flash"), ("block", "cpu_flash")},
    ("cuda", torch.float32, "causal"): {("causal", "cuda_efficient")},
    ("cuda", torch.float32, "documents"): {("bias", "cuda_efficient"), ("block", "cuda_efficient")},
    ("cuda", torch.bfloat16, "causal"): {("causal", "cuda_flash")},
    ("cuda", torch.bfloat16, "documents"): {("bias", "cuda_efficient"), ("block", "cuda_flash")},
    ("cuda", torch.float32, "softcap"): {("score", "tiles")},
    ("cuda", torch.float32, "keyless"): {("keyless", "tiles"), ("bias", "cuda_efficient"), ("block", "cuda_efficient")},  # other blocks fused
    ("cuda", torch.bfloat16, "keyless"): {("keyless", "tiles"), ("bias", "cuda_efficient"), ("block", "cuda_flash")},
}


@pytest.mark.parametrize("rows,dtype,case", list(EXPECTED), ids=[f"{r}-{str(d)[6:]}-{c}" for r, d, c in EXPECTED])
def test_each_case_runs_the_kernel_its_row_names(rows, dtype, case):
    """Forward and backward of the tiled attention op through the table's rows (the CUDA ones on
    CPU through the emulated ops): the kernels called are the row's, and the result is dense
    attention's (fp64 reference; fp32 to 1e-5, bf16 to 2e-2 of the scale)."""
    text, leaves = PROGRAMS[case](dtype)[:2]
    q, k, v = _qkv(dtype, 4, 2)
    ref, ref_inputs = _reference(case, q, k, v)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    kernels.KERNEL_COUNTS.clear()
    with kernels.kernel_rows(rows if rows == "cuda" else None):
        out = attend(q, k, v, leaves, text, 8)
        grads = torch.autograd.grad(out, (q, k, v), g.to(dtype))
    assert set(kernels.KERNEL_COUNTS) == EXPECTED[(rows, dtype, case)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - ref).abs().max() <= tol * ref.abs().max()
    for a, b in zip(grads, torch.autograd.grad(ref, ref_inputs, g)):
        assert (a.double() - b).abs().max() <= tol * b.abs().max()


def test_kernels_outside_their_limits_fall_back_to_the_tiles_with_a_warning(caplog):
    """A head size no fused CUDA kernel takes in bf16 (12: not a multiple of 8) and fp64 run the
    interpreted tiles on the CUDA rows, and say so once per case; values with another head size
    than the queries' (MLA) go to the memory-efficient kernel in fp32."""
    text, leaves = _causal_program(torch.bfloat16, docs=True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, S, 12, generator=g, dtype=torch.bfloat16) for h in (4, 2, 2))
    kernels._WARNED.clear()
    kernels.KERNEL_COUNTS.clear()
    with kernels.kernel_rows("cuda"), caplog.at_level("WARNING", logger="autosp.ops.kernels"):
        attend(q, k, v, leaves, text, 8)
        attend(q, k, v, leaves, text, 8)
    assert set(kernels.KERNEL_COUNTS) == {("bias", "tiles")}
    warnings = [r.getMessage() for r in caplog.records]  # once per case (the tiles with and without a bias), not per call
    assert len(warnings) == 2 and any("the 'block' case" in w for w in warnings) and any("the 'bias' case" in w for w in warnings)
    assert all("runs in the interpreted tiles" in w and "head sizes 12/12" in w for w in warnings)
    assert kernels.choose("bias", q.double(), v.double()) == "cpu_flash"  # the CPU kernel takes fp64
    with kernels.kernel_rows("cuda"):
        assert kernels.choose("bias", q.double(), v.double()) == "tiles"
        assert kernels.choose("causal", torch.empty(1, 4, 8, 16), torch.empty(1, 2, 8, 8)) == "cuda_efficient"
        assert kernels.choose("causal", torch.empty(1, 4, 8, 16, dtype=torch.bfloat16), torch.empty(1, 2, 8, 8, dtype=torch.bfloat16)) == "cuda_efficient"


def test_every_device_and_case_has_a_row_and_the_docs_show_it():
    from pathlib import Path

    assert {(r.device, r.case) for r in kernels.ROWS} == {(d, c) for d in ("cpu", "cuda") for c in kernels.CASES}
    for row in kernels.ROWS:
        assert row.kernels[-1] == "tiles" and all(k in kernels.KERNELS for k in row.kernels)
    page = (Path(__file__).parents[1] / "docs" / "pass.md").read_text()
    for name, kernel in kernels.KERNELS.items():
        assert f"`{name}`" in page and kernel.forward.split(" ")[0] in page, name
    assert "Nothing in this table has run on a GPU yet" in page


def test_leaves_travel_to_the_host_in_one_transfer_and_come_back_whole():
    """What ``to_host`` sends for a mask's leaves on a GPU - every leaf packed into one byte tensor
    (one copy, one read of the device) - unpacks to the same values, whatever the dtypes, their
    order (a bool before an int64 leaves it unaligned in the bytes) and layouts (broadcast views)."""
    leaves = [torch.tensor([True, False, True]), torch.arange(5)[:, None], torch.arange(4.0).expand(2, 4), torch.ones(1, 3, dtype=torch.bfloat16)]
    back = kernels.unpack_bytes(kernels.pack_bytes(leaves), leaves)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(back, leaves))
    reads = kernels.HOST_READS["count"]
    with kernels.kernel_rows("cuda"):
        kernels.to_host(leaves)  # CPU tensors on the CUDA rows: counted as the read a GPU would make
    assert kernels.HOST_READS["count"] == reads + 1


def test_the_switch_refuses_without_cpu_implementations(monkeypatch):
    monkeypatch.setattr(kernels, "_has_cpu_kernel", lambda op: False)
    with pytest.raises(RuntimeError, match="no CPU implementation here: register one first"):
        with kernels.kernel_rows("cuda"):
            pass


# ------------------------------------------------------------------ the conventions catch their misuse
def _documents_fp32():
    text, leaves = _causal_program(torch.float32, docs=True, padded=True)
    q, k, v = _qkv(torch.float32, 4, 2)
    return text, leaves, q, k, v


def test_reading_the_efficient_lse_padding_is_caught(monkeypatch):
    """The memory-efficient kernel's LSE is padded to 32 rows, the tail unwritten (NaN in the
    emulation): the table's rows read ``[..., :Sq]`` and equal dense attention; reading the tail
    instead (``[..., -Sq:]``, what a merge over the padded tensor would do) gives NaN."""
    text, leaves, q, k, v = _documents_fp32()
    ref = _reference("documents", q, k, v)[0]
    with kernels.kernel_rows("cuda"):
        good = attend(q, k, v, leaves, text, 8)
        monkeypatch.setattr(kernels, "_efficient_lse", lambda lse, rows: lse.narrow(-1, lse.shape[-1] - rows, rows))
        bad = attend(q, k, v, leaves, text, 8)
    assert (good.double() - ref).abs().max() < 1e-5
    assert not bool(torch.isfinite(bad).all())


def test_a_bias_in_another_dtype_than_the_queries_is_caught():
    """An fp32 bias on bf16 queries (which cuDNN takes and computes wrongly, pytorch 191612): the
    memory-efficient op refuses it; the table's rows build the bias in the queries' dtype."""
    q, k, v = (x.detach() for x in _qkv(torch.bfloat16, 2, 2))
    bias = torch.zeros(1, 1, S, S)
    with pytest.raises(cuda_emulation.ConventionError, match="invalid dtype for bias"):
        kernels.forward("bias", "cuda_efficient", q, k, v, bias, 0.3)
    out, _ = kernels.forward("bias", "cuda_efficient", q, k, v, bias.to(torch.bfloat16), 0.3)
    assert bool(torch.isfinite(out.float()).all())


def test_an_unaligned_bias_is_caught(monkeypatch):
    """A bias of 37 columns laid out contiguously (rows 37 elements apart: not 16-byte aligned) is
    refused; the table's rows pad the rows to 40 and narrow them."""
    text, leaves, q, k, v = _documents_fp32()
    with kernels.kernel_rows("cuda"):
        attend(q, k, v, leaves, text, 64)  # one tile of 37 x 37: a bias of 37 columns
        monkeypatch.setattr(kernels, "_aligned_bias", lambda bias: bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).contiguous())
        with pytest.raises(cuda_emulation.ConventionError, match="not correctly aligned"):
            attend(q, k, v, leaves, text, 64)


def test_grouped_queries_on_the_efficient_kernel_are_caught(monkeypatch):
    """The memory-efficient kernel takes as many KV heads as query heads: the table's rows call it
    once per query head of each KV head; one call with all query heads is refused."""
    text, leaves, q, k, v = _documents_fp32()
    with kernels.kernel_rows("cuda"):
        attend(q, k, v, leaves, text, 8)
        monkeypatch.setattr(kernels, "_group", lambda x, j, kv_heads: x)
        with pytest.raises(cuda_emulation.ConventionError, match="no GQA"):
            attend(q, k, v, leaves, text, 8)


def test_a_16_bit_backward_with_out_in_another_layout_is_caught(monkeypatch):
    """The memory-efficient backward in 16-bit reads ``out`` and ``grad_out`` with the row stride
    ``H * D`` of a ``[B, S, H, D]`` layout whatever their strides: the table's rows hand them over
    so laid out (with 2 KV heads, one group's rows of a plain contiguous copy would be misread);
    a contiguous ``[B, H, S, D]`` copy is refused."""
    text, leaves = _causal_program(torch.bfloat16, docs=True, padded=True)
    q, k, v = _qkv(torch.bfloat16, 4, 2)
    with kernels.kernel_rows("cuda"):
        out = attend(q, k, v, leaves, text, 8)
        torch.autograd.grad(out.float().sum(), (q, k, v))
        monkeypatch.setattr(kernels, "_bshd", kernels._dense)
        out = attend(q, k, v, leaves, text, 8)
        with pytest.raises(cuda_emulation.ConventionError, match=r"laid out \[B, S, H, D\]"):
            torch.autograd.grad(out.float().sum(), (q, k, v))


def test_a_row_of_fill_values_alone_in_a_block_is_caught(monkeypatch):
    """Under a finite fill (``finfo.min``, Hugging Face's eager masks) the memory-efficient kernel's
    base-2 softmax overflows a row whose keys in a block are all filled to ``-inf``: NaN. Such a
    row has keys in other blocks (left padding of 5, tiles of 4): the table's rows count it as
    having none here and equal dense attention; counting finite fill values as keys lets the NaN
    through."""
    pad = torch.ones(2, S, dtype=torch.bool)
    pad[0, :5] = False
    text, leaves = programs.padded_with_finite_fill(S, pad, 0.25, torch.float32)
    q, k, v = _qkv(torch.float32, 4, 2)
    ref = _reference("keyless", q, k, v)[0]
    with kernels.kernel_rows("cuda"):
        good = attend(q, k, v, leaves, text, 4)
        monkeypatch.setattr(kernels, "_rows_with_keys", lambda bias: (bias > -math.inf).any(-1))
        bad = attend(q, k, v, leaves, text, 4)
    assert (good.double() - ref).abs().max() < 1e-5
    assert not bool(torch.isfinite(bad).all())


# ------------------------------------------------------------------ fake-CUDA traces at real sizes
class ConventionChecks(TorchDispatchMode):
    """Checks every CUDA attention op called under it against the emulation's conventions (on
    fake tensors: shapes, dtypes, strides), then runs it (its meta kernel)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is cuda_emulation.FLASH:
            cuda_emulation.check_flash_args(*args[:3])
        elif func is cuda_emulation.FLASH_BACKWARD:
            cuda_emulation.check_flash_args(*args[1:4], args[5])
        elif func is cuda_emulation.EFFICIENT:
            cuda_emulation.check_efficient_args(*args[:4])
        elif func is cuda_emulation.EFFICIENT_BACKWARD:
            cuda_emulation.check_efficient_args(*args[1:5], args[6])
            cuda_emulation.check_efficient_backward_layouts(args[5], args[0])
        if func in (cuda_emulation.FLASH, cuda_emulation.FLASH_BACKWARD, cuda_emulation.EFFICIENT, cuda_emulation.EFFICIENT_BACKWARD):
            self.calls.append(func.__name__)
        return func(*args, **kwargs)


#: Llama-3.1-8B on an SP group of 8 at 131,072 tokens: a rank's 4 query heads and 1 KV head of 128
B8, HQ8, HK8, D8, S8 = 1, 4, 1, 128, 131072


@pytest.mark.parametrize("case,kernel,dtype,rows,keys,kv", [
    ("causal", "cuda_flash", torch.bfloat16, S8, S8, 1),  # (a) the whole sequence, exactly causal
    ("causal", "cuda_efficient", torch.float32, S8, S8, 1),  # (a) in fp32 (f)
    ("block", "cuda_flash", torch.bfloat16, 1024, 64 * 1024, 1),  # (b) a tile's rows over a run of bias-free tiles
    ("block", "cuda_flash", torch.bfloat16, S8 // 4, S8 // 4, 1),  # (b) a ring step's chunk against another (ring=2)
    ("block", "cuda_efficient", torch.float32, S8 // 4, S8 // 4, 1),
    ("bias", "cuda_efficient", torch.bfloat16, 1024, 1024, 1),  # (c) a tile with its bias (e: one call per query head group)
    ("bias", "cuda_efficient", torch.bfloat16, 1024, 1024, 2),  # (c, e) sp=4: 8 query heads over 2 KV heads
    ("bias", "cuda_efficient", torch.float32, 1000, 1000, 1),  # (c) a last, short tile (rows not a multiple of 32 or 8)
])
def test_fake_cuda_traces_at_8b_sizes(case, kernel, dtype, rows, keys, kv):
    """Every fused row's forward and backward on fake CUDA tensors of Llama-3.1-8B's sizes at
    131,072 tokens (a rank of sp=8: 4 query heads, 1 KV head of 128; of sp=4: 8 over 2), laid out
    as the SP pass's exchange hands them: each call's shapes, dtypes and strides pass the op's
    conventions and its meta kernel, and the results have the table's convention."""
    torch._C._ensureCUDADeviceGuardSet()
    checks = ConventionChecks()
    with FakeTensorMode(), checks:
        dev = torch.device("cuda:0")

        def heads_inside(h, n):
            return torch.empty(B8, n, h, D8, dtype=dtype, device=dev).transpose(1, 2)

        hq = HQ8 * kv // HK8
        q, k, v = heads_inside(hq, rows), heads_inside(kv, keys), heads_inside(kv, keys)
        bias = torch.zeros(B8, 1, rows, keys, dtype=dtype, device=dev) if case == "bias" else None
        out, lse = kernels.forward(case, kernel, q, k, v, bias, 1 / math.sqrt(D8))
        assert tuple(out.shape) == (B8, hq, rows, D8) and out.dtype == dtype
        assert tuple(lse.shape) == (B8, hq, rows) and lse.dtype == torch.float32
        grad = torch.empty(B8, rows, hq, D8, dtype=dtype, device=dev).transpose(1, 2)  # as the exchange's backward hands it
        dq, dk, dv = kernels.backward(case, kernel, grad, q, k, v, bias, out, lse, 1 / math.sqrt(D8))
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dk.dtype == dtype
    forward = "_scaled_dot_product_flash_attention" if kernel == "cuda_flash" else "_scaled_dot_product_efficient_attention"
    calls = hq // kv if kernel == "cuda_efficient" else 1
    assert checks.calls == [f"{forward}.default"] * calls + [f"{forward}_backward.default"] * calls


@pytest.mark.parametrize("case", ["score", "keyless"])
def test_fake_traces_of_the_listed_fallbacks_at_8b_sizes(case):
    """The rows whose kernel is the interpreted tiles (soft-capping; a block of rows with no key
    under a finite fill) at the same sizes: one block of 1024 rows over every key tile of 131,072
    tokens, forward and backward, on fake tensors (the tiles are PyTorch ops: no convention of a
    CUDA op to check, only that every op takes these shapes and dtypes)."""
    from autosp.ops import programs
    from autosp.ops.live_tiles import FILL, LIVE
    from autosp.ops.score_program import ScoreProgram
    from autosp.ops.tile_kernels import backward_rows, forward_rows

    tile, n = 1024, S8 // 1024
    with FakeTensorMode():
        if case == "score":
            text, leaves = programs.soft_capped_causal(S8, 1 / math.sqrt(D8), 50.0, torch.bfloat16)
            row = [LIVE] + [0] * (n - 1)
        else:
            text, leaves = programs.padded_with_finite_fill(S8, torch.ones(1, S8, dtype=torch.bool), 1 / math.sqrt(D8), torch.bfloat16)
            row = [FILL] * n
        prog = ScoreProgram.parse(text)
        q = torch.empty(B8, S8, HQ8, D8, dtype=torch.bfloat16).transpose(1, 2)
        k = v = torch.empty(B8, S8, HK8, D8, dtype=torch.bfloat16).transpose(1, 2)
        m, l, acc = forward_rows(prog, q, k, v, leaves, 0, tile, tile, row)
        assert tuple(acc.shape) == (B8, HQ8, tile, D8) and m.dtype == l.dtype == torch.float32
        out = torch.empty_like(q)
        m_all, l_all = torch.zeros(B8, HQ8, S8), torch.ones(B8, HQ8, S8)
        dk, dv = torch.zeros(k.shape), torch.zeros(v.shape)
        dq = backward_rows(prog, out, q, out, m_all, l_all, torch.zeros(B8, HQ8, S8), k, v, leaves, 0, tile, tile, row, dk, dv)
        assert tuple(dq.shape) == (B8, HQ8, tile, D8)


def test_the_fake_trace_catches_a_misuse():
    """The control of the traces: a flash call with fp32 inputs (which only the meta kernel would
    take) fails the conventions."""
    torch._C._ensureCUDADeviceGuardSet()
    with FakeTensorMode(), ConventionChecks():
        q = torch.empty(1, 4, 256, 128, device="cuda:0")
        with pytest.raises(cuda_emulation.ConventionError, match="only supports fp16 and bf16"):
            kernels.forward("causal", "cuda_flash", q, q, q, None, 0.1)


# ------------------------------------------------------------------ fits through the CUDA rows
def _cuda_zoo():
    from test_masks import FAMILIES
    from mask_models import ModelZoo

    names = ("llama_use_cache_false", "llama_packed_sdpa", "mistral_window_in_documents", "qwen2_padding", "gemma2_sliding_global_softcap")
    return ModelZoo([f for f in FAMILIES if f[0] in names])


@pytest.mark.slow
def test_hugging_face_masks_through_the_cuda_rows_equal_one_device(tmp_path, monkeypatch):
    """``AUTOSP_KERNEL_ROWS=cuda``: every attention of five Hugging Face families - Llama on plain
    rows (its mask exactly causal: row a), Llama with packed documents, Mistral's window inside
    them, Qwen2 padded on either side, Gemma-2's soft-capping (the listed fallback) - all with GQA
    (4 query heads, 2 KV heads), through the CUDA rows (the emulated flash and memory-efficient
    ops, fp32), at sp=2 over 31 tokens: loss and gradients equal one device, the naive sharding
    does not, and each case ran the kernel its row names."""
    from sp_harness import FnModule, check_against_references, run_fit
    from test_masks import ZooData, zoo_loss

    monkeypatch.setenv(kernels.ROWS_ENV, "cuda")
    run = run_fit(tmp_path, FnModule(_cuda_zoo, zoo_loss, log_loss=False), ZooData(4, 31), devices=2, sp_size=2, tiled_attention=8)
    loss_err, grad_err, naive = check_against_references(run, 2, _cuda_zoo, zoo_loss)
    print(f"zoo through the CUDA rows sp2: loss {loss_err:.2e} grad {grad_err:.2e} (naive: grad {naive:.2e})")
    (graph,) = run.ranks[0]["graphs"]["training_step"]
    assert graph.dense_masks == [] and graph.fallbacks == [] and graph.tiled_attention == graph.attention == 6
    for rec in run.ranks:
        assert set(rec["kernel_counts"]) == {
            ("causal", "cuda_efficient"), ("bias", "cuda_efficient"), ("block", "cuda_efficient"), ("score", "tiles"),  # Gemma-2: listed
        }
        assert rec["tile_counts"]["causal"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(2, 2), (1, 4)], ids=["ulysses2xring2", "ulysses1xring4"])
@pytest.mark.full
def test_ring_layouts_through_the_cuda_rows_equal_one_device(tmp_path, monkeypatch, layout):
    """The ring level's steps through the CUDA rows: Hugging Face Llama with packed documents and
    Mistral's window inside them, 4 processes, 31 tokens: every ring step's blocks in the emulated
    memory-efficient kernel (fp32), loss and gradients equal one device."""
    from mask_models import ModelZoo
    from sp_harness import FnModule, check_against_references, run_fit
    from test_masks import ZooData, zoo_loss

    monkeypatch.setenv(kernels.ROWS_ENV, "cuda")
    run = run_fit(tmp_path, FnModule(_ring_zoo, zoo_loss, log_loss=False), ZooData(8, 31), devices=4, sp_size=4, tiled_attention=8,
                  sp_layout=layout)
    loss_err, grad_err, naive = check_against_references(run, 4, _ring_zoo, zoo_loss)
    print(f"ring {layout} through the CUDA rows: loss {loss_err:.2e} grad {grad_err:.2e} (naive: grad {naive:.2e})")
    (graph,) = run.ranks[0]["graphs"]["training_step"]
    assert graph.ring_attention == graph.attention == 2 and graph.layout == layout
    for rec in run.ranks:
        assert {kernel for _, kernel in rec["kernel_counts"]} == {"cuda_efficient"}


def _ring_zoo():
    from mask_models import ModelZoo
    from test_masks import FAMILIES

    return ModelZoo([f for f in FAMILIES if f[0] in ("llama_packed_sdpa", "mistral_window_in_documents")])


@pytest.mark.full
@pytest.mark.parametrize("sac,layers", [(True, 2), ("block", 1)], ids=["sac-2layers", "block-1layer"])
def test_a_step_reads_the_device_once_for_its_masks(tmp_path, monkeypatch, sac, layers):
    """A Hugging Face Llama with packed documents at sp=2 through the CUDA rows (where a read of
    the device stalls the stream): each step reads the device into Python once for its masks - the
    map of live tiles made once, shared by both layers, forward and backward; under
    ``sac="block"`` kept, not recomputed with the block - and the steps equal one device."""
    from mask_models import hf_factory, packed_call
    from sp_harness import FnModule, check_against_references, run_fit
    from test_masks import ZooData

    monkeypatch.setenv(kernels.ROWS_ENV, "cuda")
    factory = hf_factory("llama", layers=layers, seed=8)
    run = run_fit(tmp_path, FnModule(factory, packed_call, log_loss=False), ZooData(4, 29), devices=2, sp_size=2, tiled_attention=8,
                  steps=2, sac=sac)
    check_against_references(run, 2, factory, packed_call)
    (graph,) = run.ranks[0]["graphs"]["training_step"]
    assert graph.tiled_attention == layers
    for rec in run.ranks:
        assert rec["host_reads"] == 2, rec["host_reads"]  # two steps, one read each
        assert rec["tile_counts"]["computed"] > 0


# ------------------------------------------------------------------ benchmarks/gpu_check.py's kernel table, dry run
@pytest.mark.full
def test_gpu_check_dry_runs_the_kernel_table_on_cpu(tmp_path):
    """``gpu_check.py --device cpu --rows cuda --kernels-only``: every case of the table through the
    CUDA rows (emulated), two tiles each way (1,100 tokens, tiles of 1,024), within its tolerances,
    each running the kernels its row names, and the interpreted tiles timed beside them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import gpu_check

    res = gpu_check.main(["--device", "cpu", "--rows", "cuda", "--kernels-only", "--kernel-seq", "1100", "--reps", "1", "--no-hf",
                          "--out", str(tmp_path / "gpu_check.json")])
    rows = res["kernels"]["rows"]
    assert len(rows) == 10 and all(r["ok"] for r in rows), [(r["case"], r["dtype"], r["out_err"], r["grad_err"]) for r in rows]
    ran = {(r["case"][0], r["dtype"]): set(r["kernels"]) for r in rows}
    assert ran[("a", "bfloat16")] == {"causal: cuda_flash"} and ran[("a", "float32")] == {"causal: cuda_efficient"}
    assert ran[("b", "bfloat16")] == ran[("c", "float32")] == {"bias: cuda_efficient"}  # (documents shorter than a tile)
    assert ran[("d", "float32")] == {"score: tiles"}
    assert ran[("f", "float32")] == {"keyless: tiles", "bias: cuda_efficient"}  # the first block of rows holds the padding
    assert all(r["tiles_s"] > 0 and r["table_s"] > 0 for r in rows)
    assert (tmp_path / "gpu_check.json").exists()


@pytest.mark.slow
@pytest.mark.full
def test_the_hugging_face_step_timing_runs(monkeypatch):
    """``kernel_table.hf_mask_step`` at a tiny size on CPU (aot_eager): both models train a step under
    AutoSP on the fake process group, the one with its mask through the table's causal row."""
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import kernel_table

    res = kernel_table.hf_mask_step(torch.device("cpu"), 256, 2, 1, "aot_eager", lambda: None, hidden=64, layers=1)
    assert res["mask"]["kernels"] == ["causal: cpu_flash"] and res["is_causal"]["kernels"] == []
    assert res["ratio"] > 0 and not torch.distributed.is_initialized()
