"""Plan: which parameters belong to which layer of a group, and where each one
lives inside its layer's flat, dtype-grouped host block.

A layer's block is one contiguous byte range: one segment per dtype, each
parameter at an offset aligned to PARAM_ALIGN bytes. A parameter is stored as
the span of its storage that it covers (for a contiguous tensor: its elements;
for a transposed or permuted one: the same elements in storage order), so
that on the device it is rebuilt as a strided *view* of the received block:
strides survive and no gather or scatter is needed.

A quantized wrapper parameter (torchao, optimum-quanto: layerwise/formats/quantized.py)
is planned as its plain inner tensors: one entry per leaf, each placed in its
dtype's segment like a plain parameter, so that layout, codec segments, byte
counts and the alias check all see the bytes that are stored, never the
wrapper's outer dtype and shape. The entries of one wrapper share a `Wrapped`
record (the parameter, its form), through which they are bound together.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from layerwise.formats import quantized

log = logging.getLogger("layerwise")

PARAM_ALIGN = 256  # >= 64, so CPU kernels see the alignment torch's allocator gives
BLOCK_ALIGN = 4096  # layer blocks start on a page: each one is pinned as a unit


def round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def storage_span(t: torch.Tensor) -> int:
    """Number of storage elements a strided tensor covers, from its first element."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


@dataclass(eq=False)
class Wrapped:
    """A quantized wrapper parameter: its form (formats/quantized.Structure) and
    the entries of its leaves, in flatten order."""

    qualname: str
    param: torch.Tensor
    form: quantized.Structure
    entries: list = field(default_factory=list, repr=False)

    @property
    def library_type(self) -> str:
        return quantized.library_type(self.param)


@dataclass
class ParamEntry:
    qualname: str
    param: nn.Parameter
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    span: int  # storage elements covered
    offset: int = 0  # byte offset inside the layer block
    orig_device: torch.device | None = None
    dspec: tuple | None = None  # DTensor: (device mesh, placements, global shape, global stride)
    packed: bool = False  # its bytes are in the arena (what a rollback restores)
    saved: torch.Tensor | None = None  # data it had before a checkpoint load, until configure succeeds
    leaf: tuple | None = None  # a quantized wrapper's inner tensor: its attribute path (formats/quantized.py)
    wrapped: Wrapped | None = field(default=None, repr=False)  # (with `leaf`) the wrapper parameter it is a leaf of
    owner: nn.Module | None = field(default=None, repr=False)  # the module that holds it (formats/aliases.py)

    @property
    def span_bytes(self) -> int:
        return self.span * self.dtype.itemsize

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def source(self) -> torch.Tensor:
        """The plain tensor whose bytes this entry covers, as the parameter holds it now
        (a DTensor's local shard, a wrapper's leaf)."""
        if self.leaf is not None:
            return quantized.leaf(self.param, self.leaf)
        return local_tensor(self.param.data)

    def view_in(self, block: torch.Tensor) -> torch.Tensor:
        """This parameter (its local shard, for a DTensor) as a strided view of a
        uint8 layer block (host or device)."""
        flat = block[self.offset : self.offset + self.span_bytes].view(self.dtype)
        return torch.as_strided(flat, self.shape, self.stride)

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """What the parameter's .data becomes: `local` itself, or for a
        tensor-parallel parameter a DTensor over it with the original placement."""
        if self.dspec is None:
            return local
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = self.dspec
        if local.numel() == 1 and tuple(local.shape) != self.shape:  # a placeholder
            return DTensor.from_local(local.view((1,) * len(self.shape)), mesh, placements, run_check=False)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


@dataclass
class LayerPlan:
    index: int
    module: nn.Module
    params: list[ParamEntry] = field(default_factory=list)
    nbytes: int = 0
    segments: dict = field(default_factory=dict)  # dtype -> (byte offset, byte length)
    base_bytes: int = 0  # bytes before the tail (layout(tail=...)); nbytes without one

    def layout(self, tail=frozenset()) -> None:
        """Assign aligned offsets: one segment per dtype, dtypes in a fixed order.
        `tail`: ids of entries placed after all the others (routed experts,
        layerwise/planning/experts.py), so that the rest of the layer is one prefix of
        `base_bytes`; `segments` then describes that prefix only (compress
        encodes the tail per expert: layerwise/experts.ExpertPlan.segments)."""
        self.params.sort(key=lambda e: (id(e) in tail, str(e.dtype)))  # stable: declaration order inside a dtype
        offset = 0
        self.segments = {}
        base: int | None = None  # where the tail starts (None: no tail entry yet)
        for e in self.params:
            offset = round_up(offset, PARAM_ALIGN)
            if id(e) in tail:
                if base is None:
                    base = offset
                e.offset = offset
                offset += e.span_bytes
                continue
            start = self.segments.get(e.dtype, (offset, 0))[0]
            e.offset = offset
            offset += e.span_bytes
            self.segments[e.dtype] = (start, offset - start)
        self.nbytes = offset
        self.base_bytes = offset if base is None else base


