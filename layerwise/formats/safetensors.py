"""The safetensors format, as layerwise reads it: headers validated at least as
strictly as the safetensors library (offsets sorted, contiguous from zero, no gaps
or overlaps, ending at the file's end; each tensor's byte length its shape times
its dtype size; each error names the tensor and the file), sharded index files
confined to their folder, regular files only, and positioned reads of a stored
tensor's bytes into a host tensor (optionally dropping the pages read from the page
cache, for a host budget). One handle per tensor: `Stored` (the file's open
descriptor, the tensor's byte range, dtype and shape), from `read_header`.

Used by layerwise.loading (load_offloaded) and, through `Stored`, by the disk tier
(checkpoint layers streamed from the file)."""
from __future__ import annotations

import errno
import json
import os
import stat
import struct
from dataclasses import dataclass

import torch

# https://github.com/huggingface/safetensors#format: dtype names of the header,
# and the bits one element takes (safetensors' Dtype::bitsize). DTYPES maps the
# names to torch dtypes where torch has one; the others parse but cannot be loaded.
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu"),
                     ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
                     ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)

MAX_HEADER = 100_000_000  # bytes: the safetensors library's own limit
_U64 = 1 << 64  # offsets and sizes are u64 in the format
_REWRITE = "re-download the file or save it again with safetensors"


@dataclass
class Stored:
    path: str
    start: int  # absolute byte offset in the file
    nbytes: int
    dtype: torch.dtype | str
    shape: tuple
    fd: int = -1  # the file, open for the duration of a load
    evict: PageCacheDrop | None = None  # a host_budget load: what drops the bytes read from the page cache


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs):
    """json object_pairs_hook: a key twice in one object is refused (json keeps the last silently)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _parse_json(raw: bytes, path: str, what: str, subject: str, hint: str):
    """`raw` as a JSON value; every way it can fail is a ValueError naming `path`:
    "<path>: <what> (<subject> is ...): <hint>"."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as e:
        problem = f"is not UTF-8 text (byte {e.start})"
    except json.JSONDecodeError as e:
        problem = f"is not valid JSON: {e}"
    except RecursionError:
        problem = "is JSON nested too deeply to parse"
    except _DuplicateKey as e:
        problem = f"has the key {e.args[0]!r} twice"
    raise ValueError(f"{path}: {what} ({subject} {problem}): {hint}")


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


class CheckpointFileNotFound(FileNotFoundError, ValueError):
    """A checkpoint file that does not exist: a FileNotFoundError (errno ENOENT, the
    path in .filename), and a ValueError as every other refused checkpoint is."""


