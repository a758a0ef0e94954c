"""Routed experts: in a mixture-of-experts block only the experts the router
picked cross the bus (docs/moe.md).

Plan (`plan_experts`, before packing). In each layer of a group, an *expert
module* is a module whose forward takes the routing (an argument named like
transformers' `top_k_index` / `router_indices`) and whose parameters are
either all its own and expert-major: plain, contiguous, dim 0 = the number of
experts (the fused `gate_up_proj[E, 2I, H]`, `down_proj[E, H, I]`, their
biases; expert e is the contiguous slice e of dim 0), or all in one
nn.ModuleList with one module per expert (expert e is every plan entry of
module e: its parameters, or a quantized tensor's inner tensors). The layout
puts every expert entry after the rest of the layer
(plan.LayerPlan.layout(tail=...)), and the layer's ordinary fetch copies only
the prefix (stages/experts.ExpertSource). A module that
looks like one (it takes the routing) but whose parameters are not so is
streamed whole, with a WARNING naming why; one named in `expert_modules`
that cannot be placed is refused.

At run time the expert modules' pre-hooks (layerwise/runtime/expert_hooks.py) fetch
the experts the routing picked.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from layerwise.formats import quantized

log = logging.getLogger("layerwise")

# The names transformers 5.x gives the routing argument of an experts module's forward.
ROUTING_ARGS = ("top_k_index", "router_indices", "selected_experts", "expert_indices", "topk_idx", "topk_indices")


@dataclass(eq=False)
class ExpertModule:
    """One expert module of one layer: its expert parameters (plan entries) and
    where each expert's bytes lie in the layer's block (after layout).

    `parts[x]`: expert x's pieces, (entry, first element, end element) of a plan
    entry's storage span: the slice x of each fused expert-major parameter, or
    every entry of expert x's own submodule (a per-expert ModuleList, its
    quantized tensors' inner tensors included)."""

    layer: int
    name: str  # relative to the layer
    module: nn.Module
    num_experts: int
    entries: list
    routing: tuple  # (position in forward's arguments after self, keyword name)
    parts: list = field(default_factory=list)
    units: list = field(default_factory=list)  # per expert: [(byte offset in the block, bytes)], after place()

    def place(self) -> None:
        self.units = [sorted((e.offset + lo * e.dtype.itemsize, (hi - lo) * e.dtype.itemsize) for e, lo, hi in px)
                      for px in self.parts]

    @property
    def unit_bytes(self) -> int:
        """Bytes of one expert (the largest: its rows of every expert parameter)."""
        return max(sum(n for _, n in u) for u in self.units)

    def spans(self, experts) -> list[tuple[int, int]]:
        """[lo, hi) byte ranges of the block holding `experts` (sorted), adjacent ones merged."""
        out: list = []
        for lo, n in sorted(r for x in experts for r in self.units[x]):
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], lo + n)
            else:
                out.append((lo, lo + n))
        return out

    def routed(self, args, kwargs) -> torch.Tensor | None:
        pos, name = self.routing
        if name in kwargs:
            return kwargs[name]
        return args[pos] if pos < len(args) else None


