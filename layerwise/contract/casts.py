"""Casts, moves and copies of an offloaded model (docs/design.md, "The state contract").

[Note: instance _apply] Every module that holds streamed parameters gets an
`_apply` in its instance `__dict__` (behind `.to`, `.half`, `.cuda`, ...): a change to
streamed weights is refused before anything changes, the rest of the model casts as
usual. `__deepcopy__` / `__reduce_ex__` there refuse with the remedy instead of failing
deep inside the native arena. Why the instance and not the class: only the offloaded
model's modules change, never another instance of the same class. Undone by
registry.detach, with the last group of the model.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from layerwise.contract import registry

COPY_REFUSED = (
    "an offloaded model cannot be deep-copied or pickled: its streamed weights live in layerwise's host arena. "
    "Save model.state_dict() instead (it gives the true weights), or call "
    "layerwise.remove_layerwise_offload(model) first."
)


# ----------------------------------------------------------- casts, moves
def _managed(model: nn.Module):
    ids, probes = set(), {}
    for m in registry.managers_of(model):
        if not m.streaming:
            continue
        for lp in m.plan.layers:
            for e in lp.params:
                ids.add(id(e.param))
                # (a quantized wrapper is cast as a whole, by its outer dtype: fn never
                # sees its leaves, and `.bfloat16()` of a bf16 torchao weight is a no-op)
                dtype = e.wrapped.param.dtype if e.wrapped is not None else e.dtype
                probes.setdefault((dtype, m.device), m.layer_name)
    return ids, probes


def install_cast_guards(model: nn.Module) -> None:
    """`_apply` (behind .to, .half, .float, .cuda, .cpu, .type, ...) of every module
    that holds streamed parameters refuses a change to them and applies the
    rest to everything else."""
    holders = set()
    for m in registry.managers_of(model):
        holders.add(id(m.plan.module_list))
        for mod in m.plan.module_list.modules():
            holders.add(id(mod))
    for name, mod in model.named_modules():
        inside = any(id(sub) in holders for sub in mod.modules())
        if inside and not getattr(mod.__dict__.get("_apply"), "layerwise_guard", False):
            mod.__dict__["_apply"] = _guarded_apply(model, mod, name)
            # deepcopy / pickle look these up on the instance first: refuse with the remedy
            # rather than fail deep inside on a hook or the native arena.
            mod.__dict__["__deepcopy__"] = _refuse_copy
            mod.__dict__["__reduce_ex__"] = _refuse_copy


def _refuse_copy(*args, **kwargs):
    raise TypeError(COPY_REFUSED)


# `layerwise_guard` marks a function layerwise put in an instance's __dict__ (here and in
# edits.py, state_dict.py, pipelines.py): installed once, and removed by registry.detach.
_refuse_copy.layerwise_guard = True


def _guarded_apply(model: nn.Module, mod: nn.Module, name: str):
    cls_apply = type(mod)._apply
    model_ref = weakref.ref(model)

    def _apply(fn, *args, **kwargs):
        if torch.__future__.get_overwrite_module_params_on_conversion() or \
                torch.__future__.get_swap_module_params_on_conversion():
            raise RuntimeError(
                "layerwise: torch.__future__.set_overwrite_module_params_on_conversion / "
                "set_swap_module_params_on_conversion is on: a cast or move would replace the streamed parameters "
                "with new objects that the streaming engine does not know. Turn the flag off, or call "
                "layerwise.remove_layerwise_offload(model) first. The model is unchanged."
            )
        root = model_ref()
        ids, probes = _managed(root) if root is not None else (set(), {})
        for (dtype, device), group in probes.items():
            probe = torch.empty((1,), dtype=dtype, device=device)
            out = fn(probe)
            if not isinstance(out, torch.Tensor) or out.dtype != dtype or out.device != device:
                to = f"{out.dtype} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
                raise RuntimeError(
                    f"layerwise: this cast or move of {name or type(mod).__name__!r} would turn the streamed "
                    f"{dtype} weights of layer group {group!r} on {device} into {to}; casts and moves of "
                    "streamed weights are not supported while offloaded. Call "
                    "layerwise.remove_layerwise_offload(model) first, cast or move, then configure again. "
                    "The model is unchanged."
                )

        def keep_streamed(t):
            return t if id(t) in ids else fn(t)

        return cls_apply(mod, keep_streamed, *args, **kwargs)

    _apply.layerwise_guard = True
    return _apply
