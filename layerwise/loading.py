"""load_offloaded: build an offloaded model straight from .safetensors files.

The model is built without weights (on the meta device, e.g. with
accelerate.init_empty_weights or `with torch.device("meta"):`). Layer tensors
are read from the files straight into their place in the host arena (plain
positioned reads into the arena's pages: no intermediate host copy and no
file mapping that would count against the process), non-layer tensors go
straight to the device, and the multi-group order of configure holds: every
group packed, largest first, then one model.to, then finalisation.

Weights the model declares tied are tied first (one checkpoint name fills
them all), buffers left on meta that no checkpoint holds are recomputed from
the config of the module that owns them (layerwise.empty_model builds a model
whose buffers need no recomputing), and `dtype=` casts floating-point tensors
while reading, as `model.to(dtype)` would.

Everything (keys, shapes, dtypes, buffers the checkpoint cannot supply) is
checked before the model changes; a failure half way puts it back.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import inspect
import json
import logging
import os
import stat
import struct
import threading
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from . import contract
from .budget import record_host_budget
from .hostplan import check_disk_options, plan_host_budget
from .configure import _build, _prepare, attach_split_fetch
from .options import validate_compress

log = logging.getLogger("layerwise")

# https://github.com/huggingface/safetensors#format: dtype names of the header,
# and the bits one element takes (safetensors' Dtype::bitsize). _DTYPES maps the
# names to torch dtypes where torch has one; the others parse but cannot be loaded.
_DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu"),
                     ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
                     ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)

_MAX_HEADER = 100_000_000  # bytes: the safetensors library's own limit
_U64 = 1 << 64  # offsets and sizes are u64 in the format
_REWRITE = "re-download the file or save it again with safetensors"


@dataclass
class _Stored:
    path: str
    start: int  # absolute byte offset in the file
    nbytes: int
    dtype: torch.dtype | str
    shape: tuple
    fd: int = -1  # the file, open for the duration of a load
    evict: _PageCacheDrop | None = None  # a host_budget load: what drops the bytes read from the page cache


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
    _check_regular(path, what)
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


def _read_header(path: str) -> dict[str, _Stored]:
    """The tensors of the .safetensors file `path`, read from its header only, which is
    checked as strictly as the safetensors library checks it (and a little more: no key
    twice). Each error is a ValueError naming the file and, where there is one, the tensor."""
    path = os.fspath(path)

    def bad(what, key=None):
        where = f"{path}: tensor {key!r}" if key is not None else path
        return ValueError(f"{where}: not a safetensors file ({what}): {_REWRITE}")

    f, size = _open_regular(path, path)
    with f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length): {_REWRITE}")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise bad(f"header length {n} is over the {_MAX_HEADER}-byte limit of the format")
        if 8 + n > size:
            raise bad(f"header length {n} is past the end of the file, which has {size} bytes")
        raw = f.read(n)
        if len(raw) != n:
            raise bad(f"the file ends inside its {n}-byte header")
    header = _parse_json(raw, path, "not a safetensors file", "the header", _REWRITE)
    if not isinstance(header, dict):
        raise bad(f"the header is a JSON {type(header).__name__}, not an object")
    data_size = size - 8 - n

    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("'__metadata__' must be an object of strings to strings")

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
        if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
            raise bad(f"unknown dtype {dtype!r} (the format knows {', '.join(_DTYPE_BITS)})", key)
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
        bits = numel * _DTYPE_BITS[dtype]
        if bits % 8:
            raise bad(f"shape {shape} of {dtype} is not a whole number of bytes", key)
        if end - begin != bits // 8:
            raise bad(f"data_offsets [{begin}, {end}] hold {end - begin} bytes but shape {shape} of {dtype} "
                      f"needs {bits // 8}", key)
        spans.append((begin, end, key))
        out[key] = _Stored(path, 8 + n + begin, end - begin, _DTYPES.get(dtype, dtype), tuple(shape))

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


def _checkpoint_files(checkpoint) -> list[str]:
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


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous host tensor `t`, writable, whatever its shape (0-dim
    and empty included: a 0-dim tensor cannot be viewed as bytes directly)."""
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