def _check_regular(path: str, what: str) -> None:
    """`path` must be an existing regular file. Checked with stat, never by opening it
    (opening a FIFO blocks until someone writes to it)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointFileNotFound(errno.ENOENT, f"{what}: no such file", path) from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        raise ValueError(f"{what}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{what}: is {_file_kind(st.st_mode)}, not a regular file: name a .safetensors file "
                         "(or an index JSON) instead")


def _open_regular(path: str, what: str):
    """Open `path` for reading, refusing anything but a regular file. O_NONBLOCK makes
    opening a FIFO return at once (the check after the open then refuses it), and the
    check is on the descriptor itself, so the file cannot be swapped in between."""
    from layerwise import contract  # (imported here: this module sits below it)

    _check_regular(path, what)
    with contract.defer_interrupts():  # until the file object that closes the descriptor holds it
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{what}: is {_file_kind(st.st_mode)}, not a regular file")
            return os.fdopen(fd, "rb"), st.st_size
        except BaseException:
            os.close(fd)
            raise


def _u64(v) -> bool:
    return type(v) is int and 0 <= v < _U64  # bool is an int subclass: refused by `type(...) is int`


def _header(path: str):
    """(header JSON object, header length, file size) of the .safetensors file `path`,
    its `__metadata__` checked (an object of strings to strings)."""
    def bad(what):
        return ValueError(f"{path}: not a safetensors file ({what}): {_REWRITE}")

    f, size = _open_regular(path, path)
    with f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length): {_REWRITE}")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise bad(f"header length {n} is over the {MAX_HEADER}-byte limit of the format")
        if 8 + n > size:
            raise bad(f"header length {n} is past the end of the file, which has {size} bytes")
        raw = f.read(n)
        if len(raw) != n:
            raise bad(f"the file ends inside its {n}-byte header")
    header = _parse_json(raw, path, "not a safetensors file", "the header", _REWRITE)
    if not isinstance(header, dict):
        raise bad(f"the header is a JSON {type(header).__name__}, not an object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("'__metadata__' must be an object of strings to strings")
    return header, n, size


def read_metadata(path: str) -> dict[str, str]:
    """The `__metadata__` of the .safetensors file `path` ({} if it has none): where a
    library records what its tensors are (torchao: each quantized wrapper's form)."""
    return dict(_header(os.fspath(path))[0].get("__metadata__", {}))


def read_header(path: str) -> dict[str, Stored]:
    """The tensors of the .safetensors file `path`, read from its header only, which is
    checked as strictly as the safetensors library checks it (and a little more: no key
    twice). Each error is a ValueError naming the file and, where there is one, the tensor."""
    path = os.fspath(path)

    def bad(what, key=None):
        where = f"{path}: tensor {key!r}" if key is not None else path
        return ValueError(f"{where}: not a safetensors file ({what}): {_REWRITE}")

    header, n, size = _header(path)
    data_size = size - 8 - n

    spans = []  # (begin, end, key)
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise bad(f"its entry is a JSON {type(info).__name__}, not an object with dtype, shape and "
                      "data_offsets", key)
        for field in ("dtype", "shape", "data_offsets"):
            if field not in info:
                raise bad(f"its entry has no {field!r}", key)
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise bad(f"unknown dtype {dtype!r} (the format knows {', '.join(DTYPE_BITS)})", key)
        if not isinstance(shape, list) or not all(_u64(d) for d in shape):
            raise bad(f"shape {shape!r} is not a list of non-negative integers", key)
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_u64(o) for o in offsets):
            raise bad(f"data_offsets {offsets!r} is not a pair [begin, end] of non-negative integers below 2**64",
                      key)
        begin, end = offsets
        if begin > end:
            raise bad(f"data_offsets [{begin}, {end}] end before they begin", key)
        if end > data_size:
            raise bad(f"data_offsets [{begin}, {end}] end past the data section, which has {data_size} bytes "
                      "(a truncated file?)", key)
        numel = 1
        for d in shape:  # folded left with the 64-bit bound, as the safetensors library does
            numel *= d
            if numel >= _U64:
                raise bad(f"shape {shape} has more elements than 64 bits count", key)
        bits = numel * DTYPE_BITS[dtype]
        if bits % 8:
            raise bad(f"shape {shape} of {dtype} is not a whole number of bytes", key)
        if end - begin != bits // 8:
            raise bad(f"data_offsets [{begin}, {end}] hold {end - begin} bytes but shape {shape} of {dtype} "
                      f"needs {bits // 8}", key)
        spans.append((begin, end, key))
        out[key] = Stored(path, 8 + n + begin, end - begin, DTYPES.get(dtype, dtype), tuple(shape))

    # Sorted by offsets, the tensors tile the data section exactly: from 0, no gap,
    # no overlap (two tensors on the same bytes included), nothing after the last.
    at, prev = 0, None
    for begin, end, key in sorted(spans):
        if begin > at:
            raise bad(f"bytes [{at}, {begin}) of the data section belong to no tensor: it starts at {begin}, "
                      + (f"after tensor {prev!r} ends at {at}" if prev is not None else "not at 0"), key)
        if begin < at:
            raise bad(f"data_offsets [{begin}, {end}] overlap tensor {prev!r}, which ends at {at}", key)
        at, prev = end, key
    if at != data_size:
        raise bad(f"the data section has {data_size} bytes but the tensors cover {at}: "
                  f"{data_size - at} trailing bytes belong to no tensor")
    return out


