"""The disk tier's reader (layerwise._C.Reader, layerwise/stages/disk/reader.py):
exact bytes for any extents, O_DIRECT where the file system allows it and the
buffered path where not, errors that name the file and never pass a short
buffer as a full one, ordering with the CPU copy engine, and safety: dst kept
alive while a read is in flight, Ctrl-C, process exit, fork. Everything that
could crash or hang runs in a subprocess with a timeout."""
import errno
import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import layerwise
from layerwise._native import CopyEngine, Reader, ReadError
from layerwise.stages.disk.reader import PAGE, OpenFile, aligned_staging, filesystem_type, read_layer, staging_layout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEMORY_FS = {"tmpfs", "ramfs"}


# ---------------------------------------------------------------- helpers
@pytest.fixture
def disk_dir(tmp_path):
    """A directory on a disk-backed file system (the repository's: ext4 here),
    never tmpfs, where O_DIRECT works."""
    if filesystem_type(tmp_path) not in MEMORY_FS:
        d = tmp_path
    else:
        d = os.path.join(ROOT, "build", f"test-reader-{os.getpid()}")
        os.makedirs(d, exist_ok=True)
    probe = os.path.join(d, "probe")
    with open(probe, "wb") as f:
        f.write(b"\0" * PAGE)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError as e:
        pytest.skip(f"{d} ({filesystem_type(d)}) refuses O_DIRECT: {e}")
    finally:
        os.unlink(probe)
    yield str(d)
    if str(d).startswith(os.path.join(ROOT, "build")):
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        os.rmdir(d)


def write_file(path, nbytes, seed=0):
    data = random.Random(seed).randbytes(nbytes)
    with open(path, "wb") as f:
        f.write(data)
    return data


def check_extents(staging, data, extents):
    buf = staging.numpy().tobytes()
    for off, length, dst in extents:
        assert buf[dst:dst + length] == data[off:off + length], (off, length, dst)