class _PageCacheDrop:
    """With a host budget, the checkpoint's pages read while packing must not stay
    in the page cache: they are memory of the process's cgroup as much as the arena
    is (a 512 MiB checkpoint loaded with host_budget=128 MiB stayed cached whole).
    Read-ahead is turned off (it would cache bytes nobody read yet), and after every
    EVERY bytes of pages read (and at the end) the span read since the last drop
    is dropped, rounded out to 2 MiB: the page cache may hold a file in folios of
    up to 2 MiB, and a folio that straddles two tensors is dropped by neither
    tensor's own range. Reads stop at the next drop (`room`), so the cache holds
    at most most(EVERY) bytes of the checkpoint at any time (layerwise.hostplan
    counts them; tests/test_disk_tier.py measures it)."""

    _FOLIO = 2 << 20

    @staticmethod
    def every_for(managers) -> int:
        """EVERY for a load: 1 MiB (reads of 256 KiB without read-ahead made a cold
        load slower; 1 MiB ones did not, within this VM's noise), or the largest
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


def _pread_exact(stored: _Stored, view: memoryview, start: int) -> None:
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


def _read_into(stored: _Stored, out: torch.Tensor) -> None:
    """Read a stored tensor's bytes into the contiguous tensor `out` (host, of the
    stored dtype), with positioned reads on the file's open descriptor."""
    _pread_exact(stored, _bytes_of(out)[: stored.nbytes], stored.start)


