"""load_offloaded: build an offloaded model straight from .safetensors files.

The model is built without weights (on the meta device, e.g. with
accelerate.init_empty_weights or `with torch.device("meta"):`). Layer tensors
are read from the files straight into their place in the host arena (plain
positioned reads into the arena's pages: no intermediate host copy and no
file mapping that would count against the process), non-layer tensors go
straight to the device, and the multi-group order of configure holds: every
group packed, largest first, then one model.to, then finalisation.

Everything (keys, shapes, dtypes, buffers the checkpoint cannot supply) is
checked before the model changes; a failure half way puts it back.
"""
from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import dataclass

import torch
from torch import nn

from .configure import _build, _prepare

log = logging.getLogger("layerwise")

# https://github.com/huggingface/safetensors#format: dtype names of the header.
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


@dataclass
class _Stored:
    path: str
    start: int  # absolute byte offset in the file
    nbytes: int
    dtype: torch.dtype | str
    shape: tuple
    fd: int = -1  # the file, open for the duration of a load


def _read_header(path: str) -> dict[str, _Stored]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > os.path.getsize(path):
            raise ValueError(f"{path}: not a safetensors file (header length {n} is past the end of the file)")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a safetensors file (bad header: {e})") from None
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[key] = _Stored(path, 8 + n + begin, end - begin, _DTYPES.get(info["dtype"], info["dtype"]),
                           tuple(info["shape"]))
    return out


def _checkpoint_files(checkpoint) -> list[str]:
    if isinstance(checkpoint, (str, os.PathLike)):
        path = os.fspath(checkpoint)
        if path.endswith(".json"):
            with open(path) as f:
                index = json.load(f)
            if "weight_map" not in index:
                raise ValueError(f"{path}: an index JSON needs a 'weight_map'")
            base = os.path.dirname(path)
            return sorted({os.path.join(base, v) for v in index["weight_map"].values()})
        return [path]
    files = [os.fspath(c) for c in checkpoint]
    if not files:
        raise ValueError("checkpoint: no files given")
    return files


def _read_into(stored: _Stored, out: torch.Tensor) -> None:
    """Read a stored tensor's bytes into the contiguous tensor `out` (host), with
    positioned reads on the file's open descriptor."""
    view = memoryview(out.view(torch.uint8).numpy()).cast("B")
    got = 0
    while got < stored.nbytes:
        n = os.preadv(stored.fd, [view[got:]], stored.start + got)
        if not n:
            raise ValueError(f"{stored.path}: file ends inside a tensor ({got} of {stored.nbytes} bytes read)")
        got += n


def _host_tensor(stored: _Stored) -> torch.Tensor:
    t = torch.empty(stored.shape, dtype=stored.dtype)  # torch's allocator: 64-byte aligned
    _read_into(stored, t)
    return t


def load_offloaded(model: nn.Module, checkpoint, layer_names, device=None, prefetch_depth: int = 1,
                   resident_layers=0, residency_policy: str = "leading", pin_memory: bool = True,
                   device_budget=None, budget_margin=None, strict: bool = True, **kwargs):
    """Load `checkpoint` (a .safetensors file, a list of them, or an index JSON)
    into `model` (built on the meta device) and stream `layer_names` to `device`.
    Returns the managers, as configure_layerwise_offload does."""
    files = _checkpoint_files(checkpoint)
    stored: dict[str, _Stored] = {}
    for path in files:
        for key, s in _read_header(path).items():
            if key in stored:
                raise ValueError(f"checkpoint: tensor {key!r} is in both {stored[key].path} and {path}")
            stored[key] = s

    managers, dev = _prepare(model, layer_names, device, prefetch_depth, resident_layers, residency_policy,
                             pin_memory, kwargs.pop("num_copy_streams", 1), kwargs.pop("debug_copy_delay_us", None))
    if kwargs:
        raise TypeError(f"load_offloaded: unexpected arguments {sorted(kwargs)}")

    # Every name of every parameter and persistent buffer, and where it sits.
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
    known = {n for names in param_names.values() for n in names} | {full for _, _, full, _ in buffers}
    unexpected = sorted(k for k in stored if k not in known)
    if missing or (strict and unexpected):
        raise KeyError(
            "checkpoint does not match the model: "
            + (f"missing {len(missing)} tensor(s): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; "
               if missing else "")
            + (f"unexpected {len(unexpected)} tensor(s): {', '.join(unexpected[:8])}"
               f"{' ...' if len(unexpected) > 8 else ''}" if strict and unexpected else "")
        )

    def check(name, s: _Stored, shape, dtype):
        if not isinstance(s.dtype, torch.dtype):
            raise TypeError(f"checkpoint tensor {name!r} has dtype {s.dtype}, which layerwise cannot read")
        if tuple(shape) != s.shape or dtype != s.dtype:
            raise ValueError(f"checkpoint tensor {name!r} is {s.dtype}{list(s.shape)} but the model expects "
                             f"{dtype}{list(shape)}")
        if s.nbytes != s.dtype.itemsize * int(torch.Size(s.shape).numel()):
            raise ValueError(f"checkpoint tensor {name!r}: {s.nbytes} bytes stored for shape {list(s.shape)}")

    for pid, names in param_names.items():
        key = source_key(names)
        check(key, stored[key], params[pid].shape, params[pid].dtype)
    for mod, attr, full, persistent in buffers:
        b = mod._buffers[attr]
        if full in stored:
            check(full, stored[full], b.shape, b.dtype)
        elif b.is_meta:
            raise ValueError(f"buffer {full!r} is on the meta device and not in the checkpoint: build the model "
                             "with its buffers on the host (e.g. accelerate.init_empty_weights(include_buffers=False))")

    if device_budget is not None:
        from .budget import apply_device_budget

        apply_device_budget(model, managers, dev, device_budget, budget_margin, residency_policy)

    managed = {id(e.param): e for m in managers for lp in m.plan.layers for e in lp.params}
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

    entry_key = {id(e): source_key(param_names[pid]) for pid, e in managed.items()}

    def fill(e, block):
        s = stored[entry_key[id(e)]]
        dst = e.view_in(block)
        if dst.is_contiguous():
            _read_into(s, dst)
        else:
            dst.copy_(_host_tensor(s).view(e.shape))
        if bar is not None:
            bar.update(s.nbytes)

    def place_non_layer():
        for pid, names in param_names.items():
            if pid in managed:
                continue
            s = stored[source_key(names)]
            t = _host_tensor(s).to(dev)
            p = params[pid]
            if p.is_meta:
                swap(pid, nn.Parameter(t, requires_grad=p.requires_grad))
            else:
                replaced.append((p, p.data))  # given back if the load fails later
                p.data = t
            if bar is not None:
                bar.update(s.nbytes)
        for mod, attr, full, _ in buffers:
            if full in stored:
                mod._buffers[attr] = _host_tensor(stored[full]).to(dev)

    fds = {path: os.open(path, os.O_RDONLY) for path in files}
    for st in stored.values():
        st.fd = fds[st.path]
    try:
        return _build(model, managers, dev, fill=fill, place_non_layer=place_non_layer, undo=undo)
    finally:
        for fd in fds.values():
            os.close(fd)
        if bar is not None:
            bar.close()