def tensor_sizes(rng, n, total_max):
    """n tensor byte sizes, like a layer's: a few big ones, many small, odd sizes included."""
    sizes = [rng.choice([rng.randint(1, 600), rng.randint(1, 64 << 10), rng.randint(1, 300 << 10)]) for _ in range(n)]
    while sum(sizes) > total_max:
        sizes = [max(1, s // 2) for s in sizes]
    return sizes


def layer_in_file(rng, file_size, contiguous, n):
    """[(file_offset, length)] of one layer: one contiguous run starting anywhere,
    or tensors with gaps between them (and out of order)."""
    sizes = tensor_sizes(rng, n, file_size // 2)
    gaps = [0] * n if contiguous else [rng.choice([0, rng.randint(1, 5000)]) for _ in range(n)]
    start = rng.randint(0, file_size - sum(sizes) - sum(gaps))
    out, pos = [], start
    for s, g in zip(sizes, gaps):
        pos += g
        out.append((pos, s))
        pos += s
    if not contiguous:
        rng.shuffle(out)
    return out


def plan_layout(file_extents, align=256):
    """Extents placed as a slot plan would place them: packed in the given order,
    each at an `align`-aligned offset (not congruent with the file: buffered)."""
    out, pos = [], 0
    for off, length in file_extents:
        pos = (pos + align - 1) // align * align
        out.append((off, length, pos))
        pos += length
    return out, pos


def runs_of(extents):
    ext = sorted(extents)
    return sum(1 for k, (off, _n, _d) in enumerate(ext) if k == 0 or off != ext[k - 1][0] + ext[k - 1][1])


def delta(reader, before):
    after = reader.stats()
    return {k: after[k] - before[k] for k in after}


# ------------------------------------------------------------------ data
@pytest.mark.parametrize("layout", ["staging", "plan"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "scattered"])
def test_random_extents_are_bitwise_exact(disk_dir, layout, contiguous):
    path = os.path.join(disk_dir, "ckpt.bin")
    size = 3 * 2**20 + 1234
    data = write_file(path, size)
    reader = Reader(num_threads=2)
    rng = random.Random(1 + contiguous)
    for trial in range(12):
        file_extents = layer_in_file(rng, size, contiguous, rng.randint(1, 40))
        if layout == "staging":
            extents, nbytes = staging_layout(file_extents)
        else:
            extents, nbytes = plan_layout(file_extents)
        staging = aligned_staging(nbytes + PAGE)
        staging.fill_(0xA5)
        before = reader.stats()
        with OpenFile.open(path) as f:
            file = [path, f.fd, f][trial % 3]
            read_layer(reader, file, extents, staging).synchronize()
        check_extents(staging, data, extents)
        d = delta(reader, before)
        runs = runs_of(extents)
        # one vectored read per run of extents contiguous in the file, never one per tensor
        assert d["syscalls"] == runs and d["runs_direct"] + d["runs_buffered"] == runs, (d, runs)
        assert d["failed"] == 0
        if layout == "staging":
            assert d["runs_direct"] == runs, d  # O_DIRECT straight into the staging buffer
        else:
            assert d["runs_buffered"] == runs, d
            # the buffered path writes the wanted bytes and nothing else
            buf = staging.numpy()
            mask = torch.ones(staging.numel(), dtype=torch.bool)
            for _off, length, dst in extents:
                mask[dst:dst + length] = False
            assert bool((torch.from_numpy(buf)[mask] == 0xA5).all())


# ------------------------------------------------------ queue depth
@pytest.mark.parametrize("layout", ["staging", "plan"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "scattered"])
@pytest.mark.parametrize("chunk", [PAGE, 3 * PAGE, 64 << 10])
def test_a_read_in_pieces_is_bitwise_exact(disk_dir, layout, contiguous, chunk):
    """A read is cut into pieces of about chunk_bytes that the threads read side by
    side: long runs at page-aligned file offsets (still O_DIRECT straight into place),
    short runs grouped. Every byte lands where it belongs, and nothing else is written
    on the buffered path."""
    path = os.path.join(disk_dir, "ckpt.bin")
    size = 3 * 2**20 + 1234
    data = write_file(path, size)
    reader = Reader(num_threads=4, chunk_bytes=chunk)
    assert reader.chunk_bytes == chunk
    rng = random.Random(7 + contiguous + chunk)
    for trial in range(8):
        file_extents = layer_in_file(rng, size, contiguous, rng.randint(1, 40))
        extents, nbytes = staging_layout(file_extents) if layout == "staging" else plan_layout(file_extents)
        staging = aligned_staging(nbytes + PAGE)
        staging.fill_(0xA5)
        before = reader.stats()
        with OpenFile.open(path) as f:
            read_layer(reader, [path, f.fd, f][trial % 3], extents, staging).synchronize()
        check_extents(staging, data, extents)
        d = delta(reader, before)
        assert d["reads"] == 1 and d["failed"] == 0, d
        longest = max(n for _, n in file_extents)
        if longest > 2 * chunk:
            assert d["pieces"] >= 2, d  # a long run is never read as one request
        if layout == "staging":
            assert d["runs_buffered"] == 0 and d["runs_direct"] >= runs_of(extents), d
        else:
            buf = torch.from_numpy(staging.numpy())
            mask = torch.ones(staging.numel(), dtype=torch.bool)
            for _off, length, dst in extents:
                mask[dst:dst + length] = False
            assert bool((buf[mask] == 0xA5).all())


def test_one_layer_keeps_several_requests_in_flight(disk_dir):
    """One layer's read (the disk tier needs one layer at a time) is several requests
    at once, not one: on 3e2da62 a layer was one preadv on one thread (0.81x the
    drive's best). Run until two pieces were seen reading at the same time (machine
    load can delay a thread, never forbid the overlap), with a generous cap."""
    from layerwise.stages.disk.reader import READ_CHUNK_BYTES, READER_THREADS

    assert READER_THREADS >= 2 and READ_CHUNK_BYTES >= PAGE
    path = os.path.join(disk_dir, "layer.bin")
    layer = 4 * READ_CHUNK_BYTES
    data = write_file(path, layer + 777)
    reader = Reader(num_threads=READER_THREADS, chunk_bytes=READ_CHUNK_BYTES)
    extents, nbytes = staging_layout([(777, layer)])
    staging = aligned_staging(nbytes)
    import time

    deadline = time.monotonic() + 120
    while reader.stats()["max_in_flight"] < 2 and time.monotonic() < deadline:
        reader.read_async(path, extents, staging).synchronize()
    s = reader.stats()
    check_extents(staging, data, extents)
    assert s["max_in_flight"] >= 2, s
    assert s["pieces"] >= 4 * s["reads"] and s["runs_direct"] == s["pieces"] and s["failed"] == 0, s


def test_the_disk_tier_reads_with_the_tier_settings(disk_dir):
    from layerwise.stages.disk import DiskTier
    from layerwise.stages.disk.reader import READ_CHUNK_BYTES, READER_THREADS

    tier = DiskTier(CopyEngine("cpu"), 2, PAGE, torch.device("cpu"), pinned=False)
    try:
        assert tier.reader.num_threads == READER_THREADS and tier.reader.chunk_bytes == READ_CHUNK_BYTES
    finally:
        tier.close()


def test_a_failed_piece_fails_the_read_once(disk_dir):
    """A read in pieces whose file is shorter than its extents: one ReadError for
    the read (naming the file), counted once; the reader goes on."""
    path = os.path.join(disk_dir, "short.bin")
    data = write_file(path, 1 << 20)
    reader = Reader(num_threads=4, chunk_bytes=64 << 10)
    extents, nbytes = staging_layout([(0, 2 << 20)])  # the file ends half way
    staging = aligned_staging(nbytes)
    ev = reader.read_async(path, extents, staging)
    with pytest.raises(ReadError, match="short.bin"):
        ev.synchronize()
    s = reader.stats()
    assert s["reads"] == 1 and s["failed"] == 1 and s["pieces"] == 32, s
    ok, n = staging_layout([(0, 1 << 20)])
    reader.read_async(path, ok, staging).synchronize()
    check_extents(staging, data, ok)


def test_chunk_bytes_is_checked():
    with pytest.raises(ValueError, match="chunk_bytes"):
        Reader(chunk_bytes=1000)
    assert Reader(chunk_bytes=0).chunk_bytes == 0


def test_direct_path_is_used_on_a_disk_file_system(disk_dir):
    path = os.path.join(disk_dir, "layers.bin")
    data = write_file(path, 4 << 20)
    reader = Reader()
    staging = aligned_staging(2 << 20)
    # a safetensors-like layer: starts at an odd offset, several tensors back to back
    extents, nbytes = staging_layout([(12345, 1000), (13345, 700_000), (713345, 300_001)])
    assert nbytes <= staging.numel()
    read_layer(reader, path, extents, staging).synchronize()
    check_extents(staging, data, extents)
    s = reader.stats()
    assert filesystem_type(disk_dir) not in MEMORY_FS
    assert s["runs_direct"] == 1 and s["runs_buffered"] == 0 and s["syscalls"] == 1, s
    assert s["bytes_direct"] == 1_001_001 and 0 < s["bytes_padding"] < 2 * PAGE, s


def test_end_of_file_inside_the_padding(disk_dir):
    path = os.path.join(disk_dir, "odd.bin")
    size = 5 * PAGE + 77
    data = write_file(path, size)
    reader = Reader()
    for first in (0, 3, PAGE + 1, size - 100):
        extents, nbytes = staging_layout([(first, size - first)])
        staging = aligned_staging(nbytes)
        reader.read_async(path, extents, staging).synchronize()
        check_extents(staging, data, extents)
    assert reader.stats()["runs_direct"] == 4 and reader.stats()["failed"] == 0


def test_buffered_on_a_memory_file_system():
    if not os.path.isdir("/dev/shm") or filesystem_type("/dev/shm") not in MEMORY_FS:
        pytest.skip("no tmpfs at /dev/shm")
    path = f"/dev/shm/layerwise-test-reader-{os.getpid()}"
    try:
        data = write_file(path, 1 << 20)
        reader = Reader()
        extents, nbytes = staging_layout([(0, 1 << 19), (1 << 19, 1000), (700_000, 5000)])
        staging = aligned_staging(nbytes)
        reader.read_async(path, extents, staging).synchronize()
        check_extents(staging, data, extents)
        s = reader.stats()
        # tmpfs keeps files in the page cache: O_DIRECT would skip nothing (and kernels before 6.6 refuse it)
        assert s["runs_direct"] == 0 and s["runs_buffered"] == 2 and s["memory_fs_reads"] == 1, s
    finally:
        os.unlink(path)


def test_unaligned_placement_is_read_buffered(disk_dir):
    path = os.path.join(disk_dir, "u.bin")
    data = write_file(path, 1 << 20)
    reader = Reader()
    extents, nbytes = staging_layout([(100, 50_000), (50_100, 9000)])
    shifted = [(o, n, d + 1) for o, n, d in extents]  # not congruent with the file any more
    staging = aligned_staging(nbytes + 1)
    reader.read_async(path, shifted, staging).synchronize()
    check_extents(staging, data, shifted)
    s = reader.stats()
    assert s["runs_direct"] == 0 and s["runs_buffered"] == 1 and s["runs_unaligned"] == 1, s
    # a run whose padding would overwrite another extent's bytes is read buffered too
    staging2 = aligned_staging(3 * PAGE)
    clash = [(10, 100, 10), (5000, 100, 200)]  # both in the first page of dst, not contiguous in the file
    reader.read_async(path, clash, staging2).synchronize()
    check_extents(staging2, data, clash)


def test_refused_o_direct_falls_back_to_buffered_once_per_file_system(disk_dir):
    paths = [os.path.join(disk_dir, f"r{i}.bin") for i in range(2)]
    datas = [write_file(p, 1 << 20, seed=i) for i, p in enumerate(paths)]
    reader = Reader(_refuse_direct=True)  # acts as if open(O_DIRECT) failed with EINVAL
    extents, nbytes = staging_layout([(4096, 300_000)])
    staging = aligned_staging(nbytes)
    for _ in range(3):
        for p, d in zip(paths, datas):
            reader.read_async(p, extents, staging).synchronize()
            check_extents(staging, d, extents)
    s = reader.stats()
    assert s["direct_refused"] == 1 and s["runs_direct"] == 0 and s["runs_buffered"] == 6, s
    off = Reader(direct=False)
    off.read_async(paths[0], extents, staging).synchronize()
    assert off.stats()["runs_buffered"] == 1 and off.stats()["direct_refused"] == 0


def test_caller_fd_opened_with_o_direct(disk_dir):
    path = os.path.join(disk_dir, "d.bin")
    data = write_file(path, 1 << 20)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        reader = Reader()
        staging = aligned_staging(1 << 20)
        aligned, _ = staging_layout([(8192, 65536)])
        unaligned = [(3, 1000, 5)]
        for ext in (aligned, unaligned):
            reader.read_async(fd, ext, staging).synchronize()
            check_extents(staging, data, ext)
        s = reader.stats()
        assert s["runs_direct"] == 1 and s["runs_buffered"] == 1, s
    finally:
        os.close(fd)


def test_more_extents_than_iov_max(disk_dir):
    path = os.path.join(disk_dir, "many.bin")
    data = write_file(path, 1 << 20)
    reader = Reader()
    file_extents = [(1000 + 37 * k, 37) for k in range(3000)]  # one contiguous run of 3000 tensors
    extents, nbytes = plan_layout(file_extents, align=64)
    staging = aligned_staging(nbytes)
    reader.read_async(path, extents, staging).synchronize()
    check_extents(staging, data, extents)
    assert reader.stats()["syscalls"] == 3  # IOV_MAX (1024) iovecs per preadv


def test_caller_may_close_its_fd_right_after_submitting(disk_dir):
    path = os.path.join(disk_dir, "c.bin")
    data = write_file(path, 1 << 20)
    reader = Reader(debug_delay_us=20_000)
    staging = aligned_staging(1 << 20)
    extents, _ = staging_layout([(0, 1 << 19)])
    fd = os.open(path, os.O_RDONLY)
    ev = reader.read_async(fd, extents, staging)
    os.close(fd)
    other = os.open(os.devnull, os.O_RDONLY)  # likely takes the same number
    try:
        ev.synchronize()
    finally:
        os.close(other)
    check_extents(staging, data, extents)


def test_bad_arguments_raise_at_once(disk_dir):
    path = os.path.join(disk_dir, "b.bin")
    write_file(path, 8192)
    reader = Reader()
    staging = aligned_staging(PAGE)
    with pytest.raises(ValueError, match="ends past the end of dst"):
        reader.read_async(path, [(0, 100, PAGE - 10)], staging)
    with pytest.raises(ValueError, match="overlap in dst"):
        reader.read_async(path, [(0, 100, 0), (500, 100, 50)], staging)
    with pytest.raises(ValueError, match="negative"):
        reader.read_async(path, [(-1, 10, 0)], staging)
    with pytest.raises(ValueError, match="contiguous uint8"):
        reader.read_async(path, [(0, 10, 0)], staging.view(torch.int32))
    with pytest.raises(ValueError, match="contiguous uint8"):
        reader.read_async(path, [(0, 10, 0)], torch.zeros(64, dtype=torch.uint8)[::2])
    with pytest.raises(ValueError, match="not an open file descriptor"):
        reader.read_async(987654, [(0, 10, 0)], staging)
    with pytest.raises(ValueError, match="num_threads"):
        Reader(num_threads=0)
    with pytest.raises(ValueError, match="debug_delay_us"):
        Reader(debug_delay_us=10**9)
    assert reader.stats()["reads"] == 0  # nothing was queued
    reader.read_async(path, [], staging).synchronize()  # an empty layer is fine


# ---------------------------------------------------------------- errors
def test_truncated_file_fails_clearly_and_the_next_read_is_exact(disk_dir):
    path = os.path.join(disk_dir, "t.bin")
    size = 2 << 20
    data = write_file(path, size)
    reader = Reader()
    extents, nbytes = staging_layout([(size - 300_000, 300_000)])
    staging = aligned_staging(nbytes)
    f = OpenFile.open(path)
    try:
        os.truncate(path, size // 2)
        for file, what in ((path, "short read"), (f.fd, "short read"), (f, "changed since it was recorded")):
            ev = read_layer(reader, file, extents, staging)
            with pytest.raises(ReadError, match=what) as info:
                ev.synchronize()
            assert isinstance(info.value, OSError)
            assert path in str(info.value)
            if what == "short read":
                msg = str(info.value)
                assert f"[{size - 300_000}, {size})" in msg and f"ends at byte {size // 2}" in msg
            with pytest.raises(ReadError):  # query() raises too: a failed read never passes for a finished one
                ev.query()
        # restored in place (same inode, content and mtime): read by path or descriptor it is exact again;
        # through what was recorded it is not the same file any more - its ctime moved (a rewrite that
        # sets mtime back, as cp -p or rsync --inplace -t do, cannot pass for the recorded bytes)
        with open(path, "r+b") as w:
            w.write(data)
        os.utime(path, ns=(f.mtime_ns, f.mtime_ns))
        for file in (path, f.fd):
            staging.zero_()
            read_layer(reader, file, extents, staging).synchronize()
            check_extents(staging, data, extents)
        with pytest.raises(ReadError, match="ctime_ns .* written since"):
            read_layer(reader, f, extents, staging).synchronize()
        reader.check_file(f.fd, f.size, f.mtime_ns)
        with pytest.raises(ReadError, match="written since"):
            reader.check_file(f.fd, f.size, f.mtime_ns, f.ctime_ns)
        with pytest.raises(ReadError, match="changed"):
            reader.check_file(f.fd, f.size + 1, f.mtime_ns)
    finally:
        f.close(reader)
    assert reader.stats()["failed"] == 4


def test_deleted_then_recreated_file_fails_clearly_and_restoring_is_exact(disk_dir):
    path = os.path.join(disk_dir, "r.bin")
    data = write_file(path, 1 << 20)
    reader = Reader()
    extents, nbytes = staging_layout([(777, 500_000)])
    staging = aligned_staging(nbytes)
    f = OpenFile.open(path)
    os.unlink(path)
    write_file(path, 1 << 20, seed=99)  # a different file under the same name
    os.utime(path, ns=(f.mtime_ns + 10**9, f.mtime_ns + 10**9))
    # through the descriptor: the old file, deleted
    with pytest.raises(ReadError, match="deleted"):
        read_layer(reader, f, extents, staging).synchronize()
    # by path with what was recorded: a different mtime
    with pytest.raises(ReadError, match="changed since it was recorded"):
        reader.read_async(path, extents, staging, expect=f.expect).synchronize()
    # restored: the same bytes and mtime under the name; a fresh descriptor reads them (its ctime is
    # new: checked against size and mtime only)
    with open(path, "wb") as w:
        w.write(data)
    os.utime(path, ns=(f.mtime_ns, f.mtime_ns))
    with pytest.raises(ReadError, match="written since"):
        reader.read_async(path, extents, staging, expect=f.expect).synchronize()
    reader.read_async(path, extents, staging, expect=f.expect[:2]).synchronize()
    check_extents(staging, data, extents)
    f.close(reader)
    with OpenFile.open(path) as g:
        staging.zero_()
        read_layer(reader, g, extents, staging).synchronize()
        check_extents(staging, data, extents)


def test_errors_name_the_file_offset_and_errno(disk_dir):
    reader = Reader()
    staging = aligned_staging(PAGE)
    missing = os.path.join(disk_dir, "missing.bin")
    with pytest.raises(ReadError) as info:
        reader.read_async(missing, [(0, 10, 0)], staging).synchronize()
    assert info.value.errno == errno.ENOENT and missing in str(info.value) and "No such file" in str(info.value)
    with pytest.raises(ReadError) as info:  # open() of a directory works, reading it does not
        reader.read_async(disk_dir, [(4096, 10, 0)], staging).synchronize()
    assert info.value.errno == errno.EISDIR and "at offset 4096" in str(info.value) and disk_dir in str(info.value)
    path = os.path.join(disk_dir, "ok.bin")
    data = write_file(path, PAGE)
    reader.read_async(path, [(0, PAGE, 0)], staging).synchronize()  # the reader goes on
    check_extents(staging, data, [(0, PAGE, 0)])


# ------------------------------------------------ ordering, delays, engine
def test_random_debug_delays_change_nothing(disk_dir):
    path = os.path.join(disk_dir, "delay.bin")
    size = 2 << 20
    data = write_file(path, size)
    rng = random.Random(5)
    layers = [layer_in_file(rng, size, rng.random() < 0.7, rng.randint(1, 12)) for _ in range(24)]
    results = {}
    for delay in (0, 3000):
        reader = Reader(num_threads=3, debug_delay_us=delay)
        assert reader.debug_delay_us == delay
        outs = []
        for fe in layers:
            extents, nbytes = staging_layout(fe)
            st = aligned_staging(nbytes)
            outs.append((extents, st, reader.read_async(path, extents, st)))
        for extents, st, ev in outs:
            ev.synchronize()
            check_extents(st, data, extents)
        results[delay] = [st.clone() for _, st, _ in outs]
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[3000]))


def test_copy_engine_orders_after_reads_and_reads_after_copies(disk_dir):
    """A ring of two staging slots: read layer k into slot k % 2 after the copy out
    of that slot (layer k - 2) has finished, copy it out after its read. Random
    delays on both sides: any missing wait shows up as a wrong layer."""
    path = os.path.join(disk_dir, "ring.bin")
    n_layers, layer = 24, 96 * 1024 + 13
    data = write_file(path, n_layers * layer + 5000)
    reader = Reader(num_threads=2, debug_delay_us=4000)
    engine = CopyEngine("cpu", num_streams=2, debug_delay_us=4000)
    layouts = [staging_layout([(k * layer + 5, layer)]) for k in range(n_layers)]
    slot_bytes = max(n for _, n in layouts)
    slots = [aligned_staging(slot_bytes) for _ in range(2)]
    outs = [torch.zeros(layer, dtype=torch.uint8) for _ in range(n_layers)]
    copied = [None, None]
    events = []
    for k in range(n_layers):
        (extents, _), s = layouts[k], k % 2
        rd = reader.read_async(path, extents, slots[s], after=copied[s])
        d = extents[0][2]
        copied[s] = engine.copy_async(outs[k], slots[s][d:d + layer], after=rd)
        events.append(copied[s])
    for ev in events:
        ev.synchronize()
    for k in range(n_layers):
        assert outs[k].numpy().tobytes() == data[k * layer + 5:(k + 1) * layer + 5], k


def test_a_copy_after_a_failed_read_fails_and_copies_nothing(disk_dir):
    reader = Reader()
    engine = CopyEngine("cpu")
    staging = aligned_staging(PAGE)
    out = torch.full((PAGE,), 7, dtype=torch.uint8)
    rd = reader.read_async(os.path.join(disk_dir, "nope.bin"), [(0, PAGE, 0)], staging)
    cp = engine.copy_async(out, staging, after=rd)
    with pytest.raises(ReadError, match="copy not done: the read it waited on failed.*nope.bin"):
        cp.synchronize()
    assert bool((out == 7).all())
    with pytest.raises(ReadError):
        engine.wait(cp)
    # and a read after a failed read fails too, naming the first failure
    rd2 = reader.read_async(os.path.join(disk_dir, "nope.bin"), [(0, 1, 0)], staging, after=cp)
    with pytest.raises(ReadError, match="the event it waited on failed"):
        rd2.synchronize()


def test_events_time_the_read(disk_dir):
    path = os.path.join(disk_dir, "time.bin")
    write_file(path, 1 << 20)
    reader = Reader()
    staging = aligned_staging(1 << 20)
    a = reader.read_async(path, [(0, 1 << 19, 0)], staging)
    b = reader.read_async(path, [(0, 1 << 19, 0)], staging, after=a)
    b.synchronize()
    assert a.query() and a.copy_ms >= 0 and a.elapsed_ms(b) >= 0


def test_read_layer_through_an_open_file(disk_dir):
    path = os.path.join(disk_dir, "stage.bin")
    data = write_file(path, 1 << 20)
    reader = Reader()
    with OpenFile.open(path) as f:
        layers = {i: (f, staging_layout([(i * 100_000 + 3, 90_000)])[0]) for i in range(4)}
        staging = aligned_staging(100_000 + 2 * PAGE)
        for i in range(4):
            read_layer(reader, *layers[i], staging).synchronize()
            check_extents(staging, data, layers[i][1])
        f.close(reader)
    assert reader.stats()["cached_files"] == 0


def test_cuda_copy_out_of_staging_and_reading_after_a_cuda_copy(disk_dir):
    """CUDA integration as the manager will do it: the H2D copy out of a staging slot
    is issued once its read has completed (host wait), and the next read into that
    slot waits - on a reader thread - for the CUDA copy out of it."""
    if not (torch.cuda.is_available() and layerwise.build_info()["with_cuda"]):
        pytest.skip("no CUDA device (or a CPU-only build): runs in scripts/gpu_check.sh")
    path = os.path.join(disk_dir, "cuda.bin")
    layer = 3 << 20
    data = write_file(path, 4 * layer)
    reader = Reader(debug_delay_us=2000)
    engine = CopyEngine("cuda")
    layouts = [staging_layout([(k * layer + 11, layer)])[0] for k in range(3)]
    staging = aligned_staging(layer + 2 * PAGE)  # pinned: cudaHostRegister on a CUDA build
    outs = [torch.empty(layer, dtype=torch.uint8, device="cuda") for _ in range(3)]
    copied = None
    for k, extents in enumerate(layouts):
        rd = reader.read_async(path, extents, staging, after=copied)  # after the copy out of the slot
        rd.synchronize()  # a stream cannot wait on a host event: host-wait, then issue the copy
        d = extents[0][2]
        copied = engine.copy_async(outs[k], staging[d:d + layer], after=None)
        with pytest.raises(TypeError, match="not a CUDA event"):
            engine.copy_async(outs[k], staging[d:d + layer], after=rd)
    copied.synchronize()
    for k in range(3):
        assert outs[k].cpu().numpy().tobytes() == data[k * layer + 11:(k + 1) * layer + 11], k
    assert reader.stats()["runs_direct"] == 3  # O_DIRECT into cudaHostRegister'ed memory


# ------------------------------------------------------------ safety
def test_dst_of_a_read_in_flight_cannot_be_resized_or_freed(disk_dir):
    path = os.path.join(disk_dir, "inflight.bin")
    data = write_file(path, 1 << 20)
    reader = Reader(debug_delay_us=1_000_000)
    for drop in (False, True):
        blockers = [reader.read_async(path, [(0, 1, 0)], torch.zeros(1, dtype=torch.uint8)) for _ in range(4)]
        dst = torch.zeros(1 << 20, dtype=torch.uint8)  # resizable, unlike an arena buffer
        ev = reader.read_async(path, [(0, 1 << 20, 0)], dst)
        assert not ev.query()
        if not drop:
            with pytest.raises(RuntimeError, match="not resizable"):
                dst.untyped_storage().resize_(0)
            ev.synchronize()
            dst.untyped_storage().resize_(0)  # resizable again once the read is done
            dst = ev = None
        else:
            # every Python reference to dst and to the event dropped: the queued read holds the storage
            del dst, ev
            gc.collect()
            canaries = [torch.full((1 << 20,), 3, dtype=torch.uint8) for _ in range(4)]
            reader.synchronize()
            assert all(bool((c == 3).all()) for c in canaries)
        # (.numpy() makes a storage non-resizable for good: the data is checked on a read that stays whole)
        out = torch.zeros(1 << 20, dtype=torch.uint8)
        reader.read_async(path, [(0, 1 << 20, 0)], out).synchronize()
        assert out.numpy().tobytes() == data
        for b in blockers:
            b.synchronize()
    assert reader.stats()["failed"] == 0


PRELUDE = textwrap.dedent(
    f"""
    import gc, os, random, signal, sys, threading, time
    sys.path.insert(0, {ROOT!r})
    import torch
    torch.set_num_threads(1)
    import layerwise
    from layerwise._native import CopyEngine, Reader, ReadError
    from layerwise.stages.disk.reader import aligned_staging, staging_layout
    assert layerwise.__file__.startswith({ROOT!r}), layerwise.__file__
    """
)


def run_python(code, timeout=120):
    env = dict(os.environ)
    env.pop("LAYERWISE_DEBUG_COPY_DELAY_US", None)
    try:
        return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], capture_output=True,
                              text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"subprocess hung for more than {timeout} s; stdout: {e.stdout!r}; stderr: {e.stderr!r}")


