"""One rank of the split-fetch tests (tests/stages/test_split_fetch.py): gloo ranks on
CPU that stream the same model with split_fetch and check, on every rank, that
outputs are bitwise equal to the resident model's (different inputs per rank),
that each rank holds and reads about 1/N of the streamed bytes, and that
mismatched configurations are refused on every rank without hanging.

    python tests/helpers/split_worker.py RANK WORLD PORT TMPDIR [SCENARIO]

SCENARIO (one of SCENARIOS) runs that check alone; without it, the main ones.
"""
import copy
import dataclasses
import datetime
import functools
import os
import re
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

import layerwise
from layerwise.planning.host_budget import staging_slot_bytes
from layerwise.stages import split


class Block(nn.Module):
    def __init__(self, d, i):
        super().__init__()
        self.a = nn.Linear(d, 2 * d + 8 * i)  # layers of different sizes
        self.b = nn.Linear(2 * d + 8 * i, d)
        self.scale = nn.Parameter(torch.randn(d).to(torch.bfloat16))  # a second dtype per layer

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x))) * self.scale.float()


class Net(nn.Module):
    def __init__(self, d=48, n=6, m=3, equal=False):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList([Block(d, 0 if equal else i) for i in range(n)])  # equal: layers of one size
        self.extra = nn.ModuleList([Block(d, 0 if equal else i) for i in range(m)])
        self.head = nn.Linear(d, d)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        for b in self.extra:
            x = b(x)
        return self.head(x)


def check_outputs(model, reference, rank, steps=3):
    torch.manual_seed(100 + rank)  # different inputs on every rank
    xs = [torch.randn(3, 48) for _ in range(2)]
    with torch.no_grad():
        for _ in range(steps):
            for x in xs:
                out, ref = model(x), reference(x)
                assert torch.equal(out, ref), (rank, (out - ref).abs().max().item())


def streamed_bytes(m):
    return sum(lp.nbytes for lp in m.plan.layers if lp.index not in set(m.resident))


def all_sum(v):
    t = torch.tensor([v], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def scenario_equal(rank, world, depth, resident, contract=True):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    managers = layerwise.configure_layerwise_offload(
        model, ["blocks", "extra"], device="cpu", prefetch_depth=depth, resident_layers=resident,
        debug_copy_delay_us=300, split_fetch=dist.group.WORLD)
    check_outputs(model, reference, rank)
    for m in managers:
        s = m.stats()
        sf = s["split_fetch"]
        streamed = streamed_bytes(m)
        n_split = sf["split_layers"]
        assert n_split == m.num_layers - len(m.resident), (n_split, m.resident)
        # ~1/N of the streamed bytes on this rank, and the ranks' shares add up to the layers exactly
        assert abs(sf["share_bytes"] - streamed / world) <= n_split * split.SHARE_ALIGN, (sf, streamed)
        assert all_sum(sf["share_bytes"]) == streamed
        assert sf["host_bytes"] <= sf["share_bytes"] + n_split * 4096
        # the group's host memory: the resident layers' arena and this rank's shares, nothing more
        resident_bytes = sum(m.plan.layers[i].nbytes for i in m.resident)
        assert m._host.arena.capacity <= resident_bytes + len(m.resident) * 4096 + (0 if m.resident else 4096), s
        assert s["arena_bytes"] == m._host.arena.capacity + sf["share_bytes"], s
        # over the host link: this rank's shares only; the rest comes from the other ranks
        assert sf["bytes_local"] >= s["bytes_copied"] and sf["bytes_local"] > 0, (s, sf)
        assert sf["bytes_gathered"] >= (world - 1) * sf["bytes_local"] * 0.5, sf
        assert s["sync_loads"] == 0 and sf["gathers"] > 0, s
        assert sf["copy_wait_s"] is not None and sf["gather_s"] > 0
    if not contract:
        layerwise.remove_layerwise_offload(model)
        return
    summary = str(layerwise.report(model))
    assert f"split fetch, rank {rank} of {world} (gloo)" in summary and "all-gathers" in summary, summary
    # state_dict (collective): the true weights
    sd = model.state_dict()
    ref_sd = reference.state_dict()
    assert sd.keys() == ref_sd.keys()
    for k in sd:
        assert torch.equal(sd[k].cpu(), ref_sd[k]), k
    # load_state_dict with the same values on every rank: takes effect
    new = {k: v.clone() for k, v in ref_sd.items()}
    new["blocks.2.a.weight"] += 0.25
    new["extra.1.scale"] += 1
    model.load_state_dict(new)
    reference.load_state_dict(new)
    check_outputs(model, reference, rank, steps=1)
    # different values on different ranks: refused on every rank, the true bytes unchanged
    bad = {k: v.clone() for k, v in new.items()}
    bad["blocks.3.b.weight"] += rank
    expect_split_error(rank, lambda: model.load_state_dict(bad), ["different values", "blocks.3.b.weight"])
    sd = model.state_dict()
    for k in sd:
        assert torch.equal(sd[k].cpu(), new[k]), k
    check_outputs(model, reference, rank, steps=1)  # at once: the refused value never reached a slot
    layerwise.remove_layerwise_offload(model)
    for (k, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), k
    assert not split._LIVE or all(g._thread is None for g in split._LIVE)


def scenario_load(rank, world, tmp):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    reference = Net()
    path = os.path.join(tmp, f"ckpt-{world}.safetensors")
    if rank == 0:
        save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, path)
    dist.barrier()
    model = layerwise.empty_model(Net)
    read = [0]
    real = os.preadv

    def counting(fd, buffers, offset, *a):
        n = real(fd, buffers, offset, *a)
        read[0] += n
        return n

    os.preadv = counting
    try:
        managers = layerwise.load_offloaded(model, path, ["blocks", "extra"], device="cpu", prefetch_depth=1,
                                            resident_layers=1, split_fetch=dist.group.WORLD)
    finally:
        os.preadv = real
    streamed = sum(streamed_bytes(m) for m in managers)
    total = sum(v.numel() * v.element_size() for v in reference.state_dict().values())
    rest = total - streamed  # non-layer and resident weights: every rank reads them
    assert read[0] - rest <= streamed / world + 64 * 4 * 16, (read[0], rest, streamed)
    assert read[0] - rest >= streamed / world - 64 * 4 * 16, (read[0], rest, streamed)
    assert all_sum(read[0] - rest) <= streamed + 64 * world * 16 * 4
    check_outputs(model, reference, rank)
    layerwise.remove_layerwise_offload(model)
    for (k, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), k
    # cast while reading (the bf16 scales become fp32): each rank casts only its share's elements
    model = layerwise.empty_model(Net)
    layerwise.load_offloaded(model, path, ["blocks", "extra"], device="cpu", dtype=torch.float32,
                             split_fetch=dist.group.WORLD)
    check_outputs(model, reference, rank, steps=1)  # forward computes scale.float(): the same values
    layerwise.remove_layerwise_offload(model)


