"""Parameter subclasses over plain data (bitsandbytes `Int8Params` / `Params4bit`,
diffusers `GGUFParameter`): what a library keeps beside the parameter's data.

Such a parameter is planned like a plain one (its data is an ordinary tensor)
and keeps its attributes. Two kinds of tensors hang off it or off the module
that owns it, found by looking, never by naming a library:

- aliases: tensors that are views of the parameter's data (bitsandbytes keeps
  `Int8Params.CB`, then `Linear8bitLt.state.CB`, and computes from those, not
  from `weight`). At packing each alias is made to reference the parameter
  object itself, so that every rebinding of the parameter (placeholder, slot
  view, the tensor given back on removal) moves the alias with it and the
  library computes from the slot; on removal they become the parameter's data
  again.
- side tensors: everything else a tensor attribute holds (a `quant_state`'s
  absmax / code / offset, an int8 row scale `SCB`). They stay resident; the
  group's stats() and report() count them (`side_tensor_bytes`).

Where a library rebinds the parameter's data itself, layerwise/contract/rebinds.py catches it.
"""
from __future__ import annotations

import torch
from torch import nn

_DEPTH = 3  # attribute objects walked below a parameter or its module (quant_state.state2.absmax)


def library_of(obj) -> str:
    """The top-level package a module or tensor class comes from ('bitsandbytes')."""
    return type(obj).__module__.partition(".")[0]


def _objects(param, owner, depth: int = _DEPTH):
    """(holder, attribute name, value) for the attributes of `param`, of the plain
    objects below it, and of the plain (non-module, non-tensor) objects `owner`
    holds, to `depth` levels; each holder once."""
    seen = {id(param), id(owner)}
    todo = [(param, depth)]
    if owner is not None:
        todo += [(v, depth - 1) for v in vars(owner).values() if _plain_object(v)]
    while todo:
        obj, d = todo.pop()
        if id(obj) in seen and obj is not param:
            continue
        seen.add(id(obj))
        for name, value in list(vars(obj).items()):
            yield obj, name, value
            if d > 1 and _plain_object(value) and id(value) not in seen:
                todo.append((value, d - 1))


def _plain_object(v) -> bool:
    return (hasattr(v, "__dict__") and not isinstance(v, (torch.Tensor, nn.Module, type))
            and not callable(v))


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()
            and a.numel() > 0 and a.device.type != "meta" and a.data_ptr() == b.data_ptr())


def follow(param: nn.Parameter, owner, data: torch.Tensor | None = None) -> int:
    """Make every alias of `data` (default: the parameter's own data) reference the
    parameter object, so that it follows the parameter's rebindings; the count."""
    data = param.data if data is None else data
    n = 0
    for holder, name, value in _objects(param, owner):
        if isinstance(value, torch.Tensor) and value is not param and _same_view(value, data):
            setattr(holder, name, param)
            n += 1
    return n


def release(param: nn.Parameter, owner) -> None:
    """Aliases that reference the parameter object become its data again (removal)."""
    for holder, name, value in _objects(param, owner):
        if value is param:
            setattr(holder, name, param.data)


def side_tensors(param, owner) -> list[torch.Tensor]:
    """The resident tensors held beside the parameter (not its data, not an alias)."""
    out, seen = [], set()
    for _, _, value in _objects(param, owner):
        if isinstance(value, torch.Tensor) and value is not param and not isinstance(value, nn.Parameter):
            key = (value.device, value.data_ptr() if value.numel() else id(value))
            if key not in seen:
                seen.add(key)
                out.append(value)
    return out


def side_bytes(entries) -> int:
    """Bytes of the side tensors of the planned parameters `entries` (each once)."""
    seen, total = set(), 0
    for e in entries:
        if e.leaf is not None or type(e.param) is nn.Parameter:
            continue  # a quantized wrapper's tensors are its leaves; a plain parameter holds nothing beside
        for t in side_tensors(e.param, e.owner):
            key = (t.device, t.data_ptr())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total
