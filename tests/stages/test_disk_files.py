"""The files of the disk tier over time: a file
that changed and came back streams exactly again, a change of metadata only is
no error, a truncated file is a ReadError (an OSError) every time, and a model
collected without remove_layerwise_offload closes its files and deletes its
spill files. Deterministic: every change is made at a chosen point, with an
mtime set explicitly (never "within the same clock tick")."""
import errno
import gc
import os
import re
import shutil
import stat
import time
import weakref

import psutil
import pytest
import torch

import layerwise
from layerwise.stages import disk as disk_mod
from layerwise.stages.disk.reader import ReadError

from helpers.disk import budget, inputs, make, meta_model, save_checkpoint, spill_files

KINDS = ["ckpt", "spill"]


def offload(kind, ref, disk_dir, **kw):
    """`ref`'s weights offloaded with about one layer in memory, the rest in the
    checkpoint file (kind "ckpt") or in a spill file ("spill")."""
    if kind == "ckpt":
        ckpt = os.path.join(disk_dir, "model.safetensors")
        if not os.path.exists(ckpt):
            save_checkpoint(ref, ckpt)
        model = meta_model()
        (m,) = layerwise.load_offloaded(model, ckpt, "blocks", device="cpu", host_budget=budget(ref, 1), **kw)
    else:
        model = make()
        (m,) = layerwise.configure_layerwise_offload(model, "blocks", device="cpu", host_budget=budget(ref, 1),
                                                     spill_dir=disk_dir, **kw)
    return model, m


def disk_layers(m):
    out = [i for i, s in enumerate(m.sources) if s.kind == "disk"]
    assert len(out) >= 3, out
    return out


def region(m, i):
    """(path, offset) of the first bytes of layer i in its file."""
    part = m.sources[i].parts[0]
    return part.file.path, part.extents[0][0]


_MTIME = [time.time_ns()]


def next_mtime() -> int:
    """An mtime no file of these tests had before (explicit: a write within one
    clock tick of the last one may leave the mtime as it was)."""
    _MTIME[0] = max(_MTIME[0] + 1_000_000, time.time_ns())
    return _MTIME[0]