def describe(proc):
    rc = proc.returncode
    how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
    return f"{how}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def test_ctrl_c_never_leaves_a_read_writing_into_freed_memory(disk_dir):
    """Real SIGINTs at random moments while layers are read into 8 MB buffers
    (above malloc's mmap threshold: a freed one is unmapped at once, so a late
    write is a crash or an EFAULT), with the events often never assigned. Fresh
    allocations made after each interrupt must keep their contents."""
    path = os.path.join(disk_dir, "sigint.bin")
    write_file(path, 8 << 20)
    proc = run_python(
        f"""
        N = 8 << 20
        reader = Reader(num_threads=2, debug_delay_us=3000)
        main = threading.get_ident()
        stop = False
        armed = [False]

        def on_sigint(signum, frame):
            # one KeyboardInterrupt per arming, raised only inside the loop's try block
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt

        signal.signal(signal.SIGINT, on_sigint)

        def interrupter():
            rng = random.Random(0)
            while not stop:
                time.sleep(rng.uniform(0.0005, 0.01))
                signal.pthread_kill(main, signal.SIGINT)

        th = threading.Thread(target=interrupter)
        th.start()
        canaries, interrupts, done = [], 0, 0
        start = time.monotonic()
        # at least 3 s, and until 20 of each (a loaded machine reads slower), within 90 s
        while time.monotonic() - start < 90 and (time.monotonic() - start < 3 or interrupts < 20 or done < 20):
            try:
                armed[0] = True
                dst = torch.empty(N, dtype=torch.uint8)
                ev = reader.read_async({path!r}, [(0, N, 0)], dst)
                if done % 3 == 0:
                    ev.synchronize()
                del dst, ev
                done += 1
                armed[0] = False
            except KeyboardInterrupt:
                interrupts += 1
                dst = ev = None
                gc.collect()
                val = interrupts % 251
                canaries.append((torch.full((N,), val, dtype=torch.uint8), val))
                if len(canaries) > 8:
                    canaries.pop(0)
        stop = True
        th.join()
        reader.synchronize()
        for c, val in canaries:
            assert bool((c == val).all()), "a read wrote into memory that was freed and reused"
        s = reader.stats()
        assert s["failed"] == 0, s  # no EFAULT: no read ever wrote into unmapped memory
        assert interrupts >= 20 and done >= 20, (interrupts, done)
        print("OK", interrupts, done, s["reads"])
        """,
        timeout=150,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, describe(proc)


EXIT_SCRIPT = """
path = {path!r}
reader = Reader(num_threads=2, debug_delay_us=200_000)
engine = CopyEngine("cpu", debug_delay_us=100_000)
evs = []
for k in range(6):
    dst = aligned_staging(1 << 20) if k % 2 else torch.empty(1 << 20, dtype=torch.uint8)
    ev = reader.read_async(path, [(k * 1000, 1 << 19, 0)], dst)
    evs.append(engine.copy_async(torch.empty(1 << 19, dtype=torch.uint8), dst[:1 << 19], after=ev))
reader.read_async(path, [(0, 4096, 0)], torch.empty(4096, dtype=torch.uint8))  # referenced by nothing
assert not evs[-1].query()
"""

ENDINGS = {
    "exit": "",
    "del_reader": "del reader\ngc.collect()\n",
    "shutdown_all": "layerwise._native._C.shutdown_all()\n",
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_exit_with_reads_in_flight_is_clean(disk_dir, ending):
    path = os.path.join(disk_dir, "exit.bin")
    write_file(path, 2 << 20)
    runs = 20 if ending == "exit" else 4
    code = EXIT_SCRIPT.format(path=path) + ENDINGS[ending]
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda _: run_python(code, timeout=120), range(runs)))
    bad = [p for p in procs if p.returncode != 0 or "terminate called" in p.stderr]
    assert not bad, f"{len(bad)} of {runs} runs did not exit cleanly; first: {describe(bad[0])}"


