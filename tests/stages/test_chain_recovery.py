"""Faults injected into the chains of stages: disk + compress, a
failure or a real SIGINT at each point of a chain, writes that change a
payload's size, split ranks whose disk fails. Each test here is a bug found by
attacking the chain (CPU backend, spill files on a real file system), kept as
the regression test of its fix."""
import os
import signal

import pytest
import torch

import layerwise
from layerwise.stages import disk as disk_mod

from helpers.disk import budget, inputs, make, spill_files


def weight_like(seed=0, **kw):
    """Trained-weight statistics (normal, std 0.02): bf16 that the codec shrinks."""
    net = make(seed=seed, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return net


def offload(model, spill_dir, **kw):
    """disk + compress: some layers encoded in a spill file, the others encoded in memory."""
    kw.setdefault("host_budget", budget(model, 0, depth=kw.get("prefetch_depth", 1)))
    (m,) = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", spill_dir=spill_dir,
                                                 compress="lossless", **kw)
    plan = m.stats()["tier_plan"]
    assert "spill, encoded" in plan, plan
    return m


def assert_exact(model, ref, xs):
    with torch.no_grad():
        for x in xs:
            assert torch.equal(model(x), ref(x))
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k


def remove_and_check(model, ref, xs, spill_dir):
    layerwise.remove_layerwise_offload(model)
    assert spill_files(spill_dir) == []
    assert_exact(model, ref, xs)


# ---------------------------------------------- a fetch that failed poisons the codec's staging
@pytest.mark.parametrize("k", [1, 2, 3])
def test_ctrl_c_while_an_encoded_spilled_layer_is_read_leaves_the_next_forwards_exact(disk_dir, monkeypatch, k):
    """A real SIGINT while a forward waits for the read of an encoded layer in a spill
    file. The manager forgets the deferred fetches queued (Chain.forget), but the codec
    stage kept the forgotten one as the last user of its staging buffer and chained
    every later copy into that buffer after it: every later forward raised 'internal:
    a forgotten deferred fetch was used', until remove."""
    ref, model, xs = weight_like(), weight_like(), inputs()
    offload(model, disk_dir, debug_read_delay_us=300)
    with torch.no_grad():
        model(xs[0])
    real = disk_mod.DiskTier._wait_reads
    calls = []

    def wait_reads(self, s):
        calls.append(1)
        if len(calls) == k:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, while the hook waits for the read
        return real(self, s)

    monkeypatch.setattr(disk_mod.DiskTier, "_wait_reads", wait_reads)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(xs[1])
    monkeypatch.setattr(disk_mod.DiskTier, "_wait_reads", real)
    for _ in range(2):
        assert_exact(model, ref, xs)
    remove_and_check(model, ref, xs, disk_dir)


def test_an_encoded_spill_file_modified_then_restored_streams_exactly_again(disk_dir):
    """The disk tier's promise: a file whose bytes differ raises ReadError at every
    forward that needs them, and streams exactly again once restored. With the layers
    encoded, the failed read's error stayed with the codec's staging buffer, so every
    later fetch through it raised that ReadError again, restored file or not."""
    ref, model, xs = weight_like(), weight_like(), inputs()
    m = offload(model, disk_dir)
    assert_exact(model, ref, xs)
    (path,) = spill_files(disk_dir)
    original = open(path, "rb").read()
    src = next(s for s in m.sources if s.kind == "lossless" and s.inner.kind == "disk")
    with open(path, "r+b") as f:  # same size, other bytes in an encoded layer's region
        f.seek(src.inner.spill_offset + 64)
        f.write(bytes(256))
    with torch.no_grad():  # (the layer's read for this forward was queued by the last one, before the change)
        try:
            model(xs[0])
        except disk_mod.ReadError:
            pass
    for _ in range(2):
        with pytest.raises(disk_mod.ReadError), torch.no_grad():
            model(xs[0])
    with open(path, "r+b") as f:
        f.write(original)
    for _ in range(2):
        assert_exact(model, ref, xs)
    remove_and_check(model, ref, xs, disk_dir)