def scenario_pipeline(rank, world):
    class Holder:  # any object holding modules is a pipeline
        def __init__(self):
            torch.manual_seed(0)
            self.net = Net()
            self.post = nn.Linear(48, 8)

        def __call__(self, x):
            return self.post(self.net(x))

    holder = Holder()
    ref = Holder()
    managers = layerwise.offload_pipeline(holder, device="cpu", split_fetch=dist.group.WORLD)
    assert list(managers) == ["net"], managers
    assert all("split_fetch" in m.stats() for m in managers["net"])
    torch.manual_seed(100 + rank)
    x = torch.randn(3, 48)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(holder(x), ref(x))
    layerwise.remove_pipeline_offload(holder)


def expect_refused(rank, fn, words):
    try:
        fn()
    except (ValueError, RuntimeError, TypeError, OSError) as e:
        assert all(w in str(e) for w in words), (rank, str(e))
    else:
        raise AssertionError(f"rank {rank}: not refused ({words})")


def scenario_mismatch(rank, world):
    torch.manual_seed(0)
    model = Net(n=6 if rank == 0 else 5)  # rank 0 has one layer more
    before = {k: (p, p.data.clone()) for k, p in model.named_parameters()}
    expect_refused(rank, lambda: layerwise.configure_layerwise_offload(
        model, ["blocks", "extra"], device="cpu", split_fetch=dist.group.WORLD), ["layers per group", "Nothing"])
    for k, p in model.named_parameters():
        assert p is before[k][0] and torch.equal(p.data, before[k][1]), k
    assert not layerwise.managers_of(model) if hasattr(layerwise, "managers_of") else True
    # refused after the split check (a host budget too small): nothing of the split group is held
    torch.manual_seed(0)
    model = Net()
    expect_refused(rank, lambda: layerwise.configure_layerwise_offload(
        model, ["blocks", "extra"], device="cpu", host_budget=1 << 12, split_fetch=dist.group.WORLD),
        ["host_budget", "spill_dir="])
    assert all(g._users == 0 for g in split._LIVE), [g._users for g in split._LIVE]
    # same model, a different prefetch depth on one rank
    model = Net()
    expect_refused(rank, lambda: layerwise.configure_layerwise_offload(
        model, "blocks", device="cpu", prefetch_depth=1 + (rank == world - 1), split_fetch=dist.group.WORLD),
        ["prefetch_depth"])
    # a different dtype on one rank
    model = Net()
    if rank == 1:
        model.blocks[0].half()
    expect_refused(rank, lambda: layerwise.configure_layerwise_offload(
        model, "blocks", device="cpu", split_fetch=dist.group.WORLD), ["dtypes per layer"])
    # tensor-parallel (DTensor) weights: refused before any collective
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = Net()
    model.blocks[0].a.weight = nn.Parameter(distribute_tensor(model.blocks[0].a.weight.data, mesh, [Replicate()]))
    expect_refused(rank, lambda: layerwise.configure_layerwise_offload(
        model, "blocks", device="cpu", split_fetch=dist.group.WORLD), ["DTensor"])
    # the manager on its own, matching: works
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    layerwise.LayerwiseOffloadManager(model, "blocks", device="cpu", prefetch_depth=2,
                                      split_fetch=dist.group.WORLD)
    x = torch.randn(2, 48)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    layerwise.remove_layerwise_offload(model)
    # a rank that skips a forward: the others' next gather fails with a clear error (no hang)
    model = Net()
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", split_fetch=dist.group.WORLD)
    if rank == 0:
        t0 = time.perf_counter()
        with torch.no_grad():
            expect_split_error(rank, lambda: model(x), ["blocks[", "lockstep", "timed out"])
        assert time.perf_counter() - t0 < 30
    # last: a rank that never configures: the others time out with a clear error (no hang)
    dist.barrier()
    if rank == 0:
        time.sleep(4)
        return
    t0 = time.perf_counter()
    expect_refused(rank, lambda: layerwise.configure_layerwise_offload(
        Net(), "blocks", device="cpu", split_fetch=dist.group.WORLD), ["configuration check", "timeout"])
    assert time.perf_counter() - t0 < 30


def expect_split_error(rank, fn, words):
    """fn() raises SplitError (not ReadError, not a message torch swallows) naming `words`."""
    try:
        fn()
    except split.SplitError as e:
        assert all(w in str(e) for w in words), (rank, words, str(e))
        return str(e)
    except BaseException as e:  # noqa: BLE001 - the wrong type is the failure
        raise AssertionError(f"rank {rank}: {type(e).__name__} instead of SplitError: {e}") from e
    raise AssertionError(f"rank {rank}: no error ({words})")


def run_blocks(model, order, x):
    with torch.no_grad():
        for j in order:
            x = model.blocks[j](x)
    return x


def same_weights(model, reference):
    for (k, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.cpu(), q), k


