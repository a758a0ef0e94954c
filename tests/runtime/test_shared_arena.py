"""The shared arena's memfd (layerwise/runtime/shared_arena.py) and the native
arena over it (HostArena.over_fd, view, protect): packed read-write, sealed,
mapped read-only in this and in a fresh process; and every refusal of a file
that is not one layerwise packed, each naming where it came from and why."""
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from layerwise import _native
from layerwise.runtime import shared_arena as sa
from layerwise.runtime.shared_arena import PAGE, SharedArenaError, SharedFile

from helpers.ranks import ROOT

DIGEST = hashlib.sha256(b"layout of the test model").digest()
WHERE = "@layerwise/0/test-rendezvous"
MANIFEST = {"group": "blocks", "layers": [{"index": 0, "offset": 0, "nbytes": 1000}], "routes": ["plain"]}


@pytest.fixture
def fds():
    """Fds a test opens; closed at its end (a refusal leaves its fd the caller's)."""
    opened = []
    yield opened
    for fd in opened:
        try:
            os.close(fd)
        except OSError:
            pass


def memfd(fds, size, name=None):
    fd = os.memfd_create(name or f"layerwise:t-{uuid.uuid4().hex[:16]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    fds.append(fd)
    os.ftruncate(fd, size)
    return fd


def child(code, *pass_fds):
    """Run `code` in a fresh interpreter that inherits `pass_fds` (sys.argv[1:] are their numbers)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", code, *map(str, pass_fds)], pass_fds=pass_fds, env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def pattern(n, seed):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def vm_locked_kib():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmLck:")).split()[1])


# ---------------------------------------------------------------- native: over_fd, view, protect
def test_over_fd_packs_then_maps_read_only_here_and_in_a_fresh_process(fds):
    fd = memfd(fds, PAGE + 3 * PAGE)
    packer = _native.HostArena.over_fd(fd, PAGE, 3 * PAGE, writable=True, pinned=False)
    assert packer.writable and packer.capacity == 3 * PAGE
    a, b = packer.allocate(1000, alignment=4096), packer.allocate(5000, alignment=4096)
    a.copy_(pattern(1000, 1))
    b.copy_(pattern(5000, 2))
    offsets = (a.data_ptr() - packer.data_ptr, b.data_ptr() - packer.data_ptr)
    packer.protect()
    assert not packer.writable
    with pytest.raises(RuntimeError, match="read-only .* view\\(offset, nbytes\\)"):
        packer.allocate(16)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, sa.SEALS)

    reader = _native.HostArena.over_fd(fd, PAGE, 3 * PAGE, writable=False, pinned=False)
    assert not reader.writable and reader.used == 0
    assert torch.equal(reader.view(offsets[1], 5000), b) and torch.equal(reader.view(offsets[0], 1000), a)
    assert reader.used == offsets[1] + 5000  # the highest byte viewed, in any order
    with pytest.raises(RuntimeError, match="read-only"):
        reader.allocate(16)

    out = child(f"""
import hashlib, sys
from layerwise import _native
arena = _native.HostArena.over_fd(int(sys.argv[1]), {PAGE}, {3 * PAGE}, writable=False, pinned=False)
for off, n in [({offsets[0]}, 1000), ({offsets[1]}, 5000)]:
    print(hashlib.sha256(arena.view(off, n).numpy().tobytes()).hexdigest())
""", fd)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in (a, b)]


def test_mlock_pins_a_read_only_shared_mapping_once_per_page_in_any_view_order(fds):
    anonymous = _native.HostArena(PAGE, pinned=True, cuda=False)
    anonymous.allocate(PAGE)
    if not anonymous.pinned:
        pytest.skip(f"mlock is not allowed in this process at all: {anonymous.pin_error}")
    del anonymous
    fd = memfd(fds, PAGE + 4 * PAGE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, sa.SEALS)
    before = vm_locked_kib()
    arena = _native.HostArena.over_fd(fd, PAGE, 4 * PAGE, writable=False, pinned=True, cuda=False)
    assert arena.pin_kind == "mlock"
    # Above the high-water mark, then below it (the skipped pages), then inside a page pinned already.
    views = [arena.view(2 * PAGE, PAGE), arena.view(0, PAGE), arena.view(PAGE, 256), arena.view(PAGE + 256, 256)]
    assert arena.pinned, arena.pin_error
    assert vm_locked_kib() - before == 3 * PAGE // 1024
    assert all(int(v.sum()) == 0 for v in views)  # a memfd's pages read as zeros
    del arena, views
    assert vm_locked_kib() == before  # the last tensor's keepalive unpins and unmaps


def test_a_write_after_protect_faults():
    out = child("""
import os
from layerwise import _native
fd = os.memfd_create("layerwise:protect", os.MFD_CLOEXEC)
os.ftruncate(fd, 8192)
arena = _native.HostArena.over_fd(fd, 0, 8192, writable=True, pinned=False)
t = arena.allocate(100)
t.fill_(7)
arena.protect()
print("protected", int(t.sum()), flush=True)
t.fill_(8)
print("wrote after protect", flush=True)
""")
    assert out.stdout.split("\n")[0] == "protected 700"
    assert out.returncode == -signal.SIGSEGV, (out.returncode, out.stdout, out.stderr)
    assert "wrote after protect" not in out.stdout


def test_view_bounds_and_alignment_are_checked(fds):
    fd = memfd(fds, 2 * PAGE)
    arena = _native.HostArena.over_fd(fd, 0, 2 * PAGE, writable=False, pinned=False)
    cap = 2 * PAGE
    for offset, nbytes in [(PAGE, cap), (-1, 4), (0, -1), (cap + 256, 0), (cap - 256, 512)]:
        with pytest.raises(ValueError, match=f"offset {offset}, nbytes {nbytes} is outside the arena's capacity "
                                             f"of {cap} bytes"):
            arena.view(offset, nbytes)
    with pytest.raises(ValueError, match="offset 100 is not aligned to 256 bytes"):
        arena.view(100, 4)
    assert arena.view(100, 4, alignment=4).numel() == 4
    assert arena.view(cap, 0).numel() == 0 and arena.used == cap
    with pytest.raises(ValueError, match="power of two"):
        arena.view(0, 4, alignment=3)


def test_over_fd_refuses_a_writable_mapping_of_a_sealed_memfd_and_bad_arguments(fds):
    fd = memfd(fds, 2 * PAGE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, sa.SEALS)
    with pytest.raises(RuntimeError, match=r"mmap\(PROT_READ\|PROT_WRITE, MAP_SHARED\) .*/memfd:layerwise:t-.*"
                                           r"Operation not permitted.*sealed against writing.*writable=False"):
        _native.HostArena.over_fd(fd, 0, PAGE, writable=True, pinned=False)
    with pytest.raises(ValueError, match=f"offset must be a multiple of the page size \\({PAGE} bytes\\)"):
        _native.HostArena.over_fd(fd, 100, PAGE, writable=False)
    with pytest.raises(ValueError, match=f"is {2 * PAGE} bytes, too short for offset {PAGE} \\+ nbytes {2 * PAGE}"):
        _native.HostArena.over_fd(fd, PAGE, 2 * PAGE, writable=False)
    r, w = os.pipe()
    fds += [r, w]
    with pytest.raises(ValueError, match="not a regular file"):
        _native.HostArena.over_fd(r, 0, PAGE, writable=False)
    os.close(w)
    fds.remove(w)
    with pytest.raises(ValueError, match=f"fd {w} is not an open file descriptor"):
        _native.HostArena.over_fd(w, 0, PAGE, writable=False)


# ---------------------------------------------------------------- shared_arena: create, seal, open
def test_round_trip_through_a_fresh_process(fds):
    sf = SharedFile.create(f"t-{uuid.uuid4().hex[:16]}", 10000)
    fds.append(sf.fd)
    assert (sf.data_offset, sf.data_bytes, sf.packer_pid, sf.sealed) == (PAGE, 10000, os.getpid(), False)
    assert os.fstat(sf.fd).st_mode & 0o777 == 0o600
    arena = _native.HostArena.over_fd(sf.fd, sf.data_offset, sf.data_bytes, writable=True, pinned=False)
    data = arena.allocate(10000, alignment=4096)
    data.copy_(pattern(10000, 3))
    sf.seal(DIGEST, MANIFEST)
    arena.protect()
    assert sf.sealed
    assert fcntl.fcntl(sf.fd, fcntl.F_GET_SEALS) & sa.SEALS == sa.SEALS

    out = child(f"""
import hashlib, json, sys
from layerwise import _native
from layerwise.runtime.shared_arena import SharedFile
sf, manifest = SharedFile.open(int(sys.argv[1]), bytes.fromhex("{DIGEST.hex()}"), "{WHERE}")
arena = _native.HostArena.over_fd(sf.fd, sf.data_offset, sf.data_bytes, writable=False, pinned=True, cuda=False)
print(sf.packer_pid, sf.data_bytes)
print(hashlib.sha256(arena.view(0, sf.data_bytes).numpy().tobytes()).hexdigest())
print(json.dumps(manifest))
sf.close()
sf.close()
""", sf.fd)
    assert out.returncode == 0, out.stderr
    header, sha, manifest = out.stdout.strip().split("\n")
    assert header == f"{os.getpid()} 10000"
    assert sha == hashlib.sha256(data.numpy().tobytes()).hexdigest()
    assert json.loads(manifest) == MANIFEST


def test_seal_shrinks_the_data_area_to_what_was_used(fds):
    sf = SharedFile.create(f"t-{uuid.uuid4().hex[:16]}", 10 * PAGE)
    fds.append(sf.fd)
    with pytest.raises(ValueError, match="data_bytes 99999999 must be between 0 and"):
        sf.seal(DIGEST, MANIFEST, data_bytes=99999999)
    sf.seal(DIGEST, MANIFEST, data_bytes=PAGE + 1)
    opened, manifest = SharedFile.open(os.dup(sf.fd), DIGEST, WHERE)
    assert (opened.data_bytes, manifest) == (PAGE + 1, MANIFEST)
    assert os.fstat(opened.fd).st_size == PAGE + 2 * PAGE + len(json.dumps(MANIFEST, separators=(",", ":")))
    opened.close()
    with pytest.raises(SharedArenaError, match="sealed already"):
        sf.seal(DIGEST, MANIFEST)


def forge(fds, *, name=None, mode=0o600, seals=sa.SEALS, **header):
    """A memfd laid out as seal() lays it out, with the header fields, name, mode and seals given."""
    fd = memfd(fds, 0, name)
    body = json.dumps(MANIFEST).encode()
    data_bytes = 2 * PAGE + 1
    off = PAGE + 3 * PAGE
    os.ftruncate(fd, off + len(body))
    os.pwrite(fd, body, off)
    fields = dict(magic=sa.MAGIC, version=sa.FORMAT_VERSION, page=PAGE, digest=DIGEST, data_bytes=data_bytes,
                  manifest_off=off, manifest_len=len(body), manifest_sha=hashlib.sha256(body).digest(),
                  pid=os.getpid(), uid=os.geteuid(), created=time.time_ns(), mark=sa.COMPLETE)
    assert set(header) <= set(fields)
    fields.update(header)
    os.pwrite(fd, sa.HEADER.pack(*fields.values()), 0)
    os.fchmod(fd, mode)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def refused(fd, digest=DIGEST):
    """The refusal's message; the fd stays open (the caller's) after it."""
    with pytest.raises(SharedArenaError) as e:
        SharedFile.open(fd, digest, WHERE)
    os.fstat(fd)
    message = str(e.value)
    assert WHERE in message and f"/proc/self/fd/{fd} -> " in message, message
    return message


def test_a_forged_file_with_nothing_wrong_is_accepted(fds):
    # The control for the refusals below: each changes one thing of this file.
    sf, manifest = SharedFile.open(os.dup(forge(fds)), DIGEST, WHERE)
    assert (sf.data_bytes, sf.packer_pid, manifest) == (2 * PAGE + 1, os.getpid(), MANIFEST)
    sf.close()


def test_refuses_a_regular_file(fds, tmp_path):
    path = tmp_path / "planted"
    path.write_bytes(os.pread(forge(fds), 10 * PAGE, 0))
    fd = os.open(path, os.O_RDWR)
    fds.append(fd)
    os.fchmod(fd, 0o600)
    message = refused(fd)
    assert f"-> {path}" in message and "planted: a file with a name (st_nlink 1)" in message


def test_refuses_a_memfd_not_named_layerwise(fds):
    message = refused(forge(fds, name="someone-else"))
    assert "/memfd:someone-else" in message and "planted: not a memfd named layerwise:<key>" in message


def test_refuses_an_unsealed_memfd(fds):
    message = refused(forge(fds, seals=0))
    assert "wrong mode: unsealed or writable (missing F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_FUTURE_WRITE, " \
           "F_SEAL_SEAL)" in message


def test_refuses_a_memfd_sealed_without_future_write(fds):
    message = refused(forge(fds, seals=sa.SEALS & ~sa.F_SEAL_FUTURE_WRITE))
    assert "wrong mode: unsealed or writable (missing F_SEAL_FUTURE_WRITE)" in message


def test_refuses_group_or_other_mode_bits(fds):
    message = refused(forge(fds, mode=0o644))
    assert "planted: mode 0o644 gives group or other users access" in message


def test_refuses_a_file_shorter_than_its_header_says(fds):
    message = refused(forge(fds, manifest_len=len(json.dumps(MANIFEST)) + PAGE))
    assert "truncated: the file is " in message and "packed by pid" in message


def test_refuses_another_layout(fds):
    message = refused(forge(fds), digest=hashlib.sha256(b"another model").digest())
    assert "a different layout" in message and "its own share_host key" in message


def test_refuses_a_header_without_the_complete_mark(fds):
    message = refused(forge(fds, mark=b"\0" * 8))
    assert "incomplete: its header has no COMPLETE mark" in message


def test_refuses_a_manifest_that_does_not_match_its_sha(fds):
    message = refused(forge(fds, manifest_sha=hashlib.sha256(b"something else").digest()))
    assert "corrupt: its manifest does not match the sha256 in its header" in message


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user (CI runs as root)")
def test_refuses_another_users_file(fds):
    fd = forge(fds, seals=0)
    os.fchown(fd, 65534, -1)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, sa.SEALS)
    message = refused(fd)
    assert f"planted: owned by uid 65534, not by this process's uid {os.geteuid()}" in message