def rewrite(path, offset, data: bytes):
    """Write `data` at `offset` in place, with a new mtime."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, next_mtime()))


def read_at(path, offset, n) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def assert_exact(model, ref, x):
    assert torch.equal(model(x), ref(x))
    sd, want = model.state_dict(), ref.state_dict()
    for k, v in want.items():
        assert torch.equal(sd[k], v), k


# ------------------------------------------------------- item 9: a file comes back
@pytest.mark.parametrize("where", ["between", "inside", "alone"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_restored_file_streams_exactly_again(disk_dir, monkeypatch, kind, where):
    """A layer's bytes rewritten in place: forwards raise ReadError naming the file
    while it differs, including one whose recovery finds the rewrite still going
    on (the read inside recovery fails); restored byte-exact, the next forward is
    exact. The change lands in reads queued between forwards ("between"), in
    prefetches and read-aheads queued inside a forward ("inside"), or in the read
    a block called alone needs ("alone")."""
    ref = make()
    x = inputs()[0]
    h = ref.embed(x)
    model, m = offload(kind, ref, disk_dir)
    disk = disk_layers(m)
    assert_exact(model, ref, x)
    # The layer changed: one that is neither in its ring slot nor staged after a forward.
    cold = [i for i in disk if m.ring.holder[m.ring.slot_of[i]] != i and not m.sources[i].tier._staged(m.sources[i])]
    assert cold and cold[-1] > disk[0], (disk, cold)
    k = cold[-1]
    path, off = region(m, k)
    original = read_at(path, off, 64)

    real = disk_mod.DiskFile.revalidate
    recoveries = []

    def still_rewriting(self, reader):
        real(self, reader)
        recoveries.append(self.path)
        if len(recoveries) == 1:  # the rewrite goes on after the file was reopened
            rewrite(self.path, off, b"\x55" * 64)

    monkeypatch.setattr(disk_mod.DiskFile, "revalidate", still_rewriting)

    def change(*_):
        rewrite(path, off, bytes(64))

    if where == "inside":  # after layerwise's own pre-hook of the first disk layer (it prepends its hooks)
        hook = model.blocks[disk[0]].register_forward_pre_hook(change)
    else:
        change()
    for attempt in range(3):
        with pytest.raises(ReadError, match=re.escape(os.path.basename(path))):
            if where == "alone":
                model.blocks[k](h)  # its read is queued by its own pre-hook
            else:
                model(x)
        if where == "inside" and attempt == 0:
            hook.remove()
    assert recoveries, "the file was never reopened"
    rewrite(path, off, original)
    for _ in range(2):
        assert_exact(model, ref, x)
    assert torch.equal(model.blocks[k](h), ref.blocks[k](h))
    layerwise.remove_layerwise_offload(model)
    assert_exact(model, ref, x)
    assert spill_files(disk_dir) == []


# --------------------------------------------------- item 11: metadata-only changes
def change_metadata(change, path):
    st = os.stat(path)
    if change == "chmod":
        os.chmod(path, stat.S_IMODE(st.st_mode))
    elif change == "link":
        os.link(path, path + ".link")
    elif change == "atime":
        os.utime(path, ns=(st.st_atime_ns + 10**9, st.st_mtime_ns))
    elif change == "xattr":
        try:
            os.setxattr(path, "user.layerwise-test", b"1")
        except OSError as err:
            if err.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
                pytest.skip(f"this file system takes no user xattrs ({err.strerror})")
            raise
    elif change == "touch":  # mtime moved, bytes the same
        os.utime(path, ns=(st.st_atime_ns, next_mtime()))
    elif change in ("replace", "replace-new-mtime"):  # an atomic replace by an identical copy
        tmp = path + ".tmp"
        (shutil.copy2 if change == "replace" else shutil.copyfile)(path, tmp)
        os.chmod(tmp, stat.S_IMODE(st.st_mode))
        os.replace(tmp, path)
    else:
        raise AssertionError(change)


@pytest.mark.parametrize("change", ["chmod", "link", "atime", "xattr", "touch", "replace", "replace-new-mtime"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_change_of_metadata_only_streams_on_exactly(disk_dir, kind, change):
    ref = make()
    xs = inputs(n=2)
    model, m = offload(kind, ref, disk_dir)
    disk = disk_layers(m)
    path, _ = region(m, disk[0])
    assert_exact(model, ref, xs[0])
    try:
        change_metadata(change, path)
        assert_exact(model, ref, xs[1])  # state_dict too (a read outside the forward)
        change_metadata(change, path) if change != "link" else os.unlink(path + ".link")
        assert_exact(model, ref, xs[0])
        h = ref.embed(xs[0])
        for i in reversed(disk):  # blocks alone: reads where the layers are needed
            assert torch.equal(model.blocks[i](h), ref.blocks[i](h))
        if kind == "spill":  # writes reach the file that is there now
            other = make(seed=9)
            model.load_state_dict(other.state_dict())
            assert_exact(model, other, xs[1])
            ref = other
    finally:
        if os.path.exists(path + ".link"):
            os.unlink(path + ".link")
    layerwise.remove_layerwise_offload(model)
    assert_exact(model, ref, xs[1])
    assert spill_files(disk_dir) == []


def test_content_changed_behind_the_same_size_and_mtime_is_still_caught(disk_dir):
    """The ctime says "in doubt"; the CRC says it is not the same."""
    ref = make()
    x = inputs()[0]
    model, m = offload("ckpt", ref, disk_dir)
    path, off = region(m, disk_layers(m)[-1])
    assert_exact(model, ref, x)
    st = os.stat(path)
    original = read_at(path, off, 64)
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(bytes(64))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    for _ in range(2):
        with pytest.raises(ReadError, match="CRC"):
            model(x)
    rewrite(path, off, original)
    assert_exact(model, ref, x)
    layerwise.remove_layerwise_offload(model)


# ------------------------------------------------------- item 11: truncated files
@pytest.mark.parametrize("cut", ["half", "header"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_truncated_file_is_a_read_error_every_time(disk_dir, kind, cut):
    ref = make()
    x = inputs()[0]
    model, m = offload(kind, ref, disk_dir)
    path, _ = region(m, disk_layers(m)[0])
    assert_exact(model, ref, x)
    original = open(path, "rb").read()
    with open(path, "r+b") as f:
        f.truncate(len(original) // 2 if cut == "half" else 11)
    for _ in range(3):
        with pytest.raises(OSError) as info:
            model(x)
        assert isinstance(info.value, ReadError), repr(info.value)
        assert os.path.basename(path) in str(info.value)
    with pytest.raises(ReadError, match=re.escape(os.path.basename(path))):
        model.state_dict()
    with open(path, "r+b") as f:  # restored in place (a spill file is still ours only under its name)
        f.write(original)
    os.utime(path, ns=(os.stat(path).st_atime_ns, next_mtime()))
    for _ in range(2):
        assert_exact(model, ref, x)
    layerwise.remove_layerwise_offload(model)
    assert_exact(model, ref, x)
    assert spill_files(disk_dir) == []


# ------------------------------------------- item 10: a model collected without remove
@pytest.mark.parametrize("kind,broken", [("ckpt", False), ("spill", False), ("spill", True)])
def test_a_collected_model_closes_its_files_and_deletes_its_spill_files(disk_dir, kind, broken):
    """del model + gc.collect(), no remove: every descriptor closed, every spill file
    deleted; `broken`: the spill file was deleted under the model first (its
    forward raised), so only our descriptors held the disk space."""
    ref = make()
    x = inputs()[0]
    proc = psutil.Process()

    def one():
        model, m = offload(kind, ref, disk_dir)
        assert torch.equal(model(x), ref(x))
        assert spill_files(disk_dir) if kind == "spill" else not spill_files(disk_dir)
        if broken:
            for p in spill_files(disk_dir):
                os.unlink(p)
            with pytest.raises(ReadError, match="spill"):
                model(x)
        return weakref.ref(model), weakref.ref(m)

    one()  # whatever a first model opens once per process
    gc.collect()
    fds = proc.num_fds()
    for _ in range(10):
        refs = one()
        gc.collect()
        assert [r() for r in refs] == [None, None]  # nothing keeps the model or its manager alive
        assert spill_files(disk_dir) == []
        assert proc.num_fds() == fds


# --------------------------------------------- a Ctrl-C right after a file is opened
def descriptors_in(d) -> list:
    """The open descriptors of this process on files under `d` (deleted ones included)."""
    d = os.fsdecode(d)
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # (the descriptor listdir itself used, closed since)
            continue
        if target.startswith(d):
            out.append(target)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_a_sigint_right_after_a_file_is_opened_leaves_no_descriptor_nor_spill_file(disk_dir, monkeypatch, kind):
    """A real SIGINT delivered right after each open of a file in the disk tier's
    directory returns (the checkpoint's header, its descriptors for packing and for
    streaming; a spill file's creation, its O_DIRECT descriptor, the one it is read
    through): the configure or load rolls back exactly, no spill file stays and no
    descriptor of a file there stays open."""
    import signal

    ref = make()
    x = inputs()[0]
    want = ref(x)
    ckpt = save_checkpoint(ref, os.path.join(disk_dir, "model.safetensors")) if kind == "ckpt" else None
    real = os.open
    where = os.fsdecode(disk_dir)
    opened = []
    interrupt_at = [0]

    def opening(path, *args, **kwargs):
        fd = real(path, *args, **kwargs)
        if os.fsdecode(path).startswith(where):
            opened.append(path)
            if len(opened) == interrupt_at[0]:
                os.kill(os.getpid(), signal.SIGINT)  # Python raises it right after this call returns
        return fd

    def offload(model):
        if kind == "ckpt":
            return layerwise.load_offloaded(model, ckpt, "blocks", device="cpu", host_budget=budget(ref, 1))
        return layerwise.configure_layerwise_offload(model, "blocks", device="cpu", host_budget=budget(ref, 1),
                                                     spill_dir=disk_dir)

    def fresh():
        return meta_model() if kind == "ckpt" else make()

    def state(model):
        return {name: (t.device, t.dtype, t.shape, None if t.is_meta else t.clone())
                for name, t in model.state_dict().items()}

    files = sorted(os.listdir(disk_dir))
    monkeypatch.setattr(os, "open", opening)
    model = fresh()
    offload(model)  # how many opens there an uninterrupted one makes
    assert torch.equal(model(x), want)
    layerwise.remove_layerwise_offload(model)
    n = len(opened)
    assert n >= 3 and sorted(os.listdir(disk_dir)) == files and descriptors_in(disk_dir) == []
    for k in range(1, n + 1):
        model = fresh()
        before = state(model)
        opened.clear()
        interrupt_at[0] = k
        with pytest.raises(KeyboardInterrupt):
            offload(model)
        assert len(opened) >= k
        assert sorted(os.listdir(disk_dir)) == files, k
        assert descriptors_in(disk_dir) == [], k
        now = state(model)
        assert now.keys() == before.keys(), k
        for name, (device, dtype, shape, t) in before.items():
            assert now[name][:3] == (device, dtype, shape), (k, name)
            assert t is None or torch.equal(now[name][3], t), (k, name)
        assert not model._forward_pre_hooks and not model.blocks[0]._forward_pre_hooks
        if kind == "spill":
            assert torch.equal(model(x), want)
    interrupt_at[0] = 0
    model = fresh()
    offload(model)
    assert torch.equal(model(x), want)
    layerwise.remove_layerwise_offload(model)
    assert torch.equal(model(x), want)