def scenario_lockstep(rank, world):
    """A rank out of lockstep gets SplitError on every rank, naming both
    sides, never a wrong output and never an abort; in lockstep again, the model is exact."""
    for equal in (True, False):  # equal-size layers: gloo would pair them; unequal: gloo would abort
        torch.manual_seed(0)
        model = Net(equal=equal)
        reference = copy.deepcopy(model)
        layerwise.configure_layerwise_offload(model, "blocks", device="cpu", split_fetch=dist.group.WORLD)
        n = len(model.blocks)
        order = list(range(n)) if rank == 0 else list(range(n))[::-1]  # the others call the blocks reversed
        torch.manual_seed(100 + rank)
        x = torch.randn(3, 48)
        expect_split_error(rank, lambda: run_blocks(model, order, x),
                           ["out of lockstep", "rank 0 wanted", "rank", "blocks[", "Nothing was gathered"])
        check_outputs(model, reference, rank, steps=2)  # back in lockstep: exact
        # state_dict on rank 0 while the others run a forward
        if rank == 0:
            expect_split_error(rank, model.state_dict, ["out of lockstep", "host read", "forward's gather"])
        else:
            expect_split_error(rank, lambda: model(x), ["out of lockstep", "host read", "forward's gather"])
        check_outputs(model, reference, rank, steps=1)
        sd = model.state_dict()
        for k, v in reference.state_dict().items():
            assert torch.equal(sd[k].cpu(), v), k
        layerwise.remove_layerwise_offload(model)
        same_weights(model, reference)


def scenario_seeds(rank, world, tmp):
    """Ranks with different weights are refused at configure, on every
    rank, naming the first differing layer, the model unchanged."""
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        if rank == world - 1:
            model.blocks[2].b.weight[5, 7] += 1  # one element of one layer differs on one rank
    before = {k: (p, p.data.clone()) for k, p in model.named_parameters()}
    expect_split_error(rank, lambda: layerwise.configure_layerwise_offload(
        model, ["blocks", "extra"], device="cpu", split_fetch=dist.group.WORLD),
        ["different weights", "blocks[2]", "Nothing was changed"])
    for k, p in model.named_parameters():
        assert p is before[k][0] and torch.equal(p.data, before[k][1]), k
    assert not layerwise.contract.managers_of(model)
    # built with different seeds: refused, naming the first layer (blocks[0])
    class Holder:  # any object holding modules is a pipeline
        def __init__(self):
            torch.manual_seed(rank)
            self.net = Net()

    holder = Holder()
    expect_split_error(rank, lambda: layerwise.offload_pipeline(holder, device="cpu", split_fetch=dist.group.WORLD),
                       ["different weights", "blocks[0]"])
    assert not layerwise.contract.managers_of(holder.net)
    # load_offloaded of checkpoints saved from different weights (each rank its own file)
    from safetensors.torch import save_file

    path = os.path.join(tmp, f"seed-{rank}.safetensors")
    torch.manual_seed(rank)
    save_file({k: v.contiguous() for k, v in Net().state_dict().items()}, path)
    model = layerwise.empty_model(Net)
    expect_split_error(rank, lambda: layerwise.load_offloaded(model, path, ["blocks", "extra"], device="cpu",
                                                              split_fetch=dist.group.WORLD),
                       ["different weights", "blocks[0]", "Nothing was changed"])
    assert not layerwise.contract.managers_of(model)
    assert all(p.is_meta for p in model.parameters())
    # the same weights: accepted and exact (the check does not refuse what matches)
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    layerwise.configure_layerwise_offload(model, ["blocks", "extra"], device="cpu", split_fetch=dist.group.WORLD)
    check_outputs(model, reference, rank, steps=1)
    layerwise.remove_layerwise_offload(model)


