"""shared_arena: the file that holds a layer group's host blocks once per
machine (share_host): a memfd, packed by one process, sealed, and mapped
read-only by the others.

Layout: page 0 is the header, the data (the arena, mapped with
``HostArena.over_fd(fd, data_offset, data_bytes, ...)``) begins at page 1, and
the manifest (JSON: what the data holds, filled by the packer) follows the data
from the next page boundary. The packer writes the data, then the manifest,
then the header in one pwrite whose last field is the COMPLETE mark, and seals
the file (no shrink, no grow, no new writable mapping, no new seals).

Why a memfd: the kernel frees it with the last fd or mapping, so a process
killed at any moment leaks nothing, and it has no path another user could
plant, truncate or chmod. An fd reaches another process only over the
rendezvous socket; ``SharedFile.open`` still checks everything the file
claims before anything of it is mapped, and refuses with the rendezvous
address, the fd's target and the cause.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import stat
import struct
import time
from typing import NoReturn

PAGE = mmap.PAGESIZE
F_SEAL_FUTURE_WRITE = 0x10  # Linux 5.1; Python's fcntl does not define it
FORMAT_VERSION = 1
MAGIC = b"LWSHARE\0"
COMPLETE = b"COMPLETE"
NAME_PREFIX = "layerwise:"
# magic, version, page size, layout digest, data bytes, manifest offset and length, manifest sha256,
# packer pid and uid, created (ns since the epoch), COMPLETE mark
HEADER = struct.Struct("<8sII32sQQQ32sIIQ8s")
# No shrink or grow (no SIGBUS under a mapping), no new writable mapping, no seal removed.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
_SEAL_NAMES = ((fcntl.F_SEAL_SHRINK, "F_SEAL_SHRINK"), (fcntl.F_SEAL_GROW, "F_SEAL_GROW"),
               (F_SEAL_FUTURE_WRITE, "F_SEAL_FUTURE_WRITE"), (fcntl.F_SEAL_SEAL, "F_SEAL_SEAL"))

_VERSIONS = "make every process use the same layerwise version, or turn share_host off"
_FOREIGN = ("only a memfd packed by layerwise under this user is attached: find the process that offered it "
            "(ss -xlp | grep layerwise) and stop it, or turn share_host off")


class SharedArenaError(RuntimeError):
    """A shared arena refused: names the path and what to do."""


def _round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def _target(fd: int) -> str:
    """`/proc/self/fd/N -> /memfd:layerwise:key (deleted)`, for errors."""
    link = f"/proc/self/fd/{fd}"
    try:
        return f"{link} -> {os.readlink(link)}"
    except OSError as e:
        return f"{link} (unreadable: {e.strerror})"


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class SharedFile:
    """One shared arena's memfd. `create` makes it (the packer), `seal` ends the
    packing, `open` checks one received from another process (an attacher)."""

    def __init__(self, fd: int, data_bytes: int, packer_pid: int, sealed: bool):
        self.fd = fd  # the memfd; this object's to close (close())
        self.data_offset = PAGE  # where the data begins; page 0 is the header
        self.data_bytes = data_bytes  # bytes of data (the arena's size); its area is page-rounded
        self.packer_pid = packer_pid  # the process that packed (and sealed) it
        self.sealed = sealed

    @classmethod
    def create(cls, name: str, data_bytes: int) -> SharedFile:
        """A new, empty, unsealed memfd `layerwise:<name>` with room for
        `data_bytes` of data. Untouched pages cost no memory, so `data_bytes`
        can be an upper bound."""
        if data_bytes < 0:
            raise ValueError(f"SharedFile.create: data_bytes must be >= 0, got {data_bytes}")
        fd = os.memfd_create(NAME_PREFIX + name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            # A memfd is created mode 0777: its mode is what open() checks for group and other bits.
            os.fchmod(fd, 0o600)
            mode = os.fstat(fd).st_mode
            if mode & 0o077:
                raise SharedArenaError(f"share_host: the new memfd {_target(fd)} has mode {oct(mode & 0o777)} after "
                                       f"fchmod(0o600): the file system ignores modes, so other users could map "
                                       f"it; turn share_host off")
            os.ftruncate(fd, PAGE + _round_up(data_bytes))
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, data_bytes, os.getpid(), sealed=False)

    def seal(self, digest: bytes, manifest: dict, *, data_bytes: int | None = None) -> None:
        """Write the manifest and then the header (COMPLETE last), and seal the
        file. `data_bytes` (optional) shrinks the data area to what the packing
        used, at most the size created with. Writes through mappings made
        before the seal still land (the kernel's rule): protect() those arenas."""
        if self.sealed:
            raise SharedArenaError(f"share_host: {_target(self.fd)} is sealed already")
        if len(digest) != 32:
            raise ValueError(f"SharedFile.seal: digest must be 32 bytes (a sha256), got {len(digest)}")
        if data_bytes is not None:
            if not 0 <= data_bytes <= self.data_bytes:
                raise ValueError(f"SharedFile.seal: data_bytes {data_bytes} must be between 0 and the "
                                 f"{self.data_bytes} bytes created")
            self.data_bytes = data_bytes
        body = json.dumps(manifest, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
        manifest_off = PAGE + _round_up(self.data_bytes)
        os.ftruncate(self.fd, manifest_off + len(body))
        _pwrite_all(self.fd, body, manifest_off)
        header = HEADER.pack(MAGIC, FORMAT_VERSION, PAGE, digest, self.data_bytes, manifest_off, len(body),
                             hashlib.sha256(body).digest(), os.getpid(), os.geteuid(), time.time_ns(), COMPLETE)
        # One write, mark last: a header without the mark was never finished.
        if os.pwrite(self.fd, header, 0) != len(header):
            raise SharedArenaError(f"share_host: a short write of the header of {_target(self.fd)}")
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
        self.sealed = True
        self.packer_pid = os.getpid()

    @classmethod
    def open(cls, fd: int, digest: bytes, where: str) -> tuple[SharedFile, dict]:
        """Check the memfd `fd` received from the rendezvous at `where`, before
        anything of it is mapped, and return it with its manifest. On success
        the returned SharedFile owns `fd`; on failure (SharedArenaError) the
        caller still does."""
        target = _target(fd)
        packer = ""

        def refuse(cause: str, todo: str) -> NoReturn:
            raise SharedArenaError(f"share_host: refused the arena offered at {where} ({target}{packer}): "
                                   f"{cause}; {todo}")

        try:
            st = os.fstat(fd)
        except OSError as e:
            refuse(f"fstat failed: {e.strerror}", "the offering process sent no open file")
        if not stat.S_ISREG(st.st_mode):
            refuse("planted: not a regular file", _FOREIGN)
        if st.st_nlink != 0:
            refuse(f"planted: a file with a name (st_nlink {st.st_nlink}), not a memfd", _FOREIGN)
        if st.st_uid != os.geteuid():
            refuse(f"planted: owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}", _FOREIGN)
        if st.st_mode & 0o077:
            refuse(f"planted: mode {oct(st.st_mode & 0o777)} gives group or other users access "
                   f"(layerwise makes it 0o600)", _FOREIGN)
        if not target.split(" -> ", 1)[-1].startswith("/memfd:" + NAME_PREFIX):
            refuse(f"planted: not a memfd named {NAME_PREFIX}<key>", _FOREIGN)
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as e:
            refuse(f"wrong mode: its seals cannot be read ({e.strerror})", _VERSIONS)
        missing = [name for bit, name in _SEAL_NAMES if not seals & bit]
        if missing:
            refuse(f"wrong mode: unsealed or writable (missing {', '.join(missing)})", _VERSIONS)
        if st.st_size < PAGE:
            refuse(f"truncated: {st.st_size} bytes, shorter than its header page of {PAGE}", _VERSIONS)
        (magic, version, page, file_digest, data_bytes, manifest_off, manifest_len, manifest_sha, pid, _uid,
         _created, mark) = HEADER.unpack(os.pread(fd, HEADER.size, 0))
        if magic != MAGIC:
            refuse(f"not a layerwise shared arena (magic {magic!r}, expected {MAGIC!r})", _FOREIGN)
        packer = f", packed by pid {pid}"
        if mark != COMPLETE:
            refuse(f"incomplete: its header has no {COMPLETE.decode()} mark (its packer never finished it)",
                   _FOREIGN)
        if version != FORMAT_VERSION:
            refuse(f"format version {version}, this layerwise reads version {FORMAT_VERSION}", _VERSIONS)
        if page != PAGE:
            refuse(f"packed with {page}-byte pages, this process has {PAGE}-byte pages", _VERSIONS)
        if manifest_off != PAGE + _round_up(data_bytes) or st.st_size != manifest_off + manifest_len:
            refuse(f"truncated: the file is {st.st_size} bytes, its header says {PAGE} + {data_bytes} of data "
                   f"(page-rounded) + {manifest_len} of manifest at offset {manifest_off}", _FOREIGN)
        if file_digest != digest:
            refuse(f"a different layout: its digest {file_digest.hex()[:16]}... is not this model's "
                   f"{digest.hex()[:16]}... (another model, dtype or option set under the same share key)",
                   "give this model its own share_host key")
        body = os.pread(fd, manifest_len, manifest_off)
        if len(body) != manifest_len or hashlib.sha256(body).digest() != manifest_sha:
            refuse("corrupt: its manifest does not match the sha256 in its header", _FOREIGN)
        try:
            manifest = json.loads(body)
        except ValueError as e:
            refuse(f"corrupt: its manifest is not JSON ({e})", _FOREIGN)
        if not isinstance(manifest, dict):
            refuse(f"corrupt: its manifest is a {type(manifest).__name__}, not an object", _FOREIGN)
        return cls(fd, data_bytes, pid, sealed=True), manifest

    def close(self) -> None:
        """Close the fd (mappings made from it stay valid); idempotent."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __repr__(self) -> str:
        state = "sealed" if self.sealed else "packing"
        return f"SharedFile(fd={self.fd}, data_bytes={self.data_bytes}, {state}, packer_pid={self.packer_pid})"