def _host_tensor(stored: _Stored, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The stored tensor on the host, cast to `dtype` (exactly as `.to(dtype)`) if given."""
    t = torch.empty(stored.shape, dtype=stored.dtype)  # torch's allocator: 64-byte aligned
    _read_into(stored, t)
    return t if dtype is None or dtype == t.dtype else t.to(dtype)


def _names(items, what: str) -> str:
    items = list(items)
    more = f" (and {len(items) - 8} more)" if len(items) > 8 else ""
    return f"{what} {len(items)} tensor(s): {', '.join(items[:8])}{more}"


# ------------------------------------------------------------ empty models
_EMPTY = threading.local()  # per thread: {id(host param): (weak ref, meta twin)} while empty_model runs
_EMPTY_LOCK = threading.Lock()
_EMPTY_USERS = [0, None]  # threads inside empty_model, the original register_parameter


def _register_parameter(module, name, param):
    _EMPTY_USERS[1](module, name, param)
    made = getattr(_EMPTY, "made", None)
    if made is None:  # another thread, not building an empty model: untouched
        return
    p = module._parameters.get(name)
    if p is None or p.is_meta:  # a meta one registered again (a tie): kept, so the tie holds
        return
    ref, meta = made.get(id(p), (None, None))
    if ref is None or ref() is not p:  # (a dead one's id may have been reused)
        meta = type(p)(p.to("meta"), requires_grad=p.requires_grad)
        meta.__dict__.update(p.__dict__)
        made[id(p)] = (weakref.ref(p), meta)
    module._parameters[name] = meta


@contextlib.contextmanager
def _parameters_on_meta():
    """While active in this thread, every parameter a module registers moves to the
    meta device (the same Python object under every name it is registered by, so
    weights tied in __init__ stay tied); buffers are left where their code puts
    them. Other threads building modules meanwhile are not affected: the patched
    register_parameter acts only in a thread that is inside empty_model."""
    with _EMPTY_LOCK:
        if _EMPTY_USERS[0] == 0:
            _EMPTY_USERS[1] = nn.Module.register_parameter
            nn.Module.register_parameter = _register_parameter
        _EMPTY_USERS[0] += 1
    outer = getattr(_EMPTY, "made", None)
    _EMPTY.made = outer if outer is not None else {}
    try:
        yield
    finally:
        _EMPTY.made = outer
        with _EMPTY_LOCK:
            _EMPTY_USERS[0] -= 1
            if _EMPTY_USERS[0] == 0:
                nn.Module.register_parameter = _EMPTY_USERS[1]


def empty_model(factory, *args, **kwargs):
    """`factory(*args, **kwargs)` (a model class, a `from_config`, any callable) with
    every parameter on the meta device and every buffer computed for real: what
    `load_offloaded` needs for a model whose buffers (RoPE tables, say) are computed
    in `__init__` and not saved in checkpoints. Like
    `accelerate.init_empty_weights()`, but weights tied in `__init__` stay tied."""
    with _parameters_on_meta():
        return factory(*args, **kwargs)


def _config_factory(mod: nn.Module):
    """A way to build a fresh `mod` from its config, or None: a diffusers model
    (`from_config`) or a module whose only required argument is `config`
    (transformers models, and their rotary embeddings)."""
    config = getattr(mod, "config", None)
    if config is None or isinstance(config, (int, float, str, bool)):
        return None
    cls = type(mod)
    if callable(getattr(cls, "from_config", None)) and hasattr(cls, "register_to_config"):  # diffusers
        return lambda: cls.from_config(config)
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    rest_optional = all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params[1:])
    if params and params[0].name == "config" and rest_optional:
        return lambda: cls(config)
    return None


def _settings(mod: nn.Module) -> dict:
    """A module's plain settings (numbers, strings, flags and tuples of them): what
    its constructor arguments left behind."""
    plain = (int, float, str, bool, type(None))
    return {k: v for k, v in vars(mod).items() if not k.startswith("_") and k != "training"
            and (isinstance(v, plain) or (isinstance(v, (tuple, list)) and all(isinstance(x, plain) for x in v)))}


def _built_differently(mod: nn.Module, twin: nn.Module, rel: str) -> str | None:
    """The first setting in which `twin` (rebuilt from the config) differs from `mod`,
    on the rebuilt module or the module that owns buffer `rel`, else None."""
    owner = rel.rpartition(".")[0]
    pairs = [(type(mod).__name__, mod, twin)]
    if owner:
        pairs.append((owner, mod.get_submodule(owner), twin.get_submodule(owner)))
    for where, a, b in pairs:
        sa, sb = _settings(a), _settings(b)
        for k in sorted(set(sa) | set(sb)):
            if sa.get(k) != sb.get(k):
                return f"{where}.{k} ({sa.get(k)!r} vs {sb.get(k)!r})"
    return None


def _recompute_buffers(model: nn.Module, wanted: dict) -> tuple[dict, dict]:
    """Values for meta buffers no checkpoint holds ({full name: meta buffer}): each is
    taken from a fresh copy of the nearest module on its path that can be rebuilt
    from its config (built with parameters on meta, so it costs no weights).
    Returns ({name: host tensor}, {name: why it could not be recomputed})."""
    modules = dict(model.named_modules())
    twins: dict[str, object] = {}
    values, why = {}, {}
    for full, meta in wanted.items():
        prefix = full.rpartition(".")[0]
        reasons = []
        while True:
            mod = modules[prefix]
            make = _config_factory(mod)
            if make is not None:
                if prefix not in twins:
                    try:
                        with torch.device("cpu"):
                            twins[prefix] = empty_model(make)
                    except Exception as e:  # noqa: BLE001  (any failure: the buffer is unrecoverable)
                        twins[prefix] = e
                twin = twins[prefix]
                rel = full[len(prefix) + 1:] if prefix else full
                what = f"{type(mod).__name__}(config)"
                if isinstance(twin, Exception):
                    reasons.append(f"building {what} failed: {type(twin).__name__}: {twin}")
                else:
                    try:
                        t = twin.get_buffer(rel)
                    except AttributeError:
                        t = None
                    if t is None or t.is_meta:
                        reasons.append(f"{what} has no buffer {rel!r} with values")
                    elif tuple(t.shape) != tuple(meta.shape):
                        reasons.append(f"{what} computes {rel!r} with shape {list(t.shape)}, not "
                                       f"{list(meta.shape)}")
                    elif (diff := _built_differently(mod, twin, rel)) is not None:
                        reasons.append(f"the model's {diff} differs from what {what} gives, so it was built with "
                                       "other arguments and the value would be a guess")
                    else:
                        values[full] = (t.to(meta.dtype), what)
                        break
            if not prefix:
                break
            prefix = prefix.rpartition(".")[0]
        if full not in values:
            owner = type(modules[full.rpartition(".")[0]]).__name__
            why[full] = "; ".join(reasons) or f"neither {owner} nor a module above it has a config to rebuild it from"
    return values, why


# ------------------------------------------------------------ tied weights
def _declared_ties(model: nn.Module) -> list[tuple[str, str]]:
    """(target, source) parameter names that the model says share one tensor: the
    tied weights of a transformers model, as its config has them now."""
    expand = getattr(model, "get_expanded_tied_weights_keys", None)  # transformers >= 5
    if callable(expand):
        try:
            return list(expand(all_submodels=True).items())
        except Exception:  # noqa: BLE001  (a mapping it cannot expand: fall back on what post_init found)
            ties = getattr(model, "all_tied_weights_keys", None)
            return list(ties.items()) if isinstance(ties, dict) else []
    config = getattr(model, "config", None)  # transformers 4: word embeddings, when the config ties them
    get_out, get_in = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    if not getattr(config, "tie_word_embeddings", False) or not callable(get_out) or not callable(get_in):
        return []
    try:
        out, inp = get_out(), get_in()
    except Exception:  # noqa: BLE001
        return []
    where = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    if out is None or inp is None or id(out) not in where or id(inp) not in where:
        return []
    return [(f"{where[id(out)]}.weight".lstrip("."), f"{where[id(inp)]}.weight".lstrip("."))]


def _tie_declared(model: nn.Module) -> bool:
    """Tie the weights the model declares tied but holds as separate parameters (as a
    model built under accelerate.init_empty_weights does): model.tie_weights(), then
    by hand whatever that left. True if anything changed."""
    def param(name):
        try:
            return model.get_parameter(name)
        except AttributeError:
            return None

    loose = [(t, s) for t, s in _declared_ties(model)
             if param(t) is not None and param(s) is not None and param(t) is not param(s)]
    if not loose:
        return False
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    for target, source in loose:
        if param(target) is not param(source):
            mod_name, _, attr = target.rpartition(".")
            model.get_submodule(mod_name)._parameters[attr] = param(source)
    log.info("layerwise: %s declares tied weights that are separate parameters (%s): tied them%s before loading",
             type(model).__name__, ", ".join(f"{t} -> {s}" for t, s in loose),
             " with model.tie_weights()" if callable(tie) else "")
    return True


def _retype(model: nn.Module, dtype: torch.dtype) -> bool:
    """Give every floating-point parameter of another dtype a fresh meta parameter of
    `dtype` (same shape and strides), under every name it has. True if any changed."""
    new: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for attr, p in mod._parameters.items():
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.empty_like(p, dtype=dtype, device="meta"),
                                          requires_grad=p.requires_grad)
            mod._parameters[attr] = new[id(p)]
    return bool(new)


def _unlike_from_pretrained(model: nn.Module, dtype: torch.dtype) -> tuple[list[str], list[str]]:
    """What `dtype=` casts that `from_pretrained(dtype=...)` keeps in fp32: the
    modules named by a `_keep_in_fp32_modules` (transformers, diffusers) and the
    non-persistent floating buffers the model computed (RoPE `inv_freq`)."""
    if dtype == torch.float32:
        return [], []
    keep = []
    for prefix, owner in model.named_modules():
        names = set(getattr(owner, "_keep_in_fp32_modules", None) or ())
        names |= set(getattr(owner, "_keep_in_fp32_modules_strict", None) or ())
        if not names:
            continue
        for name, sub in owner.named_modules(prefix=prefix):
            if sub is not owner and names & set(name.split(".")) and any(
                    p.is_floating_point() and p.dtype != dtype for p in sub.parameters(recurse=False)):
                keep.append(name)
    buffers = [f"{n}.{attr}" if n else attr for n, mod in model.named_modules()
               for attr, b in mod._buffers.items()
               if b is not None and attr in mod._non_persistent_buffers_set and b.is_floating_point()
               and b.dtype == torch.float32]
    return keep, buffers


def _warn_unlike_from_pretrained(model: nn.Module, dtype: torch.dtype) -> None:
    keep, buffers = _unlike_from_pretrained(model, dtype)
    if not keep and not buffers:
        return

    def listed(items):
        return ", ".join(items[:8]) + (f" (and {len(items) - 8} more)" if len(items) > 8 else "")

    what = []
    if keep:
        what.append(f"the {len(keep)} module(s) of _keep_in_fp32_modules ({listed(keep)})")
    if buffers:
        what.append(f"the fp32 buffers the model computes ({listed(buffers)})")
    log.warning(
        "layerwise: load_offloaded(dtype=%s) casts like model.to(%s), so the model differs from "
        "from_pretrained(dtype=%s), which keeps %s in fp32; outputs will differ. To match from_pretrained, build "
        "the model in that dtype (transformers: from_config(config, dtype=%s)) from a checkpoint stored in it, and "
        "leave dtype= out (README, 'Loading a checkpoint')", dtype, dtype, dtype, " and ".join(what), dtype)


def _parameter_entries(model: nn.Module):
    """[(module, attr, parameter)] for every registration of a parameter."""
    return [(mod, attr, p) for mod in model.modules(remove_duplicate=False)
            for attr, p in mod._parameters.items() if p is not None]


# ------------------------------------------------------------ load_offloaded
def load_offloaded(model: nn.Module, checkpoint, layer_names, device=None, prefetch_depth: int = 1,
                   resident_layers=0, residency_policy: str = "leading", pin_memory: bool | str = "auto",
                   device_budget=None, budget_margin=None, strict: bool = True, dtype: torch.dtype | None = None,
                   host_budget=None, spill_dir=None, disk_prefetch_depth: int | None = None, **kwargs):
    """Load `checkpoint` (a .safetensors file, a list of them, or an index JSON)
    into `model` (built on the meta device) and stream `layer_names` to `device`.
    Returns the managers, as configure_layerwise_offload does.

    Weights the model declares tied are tied first (one checkpoint name fills them
    all); non-persistent buffers left on meta are recomputed from the config of the
    module that owns them. `dtype` (a floating-point dtype) casts every floating-point
    parameter and buffer to it while reading, as `model.to(dtype)` would; without it
    the checkpoint's dtypes must be the model's.

    `host_budget` (bytes, or "auto") caps the host memory the weights take: the
    layers that do not fit stay in the checkpoint files and stream disk ->
    pinned staging -> device at every step (layerwise/stages/disk.py). Such
    layers are read-only (load_state_dict into them is refused) unless
    `spill_dir` is given: they are then copied into spill files of their own,
    which is also how layers stored in another dtype (`dtype=`) or strided
    parameters reach the disk tier.
    `compress`, `num_copy_streams`, `debug_copy_delay_us`: as in configure_layerwise_offload.
    `split_fetch=<ProcessGroup>`: every rank of the group loads the same model
    this way and reads only its share of each streamed layer from the files
    (contiguous parameters; a strided one is read whole), so the node reads and
    holds the streamed layers about once (layerwise/stages/gather.py).
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype (torch.bfloat16, torch.float16, "
                        f"torch.float32, ...), got {dtype!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True (a checkpoint tensor the model does not have is an error) or False "
                        f"(such tensors are ignored), got {strict!r}")
    files = _checkpoint_files(checkpoint)
    stored: dict[str, _Stored] = {}
    for path in files:
        for key, s in _read_header(path).items():
            if key in stored:
                raise ValueError(f"checkpoint: tensor {key!r} is in both {stored[key].path} and {path}")
            stored[key] = s

    num_copy_streams = kwargs.pop("num_copy_streams", 1)
    debug_copy_delay_us = kwargs.pop("debug_copy_delay_us", None)
    debug_read_delay_us = kwargs.pop("debug_read_delay_us", None)
    compress = validate_compress(kwargs.pop("compress", None))
    split_fetch = kwargs.pop("split_fetch", None)  # a ProcessGroup: each rank reads only its shares
    if kwargs:
        raise TypeError(f"load_offloaded: unexpected arguments {sorted(kwargs)}")

    check_disk_options(host_budget, spill_dir, disk_prefetch_depth)
    def prepare():
        return _prepare(model, layer_names, device, prefetch_depth, resident_layers, residency_policy, pin_memory,
                        num_copy_streams, debug_copy_delay_us, compress, disk_prefetch_depth, debug_read_delay_us,
                        device_budget=device_budget, budget_margin=budget_margin)

    managers, dev = prepare()  # validates everything (a configured model, bad paths) before anything changes
    if dtype is not None:
        _warn_unlike_from_pretrained(model, dtype)
    # Ties and dtype change which parameter objects the model holds (and so the
    # plan): done now, put back if anything later fails.
    registered = _parameter_entries(model)
    try:
        changed = _tie_declared(model)
        if dtype is not None:
            changed = _retype(model, dtype) or changed
        if changed:
            managers, dev = prepare()
        return _load(model, managers, dev, files, stored, strict, dtype, device_budget, budget_margin,
                     residency_policy, resident_layers, (host_budget, spill_dir, disk_prefetch_depth),
                     split_fetch)
    except BaseException:
        if not contract.managers_of(model):  # (a Ctrl-C delivered once the model was whole keeps it)
            for mod, attr, p in registered:
                mod._parameters[attr] = p
        raise


def _load(model, managers, dev, files, stored, strict, dtype, device_budget, budget_margin, residency_policy,
          resident_layers, disk=(None, None, None), split_fetch=None):
    def want(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    # Every name of every parameter and buffer, and where it sits.
    param_names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            full = f"{mod_name}.{attr}" if mod_name else attr
            param_names.setdefault(id(p), []).append(full)
            params[id(p)] = p
            places.setdefault(id(p), [])
            if (mod, attr) not in places[id(p)]:
                places[id(p)].append((mod, attr))
    buffers = []  # (module, attr, full name, persistent)
    for mod_name, mod in model.named_modules():
        for attr, b in mod._buffers.items():
            if b is not None:
                full = f"{mod_name}.{attr}" if mod_name else attr
                buffers.append((mod, attr, full, attr not in mod._non_persistent_buffers_set))

    def source_key(names):
        return next((n for n in names if n in stored), None)

    # ---- check everything before anything changes
    missing = [names[0] for pid, names in param_names.items() if source_key(names) is None]
    missing += [full for _, _, full, persistent in buffers if persistent and full not in stored]
    # A non-persistent buffer is not part of a state dict (torch's load_state_dict calls it
    # unexpected): its value is computed by the model, never taken from a checkpoint.
    known = {n for names in param_names.values() for n in names} | {full for _, _, full, p in buffers if p}
    unexpected = sorted(k for k in stored if k not in known)
    if missing or (strict and unexpected):
        problems = ([_names(missing, "missing")] if missing else []) + \
                   ([_names(unexpected, "unexpected")] if strict and unexpected else [])
        hint = " (strict=False ignores unexpected tensors)" if strict and unexpected and not missing else ""
        raise KeyError(f"checkpoint does not match the model: {'; '.join(problems)}{hint}")

    def check(name, s: _Stored, shape, expected: torch.dtype):
        if not isinstance(s.dtype, torch.dtype):
            raise TypeError(f"checkpoint tensor {name!r} has dtype {s.dtype}, which layerwise cannot read")
        castable = dtype is not None and expected.is_floating_point and s.dtype.is_floating_point
        if tuple(shape) != s.shape or (expected != s.dtype and not castable):
            hint = ""
            if tuple(shape) == s.shape and expected.is_floating_point and s.dtype.is_floating_point:
                hint = (f": pass dtype={expected} to load_offloaded to cast it while reading (or "
                        f"dtype={s.dtype} to run the model in the checkpoint's dtype)")
            raise ValueError(f"checkpoint tensor {name!r} is {s.dtype}{list(s.shape)} but the model expects "
                             f"{expected}{list(shape)}{hint}")
        if s.nbytes != s.dtype.itemsize * int(torch.Size(s.shape).numel()):
            raise ValueError(f"checkpoint tensor {name!r}: {s.nbytes} bytes stored for shape {list(s.shape)}")

    for pid, names in param_names.items():
        key = source_key(names)
        check(key, stored[key], params[pid].shape, params[pid].dtype)
        present = [n for n in names if n in stored]
        if len(present) > 1:  # one tensor under two names (tied): the checkpoint must agree with itself
            _same_values(stored, present)

    meta_buffers = {}
    for mod, attr, full, persistent in buffers:
        b = mod._buffers[attr]
        if persistent and full in stored:
            check(full, stored[full], b.shape, want(b))
        elif b.is_meta:
            meta_buffers[full] = b
    recomputed = {}
    if meta_buffers:
        recomputed, why = _recompute_buffers(model, meta_buffers)
        if why:
            full, reason = next(iter(why.items()))
            others = [n for n in why if n != full]
            raise ValueError(
                f"buffer {full!r} is on the meta device and not in the checkpoint, and layerwise cannot recompute "
                f"it ({reason})" + (f"; so are {', '.join(others[:8])}" if others else "") + ". Build the model "
                f"with its buffers computed and only its parameters on meta: `model = layerwise.empty_model("
                f"{type(model).__name__}, ...)` (or under accelerate.init_empty_weights()), not under "
                "`torch.device('meta')`")
        log.info("layerwise: recomputed %d buffer(s) the checkpoint does not hold: %s", len(recomputed),
                 ", ".join(f"{n} (from {what})" for n, (_, what) in recomputed.items()))

    if device_budget is not None:
        from .budget import apply_device_budget

        apply_device_budget(model, managers, dev, device_budget, budget_margin, residency_policy,
                            resident_layers)
    managed = {id(e.param): e for m in managers for lp in m.plan.layers for e in lp.params}
    entry_key = {id(e): source_key(param_names[pid]) for pid, e in managed.items()}
    host_budget, spill_dir, disk_prefetch_depth = disk
    if host_budget is not None:
        _plan_disk(model, managers, dev, stored, entry_key, host_budget, spill_dir, disk_prefetch_depth)
    attach_split_fetch(managers, split_fetch, dev, values=_sampled_values(stored, entry_key))
    share_of = _share_ranges(managers)  # split layers' parameters: read only this rank's bytes
    total = sum(s.nbytes for s in stored.values())
    bar = None
    if total >= 1 << 30:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="layerwise: loading")

    # ---- change the model (undone on failure)
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []

    def swap(pid, new: nn.Parameter):
        for mod, attr in places[pid]:
            swapped.append((mod, attr, mod._parameters[attr]))
            mod._parameters[attr] = new

    buffers_before = [(mod, attr, mod._buffers[attr]) for mod, attr, _, _ in buffers]

    replaced: list[tuple[nn.Parameter, torch.Tensor]] = []

    def undo():
        for p, old in reversed(replaced):
            p.data = old
        for mod, attr, old in reversed(swapped):
            mod._parameters[attr] = old
        for mod, attr, old in buffers_before:
            mod._buffers[attr] = old
        for pid, e in managed.items():
            e.param = params[pid]

    # A meta parameter cannot take host data (set_data refuses): packed ones get
    # a fresh Parameter object, in every module that shares it.
    for pid, e in managed.items():
        if e.param.is_meta:
            new = nn.Parameter(torch.empty((1,), dtype=e.dtype), requires_grad=e.param.requires_grad)
            swap(pid, new)
            e.param = new

    def fill(e, block):
        s = stored[entry_key[id(e)]]
        dst = e.view_in(block)
        if id(e) in share_of and dst.is_contiguous():
            _read_share(s, e, block, *share_of[id(e)])
        elif dst.is_contiguous() and s.dtype == e.dtype:
            _read_into(s, dst)
        else:  # strided, or cast while reading: copy_ rounds exactly as .to(dtype) does
            dst.copy_(_host_tensor(s).view(e.shape))
        if bar is not None:
            bar.update(s.nbytes)

    def place_non_layer():
        for pid, names in param_names.items():
            if pid in managed:
                continue
            p = params[pid]
            s = stored[source_key(names)]
            t = _host_tensor(s, p.dtype).to(dev)
            if p.is_meta:
                swap(pid, nn.Parameter(t, requires_grad=p.requires_grad))
            else:
                replaced.append((p, p.data))  # given back if the load fails later
                p.data = t
            if bar is not None:
                bar.update(s.nbytes)
        for mod, attr, full, persistent in buffers:
            b = mod._buffers[attr]
            if persistent and full in stored:
                mod._buffers[attr] = _host_tensor(stored[full], want(b)).to(dev)
            elif full in recomputed:
                mod._buffers[attr] = recomputed[full][0].to(want(b)).to(dev)
            elif want(b) != b.dtype:
                mod._buffers[attr] = b.to(want(b))

    fds = {path: os.open(path, os.O_RDONLY) for path in files}
    evict = _PageCacheDrop(fds.values(), _PageCacheDrop.every_for(managers)) if host_budget is not None else None
    for st in stored.values():
        st.fd = fds[st.path]
        st.evict = evict
    try:
        return _build(model, managers, dev, fill=fill, place_non_layer=place_non_layer, undo=undo)
    finally:
        try:
            if evict is not None:
                evict.close()
        finally:
            for fd in fds.values():
                os.close(fd)
        if bar is not None:
            bar.close()


def _streams_from_file(e, s: _Stored) -> str | None:
    """Why parameter entry `e` cannot be read from its checkpoint bytes as they are
    (None: it can)."""
    if s.dtype != e.dtype:
        return f"{e.qualname} is stored as {s.dtype} and used as {e.dtype}"
    if e.span_bytes != s.nbytes or tuple(e.stride) != torch.empty(e.shape, device="meta").stride():
        return f"{e.qualname} is strided"
    return None


def _plan_disk(model, managers, dev, stored, entry_key, host_budget, spill_dir, disk_prefetch_depth) -> None:
    """The disk tier of load_offloaded: layers over the host budget stay in the
    checkpoint files (or go to spill files with spill_dir)."""
    from .stages.disk import spill_store

    def why_not_disk(m, i):
        if spill_dir is not None:
            return None
        for e in m.plan.layers[i].params:
            why = _streams_from_file(e, stored[entry_key[id(e)]])
            if why:
                return why
        return None

    plan = plan_host_budget(model, managers, dev, host_budget, disk_prefetch_depth, why_not_disk=why_not_disk,
                            spill=spill_dir is not None,
                            cache_bytes=_PageCacheDrop.most(_PageCacheDrop.every_for(managers)))
    record_host_budget(managers, host_budget, plan["budget"])
    for m in managers:
        if m._disk_layers:
            m._disk_store = (spill_store(m, spill_dir) if spill_dir is not None
                             else _checkpoint_store(m, stored, entry_key))


def _same_layout(path: str, expected: dict):
    """A DiskFile's layout check: the reopened checkpoint must hold the tensors it
    held, at the same places."""
    def check(of):
        now = _read_header(path)
        for key, s in expected.items():
            t = now.get(key)
            if t is None or (t.start, t.nbytes, t.dtype, t.shape) != (s.start, s.nbytes, s.dtype, s.shape):
                raise ValueError(f"layerwise: {path} is not the checkpoint the model was loaded from: tensor {key!r} "
                                 "is gone or moved. Restore the file, or load the model again.")
    return check


def _checkpoint_store(manager, stored: dict, entry_key: dict):
    """The manager's `_store` for layers that stay in the checkpoint: a DiskSource
    that reads each file's tensors of the layer with one vectored read per run."""
    from .stages.disk import DiskFile, DiskSource, crc_of
    from .stages.read import staging_layout

    files: dict = {}  # this manager's own descriptors (a reader caches per descriptor)

    def disk_file(path):
        if path not in files:
            expected = {k: s for k, s in stored.items() if s.path == path}
            files[path] = DiskFile(path, check_layout=_same_layout(path, expected))
            manager._disk_files.append(files[path])
        return files[path]

    def store(lp, block):
        by_file: dict = {}
        for e in lp.params:
            s = stored[entry_key[id(e)]]
            if s.nbytes:
                by_file.setdefault(s.path, []).append((s.start, s.nbytes, e.offset))
        parts, copies, base = [], [], 0
        for path, items in by_file.items():
            extents, size = staging_layout([(a, n) for a, n, _ in items], base)
            parts.append((disk_file(path), extents))
            copies += [(d, poff, n) for (_, n, d), (_, _, poff) in zip(extents, items)]
            base += size
        merged = []
        for c in sorted(copies, key=lambda c: c[1]):
            if merged and merged[-1][0] + merged[-1][2] == c[0] and merged[-1][1] + merged[-1][2] == c[1]:
                merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + c[2])
            else:
                merged.append(c)
        return DiskSource(lp.index, lp.nbytes, parts, merged, crc_of(block),
                          what=f"layer {manager.layer_name}[{lp.index}]")

    return store