def test_shutdown_cancels_queued_reads_and_later_use_raises(disk_dir):
    path = os.path.join(disk_dir, "sd.bin")
    data = write_file(path, 1 << 20)
    reader = Reader(num_threads=1, debug_delay_us=1_000_000)
    staging = aligned_staging(1 << 20)
    evs = [reader.read_async(path, [(0, 1 << 20, 0)], staging) for _ in range(4)]
    reader.shutdown()
    cancelled = 0
    for e in evs:
        try:
            e.synchronize()
        except ReadError as err:
            assert "cancelled" in str(err)
            cancelled += 1
    assert cancelled >= 3 and reader.stats()["cancelled"] == cancelled
    with pytest.raises(RuntimeError, match="shut down"):
        reader.read_async(path, [(0, 1, 0)], staging)
    reader.synchronize()
    reader.shutdown()  # twice is fine
    # another reader is not affected
    other = Reader()
    other.read_async(path, [(0, 1 << 20, 0)], staging).synchronize()
    check_extents(staging, data, [(0, 1 << 20, 0)])


def test_fork_child_gets_a_clear_error_and_a_fresh_reader_works(disk_dir):
    path = os.path.join(disk_dir, "fork.bin")
    write_file(path, 1 << 20)
    proc = run_python(
        f"""
        path = {path!r}
        reader = Reader(debug_delay_us=1_000_000)
        staging = aligned_staging(1 << 20)
        queued = [reader.read_async(path, [(0, 4096, 0)], staging) for _ in range(3)]
        pid = os.fork()
        if pid == 0:
            try:
                for call in (lambda: reader.read_async(path, [(0, 1, 0)], staging), lambda: queued[-1].synchronize()):
                    try:
                        call()
                    except RuntimeError as e:
                        assert "before fork" in str(e), e
                    else:
                        assert queued[-1].query(), "a call in the forked child did not raise"
                reader.synchronize()  # nothing of the parent's reader runs here: returns
                fresh = Reader()
                buf = torch.zeros(4096, dtype=torch.uint8)
                fresh.read_async(path, [(0, 4096, 0)], buf).synchronize()
                assert buf.numpy().tobytes() == open(path, "rb").read(4096)
            except BaseException as e:
                print("child failed:", repr(e), flush=True)
                os._exit(3)
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        for q in queued:
            q.synchronize()
        print("OK")
        """,
        timeout=120,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout and "terminate called" not in proc.stderr, describe(proc)
    assert "child failed" not in proc.stdout, describe(proc)


def test_exported_names():
    assert layerwise._native.Reader is Reader and issubclass(ReadError, OSError)
    assert Reader.alignment == PAGE == 4096