@dataclass
class ExpertPlan:
    """A group's expert modules, per layer (layers without any: absent)."""

    group: str
    layers: dict  # layer index -> [ExpertModule]

    def modules(self):
        for mods in self.layers.values():
            yield from mods

    def segments(self, lp) -> tuple:
        """((dtype, offset, nbytes), ...) of layer `lp` in plan layout, for the codec
        (compress="lossless"): the prefix's dtype segments, then one segment per
        expert per expert parameter, so that each expert's rows decode on their own
        (stages/decode.CodecSource.copy_range). A layer without experts: its segments."""
        out = [(dt, off, n) for dt, (off, n) in sorted(lp.segments.items(), key=lambda kv: kv[1][0])]
        rows = sorted((e.offset + lo * e.dtype.itemsize, (hi - lo) * e.dtype.itemsize, str(e.dtype), e.dtype)
                      for m in self.layers.get(lp.index, ()) for px in m.parts for e, lo, hi in px)
        out.extend((dt, off, n) for off, n, _, dt in rows)
        return tuple(out)

    def range_chunk(self) -> int:
        """The largest rows of one expert in one expert parameter: what an on-demand
        read from a file (the disk tier) reads at a time."""
        return max((n for m in self.modules() for u in m.units for _, n in u), default=1)

    def range_runs(self) -> int:
        """The most file runs one such read touches: it may cross every expert
        tensor of a module (adjacent in the layout), one run each, and one more."""
        return max((len(m.entries) for m in self.modules()), default=1) + 1

    def expert_bytes(self, layers=None) -> int:
        keep = None if layers is None else set(layers)
        return sum(m.unit_bytes * m.num_experts for i, mods in self.layers.items() for m in mods
                   if keep is None or i in keep)


