"""Edits in place of a streamed layer's true weights: peft merge / unmerge and modules
added later (docs/design.md, "The state contract").

`editing(manager, i)` puts layer i's true bytes in its slot while a body runs and
writes back what it changed. [Note: merge guards] peft's tuner layers merge adapters
through `.data`, which no version counter sees, so their `merge` / `unmerge` are
wrapped in the instance `__dict__` to run inside `editing`; undone with the group's
hooks. [Note: registration hook] peft adds adapters after configure by registering
modules: a process-wide module-registration hook watches modules added inside a
streamed layer; it is installed with the first offloaded model and removed with the
last (`release_registration_hook`).
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch import nn

from layerwise.runtime import host_store


def watching(manager) -> dict:
    """{module: record} of the modules watched for `manager` (install_layer_hooks)."""
    return {mod: rec for mod, rec in list(WATCHED.items()) if rec[0]() is manager}


def unwatch(manager, keep=()) -> None:
    """Forget the modules install_layer_hooks watched for `manager`, but those of
    the layers in `keep` (set_residency: the layers that stream after the change)."""
    keep = set(keep)
    for mod, (ref, i) in list(WATCHED.items()):
        if ref() is manager and i not in keep:
            del WATCHED[mod]


@contextlib.contextmanager
def editing(manager, i: int):
    """Layer i's true weights in place (its slot, loaded and kept) while the body
    runs; afterwards whatever the body wrote (in place, or by rebinding a
    parameter's .data) goes back into the arena."""
    lp = manager.plan.layers[i]
    ring = manager.ring
    s = ring.slot_of[i]
    with manager.lock, torch.no_grad():
        if s >= 0 and not manager.sources[i].writable:
            manager.sources[i].refuse_write()  # refused before the body runs: names the file and the way out
        if s >= 0:
            manager.bound.check_all(manager, [i])
            manager.wait_ready(i)
            ring.pin(i)
        views = [(e, e.source() if e.wrapped is not None else e.param.data) for e in lp.params]
        try:
            yield
        finally:
            try:
                for e, view in views:
                    now = e.source() if e.wrapped is not None else e.param.data
                    if now.data_ptr() != view.data_ptr() or now.stride() != view.stride():
                        if now.shape != view.shape or now.dtype != view.dtype:
                            raise RuntimeError(
                                f"layerwise: {e.qualname} became {now.dtype}{list(now.shape)} in an edit; a "
                                f"streamed parameter keeps {view.dtype}{list(view.shape)} while offloaded"
                            )
                        view.copy_(now)
                        host_store.assign([(e, view)])
                if s >= 0:
                    if manager.device.type == "cuda":
                        torch.cuda.current_stream(manager.device).synchronize()
                    manager.write_layer(i, lambda block: block.copy_(ring.dst[i]))
                    ring.kept(i, manager.sources[i].version())  # the slot holds the edited bytes already
            except BaseException:
                if s >= 0:
                    ring.forget(i)  # the slot may hold bytes the truth does not: reload
                raise
            finally:
                if s >= 0:
                    ring.unpin(i)


# peft's tuner layers (LoRA & co.) merge adapters into the base weight through
# `.data`, which no version counter sees: run merge/unmerge inside `editing`.
WATCHED: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()
_REGISTRATION_HOOK = []


def _is_tuner_layer(mod) -> bool:
    return all(callable(getattr(mod, n, None)) for n in ("merge", "unmerge", "get_base_layer"))


class Unwrap:
    def __init__(self, mod, names):
        self.mod, self.names = weakref.ref(mod), names

    def remove(self):
        mod = self.mod()
        if mod is not None:
            for n in self.names:
                mod.__dict__.pop(n, None)


def guard_merge(mod) -> list:
    if not _is_tuner_layer(mod) or getattr(mod.__dict__.get("merge"), "layerwise_guard", False):
        return []
    for name in ("merge", "unmerge"):
        method = getattr(type(mod), name)

        @functools.wraps(method)
        def guarded(*args, _method=method, _mod=mod, **kwargs):
            owner = WATCHED.get(_mod)
            manager = owner[0]() if owner else None
            if manager is None or not manager.streaming:
                return _method(_mod, *args, **kwargs)
            with editing(manager, owner[1]):
                return _method(_mod, *args, **kwargs)

        guarded.layerwise_guard = True
        mod.__dict__[name] = guarded
    return [Unwrap(mod, ("merge", "unmerge"))]


def _on_register(parent, name, sub):
    """A module registered inside a streamed layer after configure (peft's
    add_adapter / inject_adapter does that): watch it and guard its merges."""
    if torch.compiler.is_compiling():
        # A registration dynamo traces is a container a forward builds (Llama slices its
        # ModuleList: `self.layers[:n]`), never inside a streamed layer, and the compiled
        # graph does not call this hook again. Reading WATCHED here would make dynamo
        # guard on every module in it: each model configured, removed or collected
        # since would recompile the graph.
        return None
    owner = WATCHED.get(parent)
    if owner is None or sub is None:
        return None
    manager = owner[0]()
    if manager is None or not manager.streaming:
        return None
    for m in sub.modules():
        WATCHED[m] = owner
        manager.add_hooks(guard_merge(m))
        if _is_tuner_layer(m):
            problem = _reads_base_weights(manager, m)
            if problem:
                manager.guard.error = (
                    f"layerwise: an adapter was added to {manager.layer_name}[{owner[1]}] after configure whose "
                    f"initialisation {problem}; outside its block's forward a streamed weight holds whatever its "
                    "ring slot holds, so the adapter was built from the wrong weights. Delete the adapter, call "
                    "layerwise.remove_layerwise_offload(model), add the adapter, and configure again (plain LoRA "
                    "can be added after configure)."
                )
    return None


def _reads_base_weights(manager, tuner) -> str | None:
    """What peft's tuner-layer initialisation did that needs the base weights'
    true values (DoRA's magnitude vector is their norm; PiSSA / OLoRA rewrite
    the base weight), or None."""
    if any(bool(v) for v in (getattr(tuner, "use_dora", None) or {}).values()):
        return "(DoRA) computes a magnitude from the base weight"
    base = tuner.get_base_layer()
    for p in base.parameters(recurse=False):
        # (each planned entry's own tensor: a quantized wrapper has no storage of its
        # own, its leaves do; formats/quantized.py)
        entries = [e for lp in manager.plan.layers for e in lp.params if e.param is p]
        if entries and not _bound_resident(manager, p) and any(
                e.source().untyped_storage().data_ptr() not in manager.ring.ptrs for e in entries):
            return "(PiSSA, OLoRA, LoftQ, ...) rewrote the base weight"
    return None


def _bound_resident(manager, p) -> bool:
    return any(e.param is p for i in manager.resident for e in manager.plan.layers[i].params)


def ensure_registration_hook() -> None:
    """[Note: registration hook] (module doc): installed with the first streamed group."""
    if not _REGISTRATION_HOOK:
        from torch.nn.modules.module import register_module_module_registration_hook

        _REGISTRATION_HOOK.append(register_module_module_registration_hook(_on_register))


def release_registration_hook() -> None:
    """No model streams any more (registry.detach of the last one, or the last one was
    garbage collected): the process-wide hook goes; the next configure installs it again."""
    while _REGISTRATION_HOOK:
        _REGISTRATION_HOOK.pop().remove()