_SAMPLE = 4096  # bytes at each end of a tensor that every rank reads for the split-fetch values check


def _sampled_values(stored: dict, entry_key: dict):
    """split_fetch's values check (stages/gather.layer_values) for a load: every rank
    reads only its share of a split layer, so no rank can compare all of a layer's
    bytes with another's. What every rank compares instead, per split layer: each
    tensor's dtype, shape and size in the file and a CRC-32 of its first and last
    4 KiB (two small reads per tensor). Ranks that load checkpoints saved from
    different weights (other seeds, another fine-tune) are refused; a change that
    touches only the middle of a tensor is not seen (the same file on every rank is
    the caller's promise)."""
    import zlib

    def values(manager, lp):
        crc = 0
        fds = {}
        try:
            for e in lp.params:
                st = stored.get(entry_key.get(id(e)))
                if st is None:
                    return None
                crc = zlib.crc32(repr((str(st.dtype), tuple(st.shape), st.nbytes)).encode(), crc)
                fd = fds.get(st.path)
                if fd is None:
                    fd = fds[st.path] = os.open(st.path, os.O_RDONLY)
                head = min(_SAMPLE, st.nbytes)
                crc = zlib.crc32(os.pread(fd, head, st.start), crc)
                crc = zlib.crc32(os.pread(fd, head, st.start + st.nbytes - head), crc)
        finally:
            for fd in fds.values():
                os.close(fd)
        return crc

    return values