@dataclass
class GroupPlan:
    path: str
    module_list: nn.Module
    num_layers: int
    layers: list[LayerPlan]
    shared: list[str]  # parameters of the group that stay resident (tied to another layer or module)

    @property
    def managed_bytes(self) -> int:
        return sum(e.numel * e.dtype.itemsize for lp in self.layers for e in lp.params)

    def bytes_per_dtype(self) -> dict:
        out: dict = {}
        for lp in self.layers:
            for e in lp.params:
                out[e.dtype] = out.get(e.dtype, 0) + e.span_bytes
        return out


def resolve_group(model: nn.Module, path: str) -> nn.ModuleList | nn.Sequential:
    """The nn.ModuleList / nn.Sequential at dotted `path`, or a clear error."""
    if not isinstance(path, str) or not path or path.startswith(".") or path.endswith("."):
        raise ValueError(f"layer group path must be a dotted attribute path like 'transformer_blocks', got {path!r}")
    try:
        module = model.get_submodule(path)
    except AttributeError as e:
        raise ValueError(f"layer group {path!r} does not exist in {type(model).__name__}: {e}"
                         f"{_did_you_mean(model, path)}") from None
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        raise TypeError(
            f"layer group {path!r} is a {type(module).__name__}, not an nn.ModuleList or nn.Sequential of blocks"
            f"{_did_you_mean(model, path)}"
        )
    return module


def _did_you_mean(model: nn.Module, path: str) -> str:
    """'; did you mean ...?' over the model's block lists (the paths of its
    nn.ModuleList / nn.Sequential modules): those ending in `path`, then the closest
    by difflib; the first few lists if none is close; '' if it has none."""
    import difflib

    lists = [name for name, m in model.named_modules() if name and isinstance(m, (nn.ModuleList, nn.Sequential))
             and not any(part.isdigit() for part in name.split("."))]  # not the lists inside each block
    if not lists:
        return ""
    tail = path.rpartition(".")[2]
    close = [n for n in lists if n.endswith("." + path) or n.rpartition(".")[2] == tail]
    close += [n for n in difflib.get_close_matches(path, lists, n=3, cutoff=0.6) if n not in close]
    if close:
        return "; did you mean " + " or ".join(f"{n!r}" for n in close[:3]) + "?"
    more = f" (and {len(lists) - 5} more)" if len(lists) > 5 else ""
    return f"; its block lists are {', '.join(repr(n) for n in lists[:5])}{more}"