def _index_shards(index: str) -> list[str]:
    """The shard files named by the index JSON `index`, each confined to the index's
    folder and checked to be a regular file (without opening it)."""
    f, _ = _open_regular(index, f"{index} (index JSON)")
    with f:
        raw = f.read()
    hint = "an index JSON is an object with a 'weight_map' of tensor names to shard file names"
    data = _parse_json(raw, index, "not an index JSON", "its text", hint)
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        what = "has no 'weight_map' object" if isinstance(data, dict) else f"is a JSON {type(data).__name__}"
        raise ValueError(f"{index}: an index JSON needs a 'weight_map': it {what}; {hint}")
    weight_map = data["weight_map"]
    if not weight_map:
        raise ValueError(f"{index}: the 'weight_map' is empty: it names no shard")
    base = os.path.dirname(index)
    # Where a shard may resolve: the index's folder, or the folder the index itself
    # really lives in (a hub cache links snapshots/<rev>/* to ../../blobs/*).
    folder = os.path.realpath(base or ".")
    roots = {folder, os.path.dirname(os.path.realpath(index))}
    shards = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{index}: tensor {key!r} maps to {name!r}, not a shard file name; {hint}")
        if name in shards:
            continue
        what = f"{index}: shard {name!r} (of tensor {key!r})"
        parts = name.replace("\\", "/").split("/")
        if os.path.isabs(name) or name.startswith(("/", "\\")):
            raise ValueError(f"{what} is an absolute path: an index may only name files in its own folder")
        if ".." in parts:
            raise ValueError(f"{what} has a '..' component: an index may only name files in its own folder")
        if "\0" in name:
            raise ValueError(f"{what} has a NUL character in its name")
        full = os.path.join(base, name)
        real = os.path.realpath(full)
        if not any(os.path.commonpath([root, real]) == root for root in roots):
            raise ValueError(f"{what} resolves to {real}, outside the index's folder {folder} "
                             "(a symbolic link out of it): copy the shard into the folder")
        _check_regular(full, what)
        shards[name] = full
    return sorted(set(shards.values()))


def checkpoint_files(checkpoint) -> list[str]:
    """The .safetensors files of `checkpoint` (a folder, a file, an index JSON, or a
    list of files), each an existing regular file. A folder (what save_pretrained
    writes) holds one `*.safetensors.index.json`, or else one `*.safetensors` file."""
    if isinstance(checkpoint, (str, os.PathLike)):
        path = os.fspath(checkpoint)
        if os.path.isdir(path):
            names = sorted(os.listdir(path))
            indexes = [n for n in names if n.endswith(".safetensors.index.json")]
            files = [n for n in names if n.endswith(".safetensors")]
            if len(indexes) == 1:
                return _index_shards(os.path.join(path, indexes[0]))
            if not indexes and len(files) == 1:
                only = os.path.join(path, files[0])
                _check_regular(only, only)
                return [only]
            raise ValueError(
                f"checkpoint folder {path}: expected one *.safetensors.index.json or else one *.safetensors file, "
                f"found {len(indexes)} index file(s) {indexes[:4]} and {len(files)} .safetensors file(s) "
                f"{files[:4]}; pass the index JSON or the list of files")
        if path.endswith(".json"):
            return _index_shards(path)
        _check_regular(path, path)
        return [path]
    try:
        files = [os.fspath(c) for c in checkpoint]
    except TypeError:
        raise TypeError(f"checkpoint: expected a .safetensors path, an index JSON path or a list of .safetensors "
                        f"paths, got {checkpoint!r}") from None
    if not files:
        raise ValueError("checkpoint: no files given")
    for path in files:
        _check_regular(path, path)
    return files


def bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous host tensor `t`, writable, whatever its shape (0-dim
    and empty included: a 0-dim tensor cannot be viewed as bytes directly)."""
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


class PageCacheDrop:
    """With a host budget, the checkpoint's pages read while packing must not stay
    in the page cache: they are memory of the process's cgroup as much as the arena
    is (a 512 MiB checkpoint loaded with host_budget=128 MiB stayed cached whole).
    Read-ahead is turned off (it would cache bytes nobody read yet), and after every
    EVERY bytes of pages read (and at the end) the span read since the last drop
    is dropped, rounded out to 2 MiB: the page cache may hold a file in folios of
    up to 2 MiB, and a folio that straddles two tensors is dropped by neither
    tensor's own range. Reads stop at the next drop (`room`), so the cache holds
    at most most(EVERY) bytes of the checkpoint at any time (layerwise.planning.host_budget
    counts them; tests/stages/test_disk_tier.py measures it)."""

    _FOLIO = 2 << 20

    @staticmethod
    def every_for(managers) -> int:
        """EVERY for a load: 1 MiB (reads of 256 KiB without read-ahead made a cold
        load slower; 1 MiB ones did not, within the noise of a 2-core VM), or the largest
        layer if that is less (a small model's small budget), at least 64 KiB."""
        largest = max((lp.nbytes for m in managers for lp in m.plan.layers), default=0)
        return max(64 << 10, min(1 << 20, -(-largest // 4096) * 4096))

    @classmethod
    def most(cls, every: int) -> int:
        return every + 2 * 4096  # ... and the two pages the read that reaches it starts and ends in

    def __init__(self, fds, every: int):
        self.EVERY = every
        self.fds = list(fds)
        self.spans: dict[int, list[int]] = {}  # fd -> [lo, hi) read since the last drop
        self.since = 0  # bytes of the pages read since the last drop, all files together
        for fd in self.fds:  # (and what reading the header read ahead goes first)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def room(self) -> int:
        return max(4096, self.EVERY - self.since)

    def read(self, fd: int, start: int, nbytes: int) -> None:
        span = self.spans.setdefault(fd, [start, start + nbytes])
        span[0], span[1] = min(span[0], start), max(span[1], start + nbytes)
        self.since += (-(-(start + nbytes) // 4096) - start // 4096) * 4096  # the pages it cached
        if self.since >= self.EVERY:
            self.drop()

    def drop(self) -> None:
        f = self._FOLIO
        for fd, (lo, hi) in self.spans.items():
            lo = lo // f * f
            os.posix_fadvise(fd, lo, -(-hi // f) * f - lo, os.POSIX_FADV_DONTNEED)
        self.spans.clear()
        self.since = 0

    def close(self) -> None:
        self.drop()


def pread_exact(stored: Stored, view: memoryview, start: int) -> None:
    """Read len(view) bytes of the stored tensor's file at `start` into `view` (in
    pieces the page-cache drop can follow, with one)."""
    drop = stored.evict
    got = 0
    while got < len(view):
        piece = len(view) - got if drop is None else min(len(view) - got, drop.room())
        n = os.preadv(stored.fd, [view[got:got + piece]], start + got)
        if not n:
            raise ValueError(f"{stored.path}: file ends inside a tensor ({got} of {len(view)} bytes read)")
        if drop is not None:
            drop.read(stored.fd, start + got, n)
        got += n


def read_into(stored: Stored, out: torch.Tensor) -> None:
    """Read a stored tensor's bytes into the contiguous tensor `out` (host, of the
    stored dtype), with positioned reads on the file's open descriptor."""
    pread_exact(stored, bytes_of(out)[: stored.nbytes], stored.start)


def host_tensor(stored: Stored, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The stored tensor on the host, cast to `dtype` (exactly as `.to(dtype)`) if given."""
    t = torch.empty(stored.shape, dtype=stored.dtype)  # torch's allocator: 64-byte aligned
    read_into(stored, t)
    return t if dtype is None or dtype == t.dtype else t.to(dtype)