def _share_ranges(managers) -> dict:
    """id(param entry) -> (lo, hi): the bytes of its layer block this rank keeps (split fetch)."""
    out = {}
    for m in managers:
        split = getattr(m, "_split", None)
        if split is None:
            continue
        for i, (_, lo, hi) in split.spans.items():
            for e in m.plan.layers[i].params:
                out[id(e)] = (lo, hi)
    return out


def _read_share(stored: _Stored, e, block: torch.Tensor, lo: int, hi: int) -> None:
    """Write into `block` the bytes of the contiguous parameter `e` that fall in
    [lo, hi) (this rank's share), reading only the elements that cover them (cast
    to e.dtype exactly as .to(dtype) does where the dtypes differ). Bytes outside
    [lo, hi) are left as they are: the share store keeps [lo, hi) only."""
    a, b = max(lo, e.offset), min(hi, e.offset + e.span_bytes)
    if a >= b:
        return
    isz = e.dtype.itemsize
    first, last = (a - e.offset) // isz, -(-(b - e.offset) // isz)  # elements covering [a, b)
    src = torch.empty(last - first, dtype=stored.dtype)
    _pread_exact(stored, _bytes_of(src), stored.start + first * stored.dtype.itemsize)
    out = src if stored.dtype == e.dtype else src.to(e.dtype)
    at = e.offset + first * isz
    block[at : at + out.numel() * isz].copy_(out.view(torch.uint8))


def _same_values(stored: dict[str, _Stored], names: list[str]) -> None:
    """The checkpoint tensors `names`, which all fill one (tied) parameter, must be equal."""
    def read(s: _Stored) -> torch.Tensor:
        fd = os.open(s.path, os.O_RDONLY)
        try:
            return _host_tensor(dataclasses.replace(s, fd=fd)).reshape(-1).view(torch.uint8)
        finally:
            os.close(fd)

    first = stored[names[0]]
    ref = read(first)
    for name in names[1:]:
        s = stored[name]
        if s.dtype != first.dtype or s.shape != first.shape or not torch.equal(read(s), ref):
            raise ValueError(
                f"checkpoint tensors {names[0]!r} and {name!r} differ, but the model ties them (one parameter "
                "under both names): build the model untied (for transformers: tie_word_embeddings=False in its "
                "config), or save the checkpoint from the tied model")