def build_group_plan(model: nn.Module, path: str, num_layers: int | None = None) -> GroupPlan:
    module_list = resolve_group(model, path)
    n = len(module_list) if num_layers is None else num_layers
    if not isinstance(n, int) or n < 0 or n > len(module_list):
        raise ValueError(f"num_layers for {path!r} must be an int in [0, {len(module_list)}], got {num_layers!r}")

    pattern = re.compile(r"^" + re.escape(path) + r"\.(\d+)(\.|$)")
    # Every name under which each parameter object appears (tied weights appear twice).
    names: dict[int, list[str]] = {}
    objects: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        objects[id(p)] = p

    layers = [LayerPlan(i, module_list[i]) for i in range(n)]
    owners = {id(p): mod for lp in layers for mod in lp.module.modules() for p in mod._parameters.values()
              if p is not None}
    shared: list[str] = []
    # Parameters whose bytes overlap (b = a[2:6]) would come apart once each is packed on
    # its own: they stay resident, like tied ones. (Parameters that merely share a storage
    # without overlapping, as tensors sliced out of one checkpoint mmap do, are packed.)
    # A quantized wrapper has no storage of its own: its leaves' storages count.
    by_storage: dict = {}
    for pid, p in objects.items():
        for t in _storage_tensors(p):
            if t.device.type != "meta" and t.numel():
                start = t.storage_offset() * t.element_size()
                by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(
                    (start, start + storage_span(t) * t.element_size(), pid))
    aliased: set[int] = set()
    for spans in by_storage.values():
        spans.sort()
        for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
            if b0 < a1:
                aliased.update((a, b))
    for pid, pnames in names.items():
        indices = set()
        for nm in pnames:
            m = pattern.match(nm)
            indices.add(int(m.group(1)) if m else None)
        owned = [i for i in indices if i is not None and i < n]
        if not owned:
            continue
        if len(indices) > 1 or pid in aliased:  # tied, or a view of another parameter's storage
            shared.extend(nm for nm in pnames if pattern.match(nm))
            continue
        p = objects[pid]
        if quantized.is_wrapper(p):
            layers[owned[0]].params.extend(_leaf_entries(pnames[0], p, owners.get(pid)))
            continue
        d = p.data
        t = local_tensor(d)
        if quantized.is_wrapper(t):
            raise ValueError(
                f"parameter {pnames[0]!r} is a DTensor of a {quantized.library_type(t)} (a tensor-parallel quantized "
                "weight): layerwise does not stream those yet. Keep that module out of the streamed groups (or "
                "quantize after sharding with plain local shards). The model is unchanged."
            )
        dspec = None
        if t is not d:
            # `d` is a DTensor here (local_tensor unwrapped it); torch's Tensor stub lacks its attributes
            dspec = (d.device_mesh, tuple(d.placements), tuple(d.shape), tuple(d.stride()))  # type: ignore[attr-defined]
        layers[owned[0]].params.append(
            ParamEntry(pnames[0], p, t.dtype, tuple(t.shape), tuple(t.stride()), storage_span(t), orig_device=t.device,
                       dspec=dspec, owner=owners.get(pid))
        )
    for lp in layers:
        lp.layout()
    if shared:
        log.info("layerwise: %s: %d tied parameter name(s) stay resident: %s", path, len(shared), ", ".join(shared))
    return GroupPlan(path, module_list, n, layers, shared)


def _storage_tensors(p) -> list[torch.Tensor]:
    """The plain tensors whose storages a parameter's bytes live in."""
    if quantized.is_wrapper(p):
        return list(quantized.leaf_tensors(p).values())
    t = local_tensor(p.data)
    return list(quantized.leaf_tensors(t).values()) if quantized.is_wrapper(t) else [t]


def param_bytes(p) -> int:
    """The bytes a parameter holds: numel x itemsize, or for a quantized wrapper its
    plain leaves' (never its outer dtype and shape)."""
    if not quantized.is_wrapper(p):
        return p.numel() * p.element_size()
    return sum(t.numel() * t.element_size() for t in _storage_tensors(p))


def _leaf_entries(name: str, p, owner=None) -> list[ParamEntry]:
    """One entry per plain inner tensor of a quantized wrapper parameter."""
    form = quantized.structure(p)
    quantized.check_rebindable(name, p, form)
    wrapped = Wrapped(name, p, form)
    for leaf in form.leaves():
        t = quantized.leaf(p, leaf.path)
        wrapped.entries.append(ParamEntry(name, p, t.dtype, tuple(t.shape), tuple(t.stride()), storage_span(t),
                                          orig_device=t.device, leaf=leaf.path, wrapped=wrapped, owner=owner))
    return wrapped.entries


def assign_slots(num_streamed: int, depth: int) -> tuple[list[int], int]:
    """Slot of each streamed layer (in cycle order) and the number of slots.

    Any d+1 cyclically consecutive layers (the one computing and the d being
    prefetched) must sit in distinct slots, so that a layer's slot is fixed and
    its parameters stay bound to views of it (hooks then cost O(1) whatever the
    parameter count). That is a colouring of the cycle's d-th power: d+1 slots
    when d+1 divides the cycle, else ceil(n / floor(n / (d+1))), at most 2d+1.
    """
    n = num_streamed
    if n == 0:
        return [], 0
    window = depth + 1
    if n <= window:
        return list(range(n)), n
    q = n // window  # blocks of size window..2*window-1, each coloured 0..size-1
    sizes = [n // q + (1 if b < n % q else 0) for b in range(q)]
    slots = [c for size in sizes for c in range(size)]
    return slots, max(sizes)


def device_bytes(plan: GroupPlan, resident, depth: int) -> int:
    """Device bytes of a group's slot ring + resident layers for a residency plan."""
    resident = set(resident)
    streamed = [lp.nbytes for lp in plan.layers if lp.index not in resident]
    _, slots = assign_slots(len(streamed), depth)
    return slots * max(streamed, default=0) + sum(plan.layers[i].nbytes for i in resident)