def routing_argument(module: nn.Module) -> tuple | None:
    """(position, name) of the routing argument of module.forward, or None."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
    params = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                                  p.KEYWORD_ONLY)]
    for pos, p in enumerate(params):
        if p.name in ROUTING_ARGS:
            return (pos if p.kind != p.KEYWORD_ONLY else 1 << 30, p.name)
    return None


def _list_experts(module: nn.Module, entries: dict) -> tuple[str | None, int, list, list]:
    """A module whose experts are the children of one nn.ModuleList it holds (all
    its parameters there, one child per expert): (why not or None, experts, its
    plan entries, per expert [(entry, 0, span)])."""
    lists = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
    experts = lists[0][1] if len(lists) == 1 else None
    if not isinstance(experts, nn.ModuleList):
        names = [n for n, _ in lists]
        return (f"its parameters are in submodules {names}, not in one nn.ModuleList of experts (fused "
                "expert-major parameters [num_experts, ...] of the module itself, or one ModuleList with a "
                "module per expert, are routed)"), 0, [], []
    cname = lists[0][0]
    n_exp = getattr(module, "num_experts", None)
    if isinstance(n_exp, int) and not isinstance(n_exp, bool) and n_exp != len(experts):
        return f"its num_experts={n_exp} differs from its {len(experts)} modules in {cname!r}", 0, [], []
    out, parts, seen = [], [], set()
    for x, child in enumerate(experts):
        px = []
        for n, p in child.named_parameters():
            es = entries.get(id(p))
            if not es or id(p) in seen:
                return (f"the parameter {cname}.{x}.{n} is tied to another module or expert, or not streamed"), \
                    0, [], []
            seen.add(id(p))
            if any(e.dspec is not None for e in es):
                return f"the parameter {cname}.{x}.{n} is a DTensor", 0, [], []
            out += es
            px += [(e, 0, e.span) for e in es]
        parts.append(px)
    return None, len(experts), out, parts


def _why_not(module: nn.Module, entries: dict, qual: str) -> tuple[str | None, int, list, list]:
    """(why the module cannot be routed or None, experts, its plan entries, each
    expert's parts: ExpertModule.parts). `entries`: id(parameter) -> its plan
    entries (a quantized wrapper: one per inner tensor)."""
    own = [(n, p) for n, p in module._parameters.items() if p is not None]
    if not own:
        why, n_exp, out, parts = _list_experts(module, entries)
        if why is None and n_exp < 2:
            why = f"it has {n_exp} expert(s)"
        return why, n_exp, out, parts
    for cname, child in module.named_children():
        if any(True for _ in child.parameters()):
            return (f"its submodule {cname!r} holds parameters besides its own (fused expert-major parameters "
                    "[num_experts, ...] of the module itself, or one ModuleList with a module per expert, are "
                    "routed)"), 0, [], []
    declared = getattr(module, "num_experts", None)
    if isinstance(declared, int) and not isinstance(declared, bool):
        n_exp = declared
    else:
        n_exp = own[0][1].shape[0] if own[0][1].dim() else 0
    out = []
    for n, p in own:
        es = entries.get(id(p))
        if not es:
            return f"its parameter {n!r} is tied to another module or not streamed", 0, [], []
        e = es[0]
        if e.leaf is not None or quantized.is_wrapper(p):
            return (f"its parameter {n!r} is a quantized tensor ({quantized.library_type(p)}): a fused quantized "
                    "tensor is not cut by expert"), 0, [], []
        if e.dspec is not None:
            return f"its parameter {n!r} is a DTensor", 0, [], []
        if len(e.shape) < 2 or e.shape[0] != n_exp:
            return f"its parameter {n!r} has shape {list(e.shape)}, not [num_experts={n_exp}, ...]", 0, [], []
        if e.span != e.numel or tuple(e.stride) != tuple(torch.empty(e.shape, device="meta").stride()):
            return f"its parameter {n!r} is not contiguous (strides {list(e.stride)})", 0, [], []
        out.append(e)
    if n_exp < 2:
        return f"it has {n_exp} expert(s)", 0, [], []
    parts = [[(e, x * (e.span // n_exp), (x + 1) * (e.span // n_exp)) for e in out] for x in range(n_exp)]
    return None, n_exp, out, parts


def _wanted(spec, name: str, module: nn.Module) -> bool:
    if callable(spec):
        return bool(spec(name, module))
    return name in spec


def plan_experts(plan, options) -> ExpertPlan | None:
    """The group's expert modules (module doc), its layers laid out expert-tail;
    None with experts="all" or where the group has none (said at WARNING)."""
    if options.experts != "routed":
        return None
    spec = options.expert_modules
    layers: dict = {}
    named_found = set()
    for lp in plan.layers:
        entries: dict = {}
        for e in lp.params:  # (a quantized wrapper: one entry per inner tensor)
            entries.setdefault(id(e.param), []).append(e)
        mods = []
        for name, m in lp.module.named_modules():
            if not name:
                continue
            named = spec is not None and _wanted(spec, name, m)
            if spec is not None and not named:
                continue
            routing = routing_argument(m)
            qual = f"{plan.path}.{lp.index}.{name}"
            if routing is None:
                if named:
                    raise ValueError(
                        f"layerwise: expert_modules names {qual!r} ({type(m).__name__}), but its forward takes no "
                        f"routing argument (one of {list(ROUTING_ARGS)}): the experts that received tokens cannot "
                        "be known before it runs. Name the module whose forward takes the routing, or use "
                        "experts='all'. The model is unchanged.")
                continue
            why, n_exp, ents, parts = _why_not(m, entries, qual)
            if why is not None:
                if named:
                    raise ValueError(f"layerwise: expert_modules names {qual!r} ({type(m).__name__}), which cannot "
                                     f"be routed: {why}. Use experts='all' for it. The model is unchanged.")
                log.warning("layerwise: %s (%s) takes the routing but streams whole: %s", qual, type(m).__name__, why)
                continue
            named_found.add(name)
            mods.append(ExpertModule(lp.index, name, m, n_exp, ents, routing, parts))
        if mods:
            lp.layout(tail={id(e) for m in mods for e in m.entries})
            for m in mods:
                m.place()
            layers[lp.index] = mods
    if spec is not None and not callable(spec):
        missing = sorted(set(spec) - named_found)
        if missing:
            raise ValueError(f"layerwise: expert_modules names {missing}, which no layer of {plan.path!r} has "
                             "(names are relative to a layer, e.g. 'mlp.experts'). The model is unchanged.")
    if not layers:
        log.warning("layerwise: experts='routed': no layer of %r has an expert module (a module whose forward takes "
                    "the routing, one of %s, over expert-major parameters): its layers stream whole",
                    plan.path, list(ROUTING_ARGS))
        return None
    return ExpertPlan(plan.path, layers)
