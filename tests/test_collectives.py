"""The collectives (ops.py) and the runtime redistributions (passes/runtime.py) in real gloo
process groups of 2 and 3 ranks, against the single-device tensors they stand for.

Each rank builds the same global tensor, takes its shard as layout.py says, runs the op, and
returns what it got; the test compares with the slice of the global tensor (forward) and with
the autograd gradient of one device (backward = the adjoint). A negative control next to each
check shows the comparison would catch a wrong window or rank order.
"""

import pytest
import torch
import torch.distributed as dist
from sp_harness import spawn

from autosp.ops import collectives as ops
from autosp.layout import chunk_size, seq_split_sizes, shard_window
from autosp.passes import runtime

H, D = 6, 3  # heads divisible by 2 and 3


def _global(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _split_layout(x, group, world, seq_len, rank):
    """As the SP pass emits it: the even (head) side as tensor ops, the exchange and the uneven
    (sequence) side in ``seq_gather``/``seq_scatter``, the sequence outside the heads."""
    send = x.unflatten(1, (world, H // world)).permute(1, 0, 3, 2, 4).contiguous()  # [P, B, S_r, H/P, D]
    tokens = ops.seq_gather(send, 1, group, seq_len, rank)  # [B, S, H/P, D]
    heads = tokens.transpose(1, 2)  # [B, H/P, S, D], what attention reads
    back = ops.seq_scatter(heads.transpose(1, 2), 1, group, world, seq_len, rank)  # [P, B, S_r, H/P, D]
    return heads, back.permute(1, 0, 3, 2, 4).flatten(1, 2)  # [B, H, S_r, D]


def _all_to_all_rank(rank: int, world: int, seq_len: int, batch: int) -> dict:
    group = dist.group.WORLD.group_name
    x_full = _global(0, batch, H, seq_len, D)  # the activations one device would hold
    start = sum(seq_split_sizes(seq_len, world)[:rank])
    count = seq_split_sizes(seq_len, world)[rank]
    x = x_full.narrow(2, start, count).clone().requires_grad_(True)  # [B, H, S_r, D]
    heads, back = _split_layout(x, group, world, seq_len, rank)
    # d loss / d heads and d loss / d back, as one device sees them (back is x again)
    weight, weight_back = _global(1, batch, H, seq_len, D), _global(2, batch, H, seq_len, D)
    loss = (heads * weight.narrow(1, rank * H // world, H // world)).sum() + (back * weight_back.narrow(2, start, count)).sum()
    loss.backward()
    return {"heads": heads.detach(), "back": back.detach(), "grad": x.grad, "start": start, "count": count}


# batch 1: the pieces lie end to end (received and sent without copies); batch 2: joined by cat
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("world,seq_len", [(2, 8), (2, 7), (3, 10)])
def test_uneven_all_to_all_and_its_adjoint(tmp_path, world, seq_len, batch):
    results = spawn(tmp_path, _all_to_all_rank, world, seq_len, batch)
    x_full, weight, weight_back = (_global(seed, batch, H, seq_len, D) for seed in range(3))
    per = H // world
    for rank, res in enumerate(results):
        # forward: this rank's heads over the whole sequence; the reverse op gives the shard back
        expected = x_full.narrow(1, rank * per, per)
        torch.testing.assert_close(res["heads"], expected, rtol=0, atol=0)
        torch.testing.assert_close(res["back"], x_full.narrow(2, res["start"], res["count"]), rtol=0, atol=0)
        # backward: the single-device gradient restricted to this shard, through both directions
        expected_grad = weight.narrow(2, res["start"], res["count"]) + weight_back.narrow(2, res["start"], res["count"])
        torch.testing.assert_close(res["grad"], expected_grad, rtol=0, atol=0)
    # negative controls: another rank's heads are not what this rank received; the gradient of
    # one direction alone is not the gradient
    assert not torch.allclose(results[0]["heads"], x_full.narrow(1, per, per))
    assert not torch.allclose(results[0]["grad"], weight.narrow(2, 0, results[0]["count"]))


def _ring_exchange_rank(rank: int, world: int, seq_len: int, batch: int, ring: int, zigzag: bool) -> dict:
    """The exchange of a ``ulysses x ring`` SP group: this rank's positions with every head in,
    its head group over its ring segment out; back with the adjoint."""
    from autosp.layout import ring_segment

    group, ulysses = dist.group.WORLD.group_name, world // ring
    x_full = _global(0, batch, H, seq_len, D)
    start, count = sum(seq_split_sizes(seq_len, world)[:rank]), seq_split_sizes(seq_len, world)[rank]
    x = x_full.narrow(2, start, count).clone().requires_grad_(True)  # [B, H, S_r, D]
    send = x.unflatten(1, (ulysses, H // ulysses)).permute(1, 0, 3, 2, 4).contiguous()  # [U, B, S_r, H/U, D]
    heads = ops.ring_seq_gather(send, 1, group, seq_len, rank, ring, zigzag).transpose(1, 2)  # [B, H/U, L, D]
    back = ops.ring_seq_scatter(heads.transpose(1, 2), 1, group, world, seq_len, rank, ring, zigzag)
    back = back.permute(1, 0, 3, 2, 4).flatten(1, 2)  # [B, H, S_r, D]
    segment = ring_segment(seq_len, ring, rank // ulysses, zigzag)
    positions = torch.cat([torch.arange(a, b) for a, b in segment])
    weight, weight_back = _global(1, batch, H, seq_len, D), _global(2, batch, H, seq_len, D)
    first = (rank % ulysses) * (H // ulysses)
    loss = (heads * weight.narrow(1, first, H // ulysses)[:, :, positions]).sum() + (back * weight_back.narrow(2, start, count)).sum()
    loss.backward()
    return {"heads": heads.detach(), "back": back.detach(), "grad": x.grad, "start": start, "count": count, "positions": positions, "first": first}


@pytest.mark.slow
@pytest.mark.parametrize("world,ring,seq_len,zigzag", [(4, 2, 31, True), (4, 4, 37, True), (3, 3, 20, True), (4, 2, 30, False)])
def test_ring_exchange_and_its_adjoint(tmp_path, world, ring, seq_len, zigzag):
    """Each rank receives its head group for exactly the positions of its ring segment (head and
    tail chunks, in position order; lengths not divisible by the SP or ring split), and the
    reverse exchange and the gradients are the single device's."""
    results = spawn(tmp_path, _ring_exchange_rank, world, seq_len, 2, ring, zigzag)
    x_full, weight, weight_back = (_global(seed, 2, H, seq_len, D) for seed in range(3))
    per = H // (world // ring)
    for res in results:
        torch.testing.assert_close(res["heads"], x_full.narrow(1, res["first"], per)[:, :, res["positions"]], rtol=0, atol=0)
        torch.testing.assert_close(res["back"], x_full.narrow(2, res["start"], res["count"]), rtol=0, atol=0)
        expected = weight.narrow(2, res["start"], res["count"]) + weight_back.narrow(2, res["start"], res["count"])
        torch.testing.assert_close(res["grad"], expected, rtol=0, atol=0)
    assert sorted(p for res in results[:: world // ring] for p in res["positions"].tolist()) == list(range(seq_len))
    # negative control: the positions in plain order are not what a head-tail segment holds
    if zigzag:
        ordered = x_full.narrow(1, results[0]["first"], per)[:, :, : results[0]["positions"].numel()]
        assert not torch.allclose(results[0]["heads"], ordered)


def _windows_rank(rank: int, world: int, seq_len: int, offset: int, length: int, outer: int, inner: int) -> dict:
    """Slice a (possibly shifted, possibly flattened) sequence axis to this rank and gather it back."""
    group = dist.group.WORLD.group_name
    full = _global(2, 2, outer * length * inner, 3)  # dim 1 is (outer, length, inner) flattened
    chunk = chunk_size(seq_len, world)
    start, count = shard_window(rank, world, chunk, length, offset)
    local = runtime.shard_slice(full, 1, outer, length, inner, start, count)
    left_pad = start + offset - rank * chunk
    right_pad = (rank + 1) * chunk - (start + count + offset)
    gathered = runtime.shard_gather(local, 1, outer, inner, offset, length, left_pad, right_pad, group, world)
    return {"local": local, "gathered": gathered, "start": start, "count": count}


@pytest.mark.parametrize(
    "world,seq_len,offset,length,outer,inner",
    [
        (2, 8, 0, 8, 1, 1),  # an activation
        (2, 8, 0, 7, 1, 1),  # logits[:, :-1]
        (2, 8, 1, 7, 1, 1),  # labels[:, 1:]
        (3, 10, 1, 8, 1, 1),  # x[:, 1:-1] over an uneven split
        (3, 10, 0, 9, 2, 4),  # a shifted axis flattened as (outer, seq, inner)
    ],
)
def test_shard_windows_tile_the_sequence_and_gather_back(tmp_path, world, seq_len, offset, length, outer, inner):
    results = spawn(tmp_path, _windows_rank, world, seq_len, offset, length, outer, inner)
    full = _global(2, 2, outer * length * inner, 3)
    # the windows tile the axis in rank order, and only the first and last rank lose positions
    starts = [r["start"] for r in results]
    counts = [r["count"] for r in results]
    assert sum(counts) == length and starts[0] == 0
    assert all(starts[r + 1] == starts[r] + counts[r] for r in range(world - 1))
    base = seq_split_sizes(seq_len, world)
    assert counts[1:-1] == base[1:-1]
    view = full.unflatten(1, (outer, length, inner))
    for res in results:
        expected = view.narrow(2, res["start"], res["count"]).flatten(1, 3)
        torch.testing.assert_close(res["local"], expected, rtol=0, atol=0)
        torch.testing.assert_close(res["gathered"], full, rtol=0, atol=0)
    # negative control: the last rank's window read as base positions (offset ignored) or as
    # another rank's window is different data
    last = results[-1]
    wrong_start = last["start"] + offset if offset else results[0]["start"]
    wrong = view.narrow(2, wrong_start, min(last["count"], length - wrong_start)).flatten(1, 3)
    assert wrong.shape != last["local"].shape or not torch.equal(wrong, last["local"])


def _group_ratio_rank(rank: int, world: int, seq_len: int) -> dict:
    """A token-weighted mean over the sequence shards: sum(v * w) / sum(w), both summed over the group."""
    group = dist.group.WORLD.group_name
    start, count = sum(seq_split_sizes(seq_len, world)[:rank]), seq_split_sizes(seq_len, world)[rank]
    out = {}
    for name in ("op", "graph_ops"):
        v = _global(3, seq_len).narrow(0, start, count).clone().requires_grad_(True)
        w = (_global(4, seq_len).abs() + 0.1).narrow(0, start, count).clone().requires_grad_(True)
        num, den = (v * w).sum(), w.sum()
        if name == "op":
            loss = ops.group_ratio(num, den, group, world)[0]
        else:  # the same with graph ops around an all-reduce (what the SP pass emitted before)
            both = ops.all_reduce(torch.stack([num, den]), group, world)
            loss = both[0] / both[1]
        loss.backward()
        out[name] = {"loss": loss.detach(), "grad_v": v.grad, "grad_w": w.grad, "local": (num / den).detach()}
    out["start"], out["count"] = start, count
    return out


@pytest.mark.parametrize("world,seq_len", [(2, 8), (3, 10)])
def test_group_ratio_is_the_single_device_mean(tmp_path, world, seq_len):
    results = spawn(tmp_path, _group_ratio_rank, world, seq_len)
    v, w = _global(3, seq_len).requires_grad_(True), (_global(4, seq_len).abs() + 0.1).requires_grad_(True)
    loss = (v * w).sum() / w.sum()
    loss.backward()
    for res in results:
        window = slice(res["start"], res["start"] + res["count"])
        for name in ("op", "graph_ops"):
            got = res[name]
            torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-12, atol=0)
            # every rank's loss is the whole loss, so the gradients of its shard, summed over the
            # group (the all-reduce's adjoint), are world x the single-device ones
            torch.testing.assert_close(got["grad_v"], world * v.grad[window], rtol=1e-12, atol=0)
            torch.testing.assert_close(got["grad_w"], world * w.grad[window], rtol=1e-12, atol=0)
    # negative control: a rank's own ratio is not the mean of the sequence
    assert not torch.allclose(results[0]["op"]["local"], loss.detach())