def scenario_refused_load(rank, world):
    """A load_state_dict refused because the ranks loaded different values
    raises SplitError and leaves state_dict, forward and remove showing the true weights."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    layerwise.configure_layerwise_offload(model, ["blocks", "extra"], device="cpu", split_fetch=dist.group.WORLD)
    check_outputs(model, reference, rank, steps=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = {k: v.clone() for k, v in before.items()}
    bad["blocks.3.b.weight"] += rank + 1  # different on every rank
    expect_split_error(rank, lambda: model.load_state_dict(bad), ["different values", "blocks.3.b.weight",
                                                                  "Nothing was changed"])
    sd = model.state_dict()
    for k, v in before.items():
        assert torch.equal(sd[k], v), (rank, k)
    check_outputs(model, reference, rank, steps=2)  # exact at once: no "in-place write" on the way
    # the layer-level check (peft merges and edits go through it): a refused write of
    # layer 3, and an edit of what read() gave, leave the truth as it was
    m = layerwise.contract.managers_of(model)[0]
    m.sources[3].read().add_(1)  # a copy: editing it changes nothing
    expect_split_error(rank, lambda: m.write_layer(3, lambda block: block.add_(rank + 1)),
                       ["ranks wrote different values", "blocks[3]", "Nothing was changed"])
    for k, v in model.blocks[3].state_dict().items():  # layer 3 read first (what a one-entry cache would give)
        assert torch.equal(v, before[f"blocks.3.{k}"]), (rank, k)
    sd = model.state_dict()
    for k, v in before.items():
        assert torch.equal(sd[k], v), (rank, k)
    check_outputs(model, reference, rank, steps=1)
    # new values everywhere (the same on every rank) but one late layer that differs per rank:
    # refused before any layer changed, not after the layers before it were written
    bad = {k: v.clone() + 0.5 + (rank if k.startswith("extra.1.") else 0) for k, v in before.items()}
    expect_split_error(rank, lambda: model.load_state_dict(bad),
                       ["different values", "extra.1.", "Nothing was changed"])
    sd = model.state_dict()
    for k, v in before.items():
        assert torch.equal(sd[k], v), (rank, k)
    check_outputs(model, reference, rank, steps=1)
    # the same through a submodule's load_state_dict
    sub = {k[len("blocks.4."):]: v + rank for k, v in bad.items() if k.startswith("blocks.4.")}
    expect_split_error(rank, lambda: model.blocks[4].load_state_dict(sub), ["different values", "Nothing was changed"])
    check_outputs(model, reference, rank, steps=1)
    layerwise.remove_layerwise_offload(model)
    same_weights(model, reference)


def scenario_gather_error(rank, world):
    """A gather that fails in a forward is a SplitError."""
    torch.manual_seed(0)
    model = Net()
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", split_fetch=dist.group.WORLD)
    x = torch.randn(2, 48)
    if rank == 0:  # the others skip the forward: rank 0's gathers time out
        with torch.no_grad():
            expect_split_error(rank, lambda: model(x), ["blocks[", "timed out", "lockstep"])
        m = layerwise.contract.managers_of(model)[0]

        def edit():  # what peft's merge runs: the layer's true weights in its slot (a gather)
            with layerwise.contract.editing(m, 3):
                pass

        expect_split_error(rank, edit, ["blocks[3]"])
    dist.barrier()  # (main ends with os._exit: the timed-out collective leaves the group unusable)
    # a local copy that fails on one rank: the others hear of it at once (no timeout), and
    # the group stays usable: the next forwards in lockstep are exact
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu", split_fetch=dist.group.WORLD)
    real = split.ShareSource.fetch

    def poisoned(self, i, dst, after, timing):  # this copy chains after an event that failed
        split.ShareSource.fetch = real
        ev = layerwise._native._C.host_event()
        ev.fail("injected: the event before this layer's local copy failed")
        return real(self, i, dst, ev, timing)

    if rank == world - 1:
        split.ShareSource.fetch = poisoned
    x = torch.randn(2, 48)
    with torch.no_grad():  # told, not timed out (the timeout's error says "timed out" and names no rank)
        words = ["injected"] if rank == world - 1 else [f"rank {world - 1} wanted to say that its local copy failed"]
        expect_split_error(rank, lambda: model(x), words)
    check_outputs(model, reference, rank, steps=2)

class Block16(Block):
    def forward(self, x):
        return x + self.b(torch.relu(self.a(x))) * self.scale


class Net16(Net):
    """Net in bf16 throughout (the codec encodes bf16 and fp16 segments)."""

    def __init__(self, d=128):  # layers large enough that a disk tier's staging costs less than it saves
        super().__init__(d=d)
        self.blocks = nn.ModuleList([Block16(d, i) for i in range(6)])
        self.extra = nn.ModuleList([Block16(d, i) for i in range(3)])
        self.to(torch.bfloat16)


def weight_like(seed=0):
    """A Net16 with trained-weight statistics (normal, std 0.02): what the codec sees."""
    torch.manual_seed(seed)
    net = Net16()
    with torch.no_grad():
        for p in list(net.blocks.parameters()) + list(net.extra.parameters()):
            p.normal_(0, 0.02)
    return net


def check_bf16(model, reference, rank, steps=2):
    torch.manual_seed(100 + rank)
    xs = [torch.randn(3, reference.embed.in_features).to(torch.bfloat16) for _ in range(2)]
    with torch.no_grad():
        for _ in range(steps):
            for x in xs:
                assert torch.equal(model(x), reference(x)), rank


def smallest_budget(offload, start=64 << 10, step=8 << 10):
    """The smallest host_budget (start plus a multiple of `step`) that `offload(budget)`
    accepts (then every streamed layer but what must stay is on disk): a refused one
    names what host memory needs, the next try is that. Rank-local without split
    fetch; with it, every rank makes the same calls (the ranks' plans are alike)."""
    budget = start
    while True:
        try:
            model = offload(budget)
        except ValueError as e:
            need = re.search(r"host memory needs [^(]*\((\d+) bytes", str(e))
            assert "too small" in str(e) and need, e
            nxt = start + -(-(int(need[1]) - start) // step) * step
            assert nxt > budget, (budget, str(e))  # what it named is more than what it refused
            budget = nxt
            continue
        layerwise.remove_layerwise_offload(model)
        return budget


@dataclasses.dataclass
class Subject:
    """A model the tier scenarios stream: `build(seed)` gives it with weight-like bf16
    layers, `empty()` the same on meta (for load_offloaded), `groups` the streamed
    block lists; `check(model, reference, rank, steps)` asserts bitwise outputs on
    inputs of this rank's own; `rounds`: (tiers, prefetch_depth, resident_layers) to
    run, the tiers split fetch is composed with ("ckpt": load_offloaded, its disk
    layers read from the checkpoint, or with "spill" from spill files of their own);
    `recopies`: every group re-copies streamed layers in every step."""
    name: str
    build: Callable[[int], nn.Module]
    empty: Callable[[], nn.Module]
    groups: object
    check: Callable
    rounds: tuple = tuple((combo, depth, resident) for combo in (("compress",), ("spill",), ("spill", "compress"),
                                                                  ("ckpt",), ("ckpt", "compress"))
                          for depth, resident in ((1, 0), (2, 1)))
    recopies: bool = False


NET16 = Subject("Net16", lambda seed=0: weight_like(seed), lambda: layerwise.empty_model(Net16), "blocks", check_bf16)


def real_subject(name):
    """A tiny real architecture of tests/helpers/archs.py in bf16, its block lists'
    weights normal with std 0.02 (as trained ones: what the codec shrinks). Flux gets
    6 dual-stream blocks (and its 7 single ones) so that at the depths and resident
    layers of its rounds both groups re-copy layers through shared slots in every step."""
    from helpers import archs as real

    arch = real.ARCHS[name]
    if name == "flux":
        arch = dataclasses.replace(arch, build=functools.partial(real._flux, num_layers=6))

    def build(seed=0):
        torch.manual_seed(seed)
        model = arch.build().eval().to(torch.bfloat16)
        with torch.no_grad():
            for g in arch.groups:
                for p in model.get_submodule(g).parameters():
                    p.normal_(0, 0.02)
        return model

    def check(model, reference, rank, steps=2):
        for _ in range(steps):
            for seed in (100 + rank, 200 + rank):  # different inputs on every rank
                out, ref = real.run_bf16(arch, model, seed), real.run_bf16(arch, reference, seed)
                assert torch.equal(out, ref), (name, rank, seed, (out.float() - ref.float()).abs().max().item())

    empty = lambda: layerwise.empty_model(lambda: arch.build().eval().to(torch.bfloat16))
    # Every tier at depth 1 or 2, all three at both (wall time). A checkpoint's staging slot
    # takes two pages per tensor more than the layer: for layers this small the disk tier
    # saves nothing, so load_offloaded spills its disk layers.
    rounds = ((("compress",), 1, 1), (("spill",), 2, 0), (("spill", "compress"), 1, 1), (("spill", "compress"), 2, 0),
              (("ckpt", "spill", "compress"), 2, 0))
    return Subject(name, build, empty, arch.groups, check, rounds=rounds, recopies=True)


def configure_spilled(spill, budget, subject=NET16, **options):
    """subject's model streaming its groups, with host_budget=budget and spill files in `spill` (None: no budget)."""
    model = subject.build()
    if budget is not None:
        options.update(host_budget=budget, spill_dir=spill)
    layerwise.configure_layerwise_offload(model, subject.groups, **options)
    return model


def scenario_tiers(rank, world, tmp, subjects=(NET16,)):
    """Split fetch composes with compression and the disk tier, bitwise, with
    the contract: split + compress (each rank encodes its share), disk + split (each rank
    reads only its share, from its spill file or from the checkpoint), all three."""
    from safetensors.torch import save_model

    for subject in subjects:
        reference = subject.build()
        ckpt = os.path.join(tmp, f"tiers-{subject.name}-{world}.safetensors")
        if rank == 0:
            save_model(reference, ckpt)  # (drops duplicate names of tied tensors, as real checkpoints do)
        dist.barrier()
        spill = os.path.join(tmp, f"spill-{rank}")
        os.makedirs(spill, exist_ok=True)
        for combo, depth, resident in subject.rounds:
            what = f"{subject.name} {combo} depth {depth} resident {resident}"
            t0 = time.perf_counter()
            tier_round(rank, world, subject, reference, combo, depth, resident, ckpt, spill, what)
            print(f"{what}: {time.perf_counter() - t0:.1f} s", flush=True)
            assert not os.listdir(spill), (what, os.listdir(spill))


def tier_round(rank, world, subject, reference, combo, depth, resident, ckpt, spill, what):
    """One round of scenario_tiers: subject streamed with split fetch and the tiers in
    `combo` at one depth, checked on this rank, then removed."""
    from helpers import archs as real

    # One staging slot per group: the staging a disk tier costs stays below what the
    # shares save, so a budget just above the smallest keeps some layers in memory.
    kw = dict(device="cpu", prefetch_depth=depth, resident_layers=resident, split_fetch=dist.group.WORLD,
              debug_copy_delay_us=200, compress="lossless" if "compress" in combo else None)
    if "ckpt" in combo or "spill" in combo:
        kw.update(disk_prefetch_depth=1)
    local = {k: v for k, v in kw.items() if k != "split_fetch"}
    if "ckpt" in combo:
        def load(budget, **more):
            model = subject.empty()
            layerwise.load_offloaded(model, ckpt, subject.groups, host_budget=budget,
                                     spill_dir=spill if "spill" in combo else None, **more)
            return model

        # just above the smallest budget: with shares half as large, some layers stay in memory
        budget = smallest_budget(lambda b: load(b, **local))
        model = load(budget, **kw)
    else:
        configure = functools.partial(configure_spilled, spill, subject=subject)
        budget = None
        if "spill" in combo:
            budget = smallest_budget(lambda b: configure(b, **local))
        model = configure(budget, **kw)
    as_stored = "ckpt" in combo and "spill" not in combo  # disk layers read from the checkpoint as stored
    managers = layerwise.contract.managers_of(model)
    assert len(managers) == (1 if isinstance(subject.groups, str) else len(subject.groups)), (what, managers)
    plan = [r for m in managers for r in m.stats()["tier_plan"]]
    if "spill" in combo or "ckpt" in combo:
        assert any(r.startswith("spill" if "spill" in combo else "checkpoint") for r in plan), (what, plan)
    assert all("share" in r for r in plan if not r.startswith("device")), (what, plan)
    subject.check(model, reference, rank)
    subject.check(model, reference, rank, steps=1)
    for m in managers:
        st = m.stats(sync=True)
        last = st["last_step"]
        share = st["split_fetch"]["share_bytes"]
        if subject.recopies:  # every group streams: layers re-copied, and gathered, in every step
            assert real.recopied(m) > 0 and last["bytes_raw"] > 0, (what, m.layer_name, last)
        # this rank copies (and reads) only its share: encoded, at most 0.80x of it
        if "compress" in combo and not as_stored:
            assert last["bytes_copied"] <= 0.80 * last["bytes_raw"] / world + 4096, (what, m.layer_name, last)
        else:
            assert last["bytes_copied"] <= last["bytes_raw"] / world + 4096, (what, m.layer_name, last)
        if st["disk"] is not None:
            assert last["bytes_read"] <= share + 4096 * len(m.tiers.disk_layers) * 4, (what, last, share)
            # the host plan counted the staging this rank allocates: its shares, not whole layers
            # (exactly for raw layers in spill files; encoded ones and checkpoint reads: at most)
            planned = m.options.disk_staging_slots * staging_slot_bytes(
                m, m.tiers.disk_layers, spill=m.tiers.disk_where == "spill")
            staged = st["disk"]["staging_bytes"]
            exact = m.tiers.disk_where == "spill" and m.options.compress is None
            assert staged <= planned and (planned == staged or not exact), (what, planned, staged)
    sd = model.state_dict()  # collective: the true bytes, gathered
    ref_sd = reference.state_dict()
    assert sd.keys() == ref_sd.keys(), what
    for k, v in ref_sd.items():
        assert torch.equal(sd[k], v), (what, k)
    if not as_stored:  # (checkpoint layers are read-only)
        other = subject.build(5)
        model.load_state_dict(other.state_dict())
        subject.check(model, other, rank, steps=1)
        model.load_state_dict(reference.state_dict())
    layerwise.remove_layerwise_offload(model)
    for (k, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), (what, k)


def scenario_real_tiers(rank, world, tmp):
    """Scenario_tiers on a tiny Flux (two groups) and Llama."""
    scenario_tiers(rank, world, tmp, subjects=(real_subject("flux"), real_subject("llama")))


def scenario_sigint(rank, world, tmp, subject=NET16):
    """Real SIGINTs, delivered on every rank at the same point (the k-th
    call of a stage, k drawn from a seed every rank shares), during configure,
    forward and remove with disk + compress + split: each is interrupted cleanly
    (configure rolls back, a forward leaves the model streaming, remove leaves it
    streaming), and the next calls, made in lockstep again, are exact."""
    import random
    import signal

    from layerwise.runtime import host_store
    from layerwise.stages import transfer

    # Python's own handler, even where the rank started with SIGINT ignored (started in the
    # background by a shell without job control: the interrupts would never arrive)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    reference = subject.build()
    spill = os.path.join(tmp, f"sigint-{subject.name}-{rank}")
    os.makedirs(spill, exist_ok=True)
    kw = dict(device="cpu", prefetch_depth=1, split_fetch=dist.group.WORLD, compress="lossless",
              disk_prefetch_depth=1, debug_copy_delay_us=100)

    configure = functools.partial(configure_spilled, spill, subject=subject)
    local = {k: v for k, v in kw.items() if k != "split_fetch"}
    budget = smallest_budget(lambda b: configure(b, **local))
    rng = random.Random(1234)  # the same draws on every rank

    def interrupt_at(owner, name, k):
        """Deliver SIGINT from inside the k-th call of owner.name (every rank alike)."""
        real = getattr(owner, name)
        calls = [0]

        def wrapped(*a, **kw_):
            calls[0] += 1
            if calls[0] == k:
                os.kill(os.getpid(), signal.SIGINT)
            return real(*a, **kw_)

        setattr(owner, name, wrapped)
        return lambda: setattr(owner, name, real), calls

    def interrupted(owner, name, k, call):
        """call() with SIGINT at the k-th call of owner.name: it must be interrupted."""
        undo, calls = interrupt_at(owner, name, k)
        try:
            call()
            raise AssertionError(f"rank {rank}: the interrupt did not arrive ({name} called {calls[0]} times, "
                                 f"SIGINT at call {k})")
        except KeyboardInterrupt:
            pass
        finally:
            undo()
        dist.barrier()

    # configure, interrupted while its layers are packed (every rank rolls back)
    for _ in range(3):
        # (a packed parameter's placeholder: called only while the layers are packed)
        interrupted(host_store.HostLayers, "placeholder", rng.randint(1, 12), lambda: configure(budget, **kw))
    model = configure(budget, **kw)
    plan = [r for m in layerwise.contract.managers_of(model) for r in m.stats()["tier_plan"]]
    assert any(r.startswith("spill, encoded, share") for r in plan), plan
    # forwards, interrupted at a fetch
    for _ in range(4):
        interrupted(transfer.Transfer, "copy", rng.randint(1, 10), lambda: subject.check(model, reference, rank, steps=2))
        subject.check(model, reference, rank, steps=1)  # in lockstep again: exact
    # remove, interrupted while it reads the layers back: the model still streams exactly
    interrupted(host_store, "materialize", rng.randint(1, 4), lambda: layerwise.remove_layerwise_offload(model))
    subject.check(model, reference, rank, steps=1)
    layerwise.remove_layerwise_offload(model)
    for (k, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), k
    assert not os.listdir(spill), os.listdir(spill)


def scenario_real_sigint(rank, world, tmp):
    """Scenario_sigint on the two-group Flux and on Llama."""
    for name in ("flux", "llama"):
        scenario_sigint(rank, world, tmp, subject=real_subject(name))


def exact_then_removed(model, reference, rank, spill, what):
    """state_dict (collective) gives `reference`'s weights; remove leaves them in the
    model and no spill file behind."""
    sd = model.state_dict()
    for k, v in reference.state_dict().items():
        assert torch.equal(sd[k], v), (rank, what, k)
    layerwise.remove_layerwise_offload(model)
    same_weights(model, reference)
    assert not os.listdir(spill), (what, os.listdir(spill))


def scenario_write_fails(rank, world, tmp):
    """Found by attacking the chains (tests/stages/test_chain_recovery.py): a load_state_dict whose
    write of a split layer's share fails on one rank only: disk + split with that rank's
    disk full (its spill-file write), split + compress with its re-encode out of memory (an
    in-memory layer), and all three. The others must hear of it (as they do of a local copy
    that fails, scenario_gather_error) and undo their own write: every rank raises the same
    SplitError naming the rank and what failed, no rank keeps a share the others do not
    have, and the group stays usable: state_dict, forwards, a retried load_state_dict and
    remove in lockstep are exact afterwards."""
    import errno

    from layerwise.stages import decode, disk

    os.environ["LAYERWISE_COLLECTIVE_TIMEOUT_S"] = "10"  # (read at configure: a rank left waiting fails sooner)
    reference, other = weight_like(), weight_like(seed=5)

    def full(self, *a, **kw):
        raise OSError(errno.ENOSPC, "injected: No space left on device")

    def no_memory(self, *a, **kw):
        raise RuntimeError("injected: DefaultCPUAllocator: not enough memory")

    # (combo, the rank whose write fails, what fails there, the words its error has)
    cases = [("spill", 0, (disk.DiskSource, "write", full), "No space left on device"),
             ("compress", world - 1, (decode.CodecTier, "keep", no_memory), "not enough memory"),
             ("spill+compress", 0, (disk.DiskSource, "write", full), "No space left on device")]
    for combo, bad, (owner, name, fails), words in cases:
        spill = os.path.join(tmp, f"spill-{rank}-{combo}")
        os.makedirs(spill, exist_ok=True)
        kw = dict(device="cpu", prefetch_depth=1, compress="lossless" if "compress" in combo else None)
        if "spill" in combo:
            kw.update(disk_prefetch_depth=1)

        def configure(budget, **more):
            return configure_spilled(spill, budget, **kw, **more)

        budget = smallest_budget(configure) if "spill" in combo else None
        model = configure(budget, split_fetch=dist.group.WORLD)
        plan = layerwise.contract.managers_of(model)[0].stats()["tier_plan"]
        want = {"spill": "spill, share", "compress": "arena, encoded, share", "spill+compress": "spill, encoded, share"}
        assert any(r.startswith(want[combo]) for r in plan), (combo, plan)
        check_bf16(model, reference, rank, steps=1)
        real = getattr(owner, name)
        if rank == bad:
            setattr(owner, name, fails)
        try:
            message = expect_split_error(rank, lambda: model.load_state_dict(other.state_dict()),
                                         [f"rank {bad}", words, "Nothing of it was changed"])
        finally:
            setattr(owner, name, real)
        said = [None] * world
        dist.all_gather_object(said, message)
        assert all(m == message for m in said), (rank, combo, said)  # the same error on every rank
        sd = model.state_dict()  # collective: every rank's share of every layer
        for k, v in sd.items():  # each weight old or new (load_state_dict stops at the failure, as torch's does)
            assert torch.equal(v, reference.state_dict()[k]) or torch.equal(v, other.state_dict()[k]), (rank, combo, k)
        mixed = weight_like()
        mixed.load_state_dict(sd)
        check_bf16(model, mixed, rank, steps=1)
        model.load_state_dict(other.state_dict())  # the retry, disk space (memory) back
        check_bf16(model, other, rank, steps=1)
        exact_then_removed(model, other, rank, spill, combo)


def scenario_read_fails(rank, world, tmp):
    """Found by attacking the chains (tests/stages/test_chain_recovery.py): disk + split (and
    compress), and rank 0's spill file is modified under it. Its read fails (ReadError,
    CRC-32 differs); that must reach the other ranks as a local failure (LOCAL_FAILED, as
    a failed local copy does: scenario_gather_error), not leave them waiting for the
    timeout, which broke the group for good (no forward, state_dict or remove worked
    on any rank again). Restored, the file streams exactly again on every rank."""
    os.environ["LAYERWISE_COLLECTIVE_TIMEOUT_S"] = "20"  # (read at configure)
    reference = weight_like()
    for combo in ("spill", "spill+compress"):
        spill = os.path.join(tmp, f"spill-{rank}-{combo}")
        os.makedirs(spill, exist_ok=True)
        kw = dict(device="cpu", prefetch_depth=1, disk_prefetch_depth=1,
                  compress="lossless" if "compress" in combo else None)

        def configure(budget, **more):
            model = weight_like()
            layerwise.configure_layerwise_offload(model, "blocks", host_budget=budget, spill_dir=spill, **kw, **more)
            return model

        model = configure(smallest_budget(configure), split_fetch=dist.group.WORLD)
        m = layerwise.contract.managers_of(model)[0]
        plan = m.stats()["tier_plan"]
        assert any(r.startswith("spill, encoded, share" if "compress" in combo else "spill, share") for r in plan), plan
        check_bf16(model, reference, rank, steps=1)
        (path,) = [os.path.join(spill, f) for f in os.listdir(spill)]
        original = open(path, "rb").read()
        if rank == 0:  # the same size, other bytes in the region of a layer read from disk
            disk_src = [h for src in m.sources for h in src.holders() if h.kind == "disk"]
            with open(path, "r+b") as f:
                f.seek(disk_src[-1].spill_offset + 64)
                f.write(bytes(256))
        dist.barrier()
        raised = 0
        for _ in range(3):  # (the first forward may use a read queued before the change)
            try:
                check_bf16(model, reference, rank, steps=1)
            except split.SplitError as e:
                raised += 1  # told at once: rank 0's error, not the timeout's (which names no rank)
                assert "rank 0 wanted to say that its local copy failed" in str(e), (rank, str(e))
            dist.barrier()
        assert raised >= 2, (rank, combo, raised)
        if rank == 0:
            with open(path, "r+b") as f:
                f.write(original)
        dist.barrier()
        check_bf16(model, reference, rank, steps=2)
        exact_then_removed(model, reference, rank, spill, combo)


def scenario_quantized(rank, world, tmp):
    """Torchao / quanto quantized layers (wrapper tensors streamed as their
    plain leaves) with split fetch alone, with the disk tier (spill files), and with
    disk + compress: bitwise on every rank (inputs of its own) against the resident
    quantized model; each rank copies about 1/N of the quantized bytes (and reads at
    most its share); state_dict (collective), a load_state_dict round trip, a load
    with different values per rank refused, remove bitwise, spill files deleted."""
    from helpers import quantized as tq

    spill = os.path.join(tmp, f"qspill-{rank}")
    os.makedirs(spill, exist_ok=True)
    n = 6
    for kind in ("ao-int8", "ao-fp8", "quanto-qint4"):
        reference = tq.make(kind, n=n)
        sd_ref = reference.state_dict()
        quant = tq.stored_bytes(reference.blocks)
        torch.manual_seed(100 + rank)  # different inputs on every rank
        xs = [torch.randn(2, tq.D).to(torch.bfloat16) for _ in range(2)]
        expect = tq.run(reference, xs)
        for combo, depth in ((("split",), 1), (("split", "spill"), 2), (("split", "spill", "compress"), 1)):
            what = f"{kind} {combo} depth {depth}"
            kw = dict(device="cpu", prefetch_depth=depth, split_fetch=dist.group.WORLD, debug_copy_delay_us=200,
                      compress="lossless" if "compress" in combo else None)

            def offload(budget, **more):
                model = tq.make(kind, n=n)
                if budget is not None:
                    more.update(host_budget=budget, spill_dir=spill, disk_prefetch_depth=1)
                layerwise.configure_layerwise_offload(model, "blocks", **more)
                return model

            budget = None
            if "spill" in combo:  # (the same calls on every rank: the ranks' plans are alike)
                budget = smallest_budget(lambda b: offload(b, **kw)) + quant // n // world  # ~1 share in memory
            model = offload(budget, **kw)
            [m] = layerwise.contract.managers_of(model)
            plan = m.stats()["tier_plan"]
            assert all("share" in r for r in plan), (what, plan)
            if "spill" in combo:
                assert m.tiers.disk_layers, (what, plan)
            for _ in range(3):
                for out, want in zip(tq.run(model, xs), expect):
                    assert torch.equal(out, want), (what, rank)
            tq.assert_computes_from_slots(model)
            st = m.stats(sync=True)
            last, share = st["last_step"], st["split_fetch"]["share_bytes"]
            assert all_sum(share) == streamed_bytes(m), (what, share)
            assert last["bytes_raw"] > 0 and last["bytes_copied"] <= last["bytes_raw"] / world + 4096, (what, last)
            assert last["bytes_copied"] <= 1.15 * quant / world + 4096, (what, last, quant)
            if st["disk"] is not None:
                assert 0 < last["bytes_read"] <= share + 4096 * len(m.tiers.disk_layers), (what, last, share)
            print(f"{what}: quantized {quant} B, copied {last['bytes_copied']} B/step on rank {rank}, "
                  f"read {last.get('bytes_read')} B", flush=True)
            tq.assert_state_equal(model.state_dict(), sd_ref)
            other = tq.make(kind, seed=5, n=n)
            model.load_state_dict(other.state_dict())
            for out, want in zip(tq.run(model, xs), tq.run(other, xs)):
                assert torch.equal(out, want), (what, rank)
            tq.assert_state_equal(model.state_dict(), other.state_dict())
            # the ranks differ in the last layer's quantized weights only (its biases are alike):
            # refused before the first layers are written
            mine = tq.make(kind, seed=7 + rank, n=n).state_dict()
            bad = {k: mine[k] if k.startswith(f"blocks.{n - 1}.") and "bias" not in k else v
                   for k, v in sd_ref.items()}
            expect_split_error(rank, lambda: model.load_state_dict(bad), ["different values", f"blocks.{n - 1}."])
            tq.assert_state_equal(model.state_dict(), other.state_dict())
            model.load_state_dict(sd_ref)
            layerwise.remove_layerwise_offload(model)
            tq.assert_state_equal(model.state_dict(), sd_ref)
            for out, want in zip(tq.run(model, xs), expect):
                assert torch.equal(out, want), (what, rank)
            assert not os.listdir(spill), (what, os.listdir(spill))


def scenario_bitsandbytes(rank, world):
    """bitsandbytes configured before its first forward, which repacks nf4 weights
    and casts fp32 biases to bf16 in their place: each rebind becomes the layer's
    true bytes on every rank (a collective write of the shares), with split fetch
    alone and with compress; bitwise on every rank (inputs of its own) against the
    resident model, state_dict, remove."""
    from helpers import bnb as tb

    for kind in ("nf4", "int8"):
        for compress in (None, "lossless"):
            what = f"{kind} compress={compress}"
            reference, model = tb.make(kind, mix=True), tb.make(kind, mix=True)
            [m] = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", split_fetch=dist.group.WORLD,
                                                        compress=compress, debug_copy_delay_us=200)
            assert all("share" in r for r in m.stats()["tier_plan"]), what
            torch.manual_seed(100 + rank)  # different inputs on every rank
            xs = [torch.randn(2, tb.D).to(torch.bfloat16) for _ in range(2)]
            for _ in range(3):
                assert tb.same(tb.run(model, xs), tb.run(reference, xs)), (what, rank)
            tb.assert_computes_from_slots(model)
            tb.assert_state_equal(model.state_dict(), reference.state_dict())
            assert tb.same(tb.run(model, xs), tb.run(reference, xs)), (what, rank)
            layerwise.remove_layerwise_offload(model)
            assert tb.same(tb.run(model, xs), tb.run(reference, xs)), (what, rank)
            tb.assert_state_equal(model.state_dict(), reference.state_dict())


SCENARIOS = {"lockstep": scenario_lockstep, "seeds": scenario_seeds, "refused_load": scenario_refused_load,
             "gather_error": scenario_gather_error, "tiers": scenario_tiers, "write_fails": scenario_write_fails,
             "read_fails": scenario_read_fails, "sigint": scenario_sigint,
             "real_tiers": scenario_real_tiers, "real_sigint": scenario_real_sigint, "quantized": scenario_quantized,
             "bitsandbytes": scenario_bitsandbytes}


def main(rank, world, port, tmp, scenario=None):
    # 2 s where a check waits for a timeout on purpose; elsewhere long enough for a loaded machine
    timeout_s = "2" if scenario in (None, "gather_error") else "60"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LAYERWISE_COLLECTIVE_TIMEOUT_S=timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    t0 = time.perf_counter()
    if scenario is not None:
        fn = SCENARIOS[scenario]
        with_tmp = (scenario_seeds, scenario_tiers, scenario_sigint, scenario_write_fails, scenario_read_fails,
                    scenario_real_tiers, scenario_real_sigint, scenario_quantized)
        fn(rank, world, tmp) if fn in with_tmp else fn(rank, world)
        print(f"rank {rank} ok ({time.perf_counter() - t0:.1f} s)", flush=True)
        os._exit(0)
    scenario_equal(rank, world, depth=1, resident=0)
    scenario_equal(rank, world, depth=2, resident=2, contract=False)
    scenario_load(rank, world, tmp)
    scenario_pipeline(rank, world)
    scenario_mismatch(rank, world)
    print(f"rank {rank} ok ({time.perf_counter() - t0:.1f} s)", flush=True)
    os._exit(0)  # the timed-out collective of the last check leaves the group unusable: no teardown


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:])