# ---------------------------------------------- a load_state_dict whose write fails
def test_a_write_that_fails_in_load_state_dict_leaves_the_next_forward_working(disk_dir, monkeypatch):
    """A host allocation failure while load_state_dict re-encodes a layer (the codec's
    encode runs out of memory): load_state_dict reports it, as torch does for a copy
    that fails, and that layer keeps its old values (it is written whole, once per
    load), the others take their new ones. But the next forward raised
    'an in-place write to a streamed parameter ... was detected and discarded' (naming
    no parameter): torch had copied the refused value into the ring slot itself."""
    from layerwise.stages import decode as decode_mod

    ref, model, xs, new = weight_like(), weight_like(), inputs(), weight_like(7)
    offload(model, disk_dir)
    real = decode_mod.CodecTier.keep
    calls = []

    def keep(self, *args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory")
        return real(self, *args)

    monkeypatch.setattr(decode_mod.CodecTier, "keep", keep)
    with pytest.raises(RuntimeError, match="blocks.0.fc.weight.*not enough memory"):
        model.load_state_dict(new.state_dict())
    monkeypatch.setattr(decode_mod.CodecTier, "keep", real)
    sd = model.state_dict()
    for k, v in sd.items():
        assert torch.equal(v, (ref if k.startswith("blocks.0.") else new).state_dict()[k]), k
    mixed = weight_like()
    mixed.load_state_dict(sd)
    assert_exact(model, mixed, xs)  # raised "in-place write ... detected and discarded"
    model.load_state_dict(new.state_dict())
    assert_exact(model, new, xs)
    remove_and_check(model, new, xs, disk_dir)


# ---------------------------------------------- disk + split: a write that fails on one rank
def test_a_spill_write_that_fails_on_one_split_rank_leaves_every_rank_usable(tmp_path):
    """load_state_dict with disk + split, one rank's disk full: that rank raised and left,
    the others wrote their shares and waited in the next collective until the timeout,
    which broke the group for good (state_dict, forwards and even remove raised SplitError
    on every rank; the spill files stayed). The same with split + compress where one rank's
    re-encode runs out of memory (an in-memory layer), and with all three. Now every rank
    raises the same SplitError naming the rank and what failed, the ranks whose write
    succeeded undo it, and the group stays usable (state_dict, forward, a retried load and
    remove work)."""
    from helpers.ranks import run_ranks

    run_ranks(2, tmp_path, "write_fails")


# ---------------------------------------------- Ctrl-C inside a block called alone
@pytest.mark.parametrize("tiers", ["plain", "disk+compress"])
def test_ctrl_c_inside_a_block_called_alone_leaves_the_other_blocks_callable(disk_dir, tiers):
    """A real SIGINT while a block called on its own computes (a notebook user's Ctrl-C):
    afterwards every other block that shares its ring slot raised 'is called while layer
    blocks[3], which shares its ring slot 1, is still computing', until the next forward of
    the whole model."""
    ref, model = weight_like(), weight_like()
    if tiers == "plain":
        layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    else:
        offload(model, disk_dir)
    h = ref.embed(inputs()[0]).detach()
    handle = model.blocks[3].fc.register_forward_hook(lambda *a: os.kill(os.getpid(), signal.SIGINT))
    with torch.no_grad():
        with pytest.raises(KeyboardInterrupt):
            model.blocks[3](h)  # the Ctrl-C lands inside the block, between layerwise's hooks
        handle.remove()
        for i in [3, 5, 1, 7, 0, 2]:
            assert torch.equal(model.blocks[i](h), ref.blocks[i](h)), i
    remove_and_check(model, ref, inputs(), disk_dir)


# ---------------------------------------------- disk + split: a read that fails on one rank
def test_a_spill_read_that_fails_on_one_split_rank_is_told_to_the_others(tmp_path):
    """Rank 0's spill file modified under a disk + split model (with and without
    compress): its read failed inside the Deferred before the gather, so the gather
    (which tells the other ranks of a local failure) never ran; the other ranks waited
    in the lockstep check until the timeout, and the group was broken for good: no
    forward, state_dict or remove worked on any rank again, the spill files stayed.
    Now every rank raises at once, and once the file is restored every rank streams
    exactly again."""
    from helpers.ranks import run_ranks

    run_ranks(2, tmp_path, "read_fails")
