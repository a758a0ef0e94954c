"""state_dict of a streamed model reads the true weights (docs/design.md, "The state contract").

state_dict() of a module that holds streamed parameters gives views of their host
bytes (a write into one reaches the model: its version is bumped when the write is
noticed), or decoded copies where the truth is encoded or on disk. [Note: instance
_save_to_state_dict] A library whose own `_save_to_state_dict` reads `weight.data`
(bitsandbytes) runs with the parameter bound to its true bytes: the override lives in
the instance `__dict__` and is removed with the group.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from layerwise.contract import edits, interrupts, rebinds
from layerwise.formats import quantized
from layerwise.planning.layout import Wrapped
from layerwise.runtime import host_store


# ------------------------------------------------- state_dict, load, edits
def owned(manager, streamed=None):
    """{module: [(attr, entry, layer index)]} for the streamed parameters each
    module holds directly (a quantized wrapper: its `Wrapped` record in place of
    the entry); `streamed`: the streamed layers (default: the ring's)."""
    out: dict = {}
    streamed = set(manager.ring.streamed if streamed is None else streamed)
    for lp in manager.plan.layers:
        if lp.index not in streamed:
            continue  # resident layers are ordinary device tensors: nothing to guard
        by_id = {id(e.param): e if e.wrapped is None else e.wrapped for e in lp.params}
        for mod in lp.module.modules():
            for attr, p in mod._parameters.items():
                if p is not None and id(p) in by_id:
                    out.setdefault(mod, []).append((attr, by_id[id(p)], lp.index))
    return out


def _host_alias(e, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The parameter's bytes in the arena as a tensor with a storage of its own
    (no copy), and the base it is a view of (they share one version counter):
    torch.save, safetensors and transformers treat a state dict whose tensors
    share one storage under several dtypes as shared or refuse it."""
    raw = torch.from_numpy(block.numpy()[e.offset : e.offset + e.span_bytes])
    return torch.as_strided(raw.view(e.dtype), e.shape, e.stride), raw


def guard_save(mod, manager, owned):
    """state_dict() of a module that holds streamed parameters: what torch (or the
    module's library) saves and the true bytes that replace its slot views, both under
    the model's lock, so that a removal on another thread happens wholly before or
    wholly after a module's entries are taken, never in between. A quantized
    wrapper is saved by the module's own code (torch's, or quanto's, which saves
    derived tensors under keys of its own) while it is bound to its true bytes."""
    original = mod._save_to_state_dict  # bound: the class's, or a library's override
    fix = _state_dict_hook(manager, owned)
    wrapped = [(attr, w, i) for attr, w, i in owned if isinstance(w, Wrapped)]
    # A library's own save may read (and rebind: bitsandbytes' nf4 CPU layout) the data
    # of plain parameters: it runs over their true bytes, never over a shared slot.
    plain = [] if type(mod)._save_to_state_dict is nn.Module._save_to_state_dict else [
        (attr, e, i) for attr, e, i in owned if not isinstance(e, Wrapped) and e.dspec is None]

    layers = sorted({i for _, _, i in owned})

    def _save_to_state_dict(destination, prefix, keep_vars):
        with manager.lock:
            if manager.streaming:
                manager.bound.check_all(manager, layers)  # (layerwise/rebinds.py: a rebound parameter is settled first)
            with contextlib.ExitStack() as stack:
                if wrapped and manager.streaming:
                    stack.enter_context(_bound_to_truth(manager, wrapped, destination, prefix))
                if plain and manager.streaming:
                    stack.enter_context(_plain_bound_to_truth(manager, mod, plain))
                original(destination, prefix, keep_vars)
            fix(mod, destination, prefix, None)

    _save_to_state_dict.layerwise_guard = True
    mod.__dict__["_save_to_state_dict"] = _save_to_state_dict
    return edits.Unwrap(mod, ("_save_to_state_dict",))


def _true_tensor(manager, e, i, copies):
    """Entry e's true bytes (layer i) as a tensor: an alias of the arena (handed out:
    a write through it reaches the model), or a copy where the truth is elsewhere."""
    host = manager.layer_host(i)
    if host is None:
        # A copy of the true bytes (a layer on disk, say): a write into it does not
        # reach the model; load_state_dict does.
        if i not in copies:
            copies[i] = manager.read_layer(i)
        return host_store.materialize(e, copies[i], "cpu")
    t, raw = _host_alias(e, host)
    # The base is held, not the alias: a write through an alias freed since
    # still shows in the base's version at the next check.
    manager.guard.handed_out.append((weakref.ref(t), raw, raw._version, i))
    return t


@contextlib.contextmanager
def _bound_to_truth(manager, wrapped, destination, prefix):
    """The quantized wrappers `wrapped` ([(attr, Wrapped, layer index)]) rebuilt
    over their true bytes while the body runs (a module's own save), then bound to
    their slot views again; a wrapper the body put in `destination` itself
    (keep_vars) is replaced by one over the true bytes, which outlives the body."""
    for _, w, _ in wrapped:  # (before anything is rebound: torch.utils.swap_tensors' own refusals)
        why = quantized.swap_refused(w.param)
        if why:
            raise RuntimeError(
                f"layerwise: state_dict() cannot read the streamed {w.library_type} weight {w.qualname}: {why}, "
                "and torch cannot swap a wrapper over its true bytes into it. Drop that reference (or call "
                "layerwise.remove_layerwise_offload(model) first). The model is unchanged.")
    with torch.inference_mode(False):
        copies: dict = {}
        truth = {id(w): {e.leaf: _true_tensor(manager, e, i, copies) for e in w.entries} for _, w, i in wrapped}
    try:
        with interrupts.defer_interrupts():
            for _, w, _ in wrapped:
                host_store.bind_leaves([(e, truth[id(w)][e.leaf]) for e in w.entries])
        yield
    finally:
        with interrupts.defer_interrupts():
            ring = manager.ring
            for attr, w, i in wrapped:
                host_store.bind_layer_to_slot(w.entries, ring.slots[ring.slot_of[i]])
                if destination.get(prefix + attr) is w.param:
                    destination[prefix + attr] = quantized.rebuild(w.form, truth[id(w)])


@contextlib.contextmanager
def _plain_bound_to_truth(manager, mod, plain):
    """The plain parameters `plain` ([(attr, entry, layer index)]) of `mod` bound to
    their true bytes while the body (the module's library's own save) runs, then to
    their slot views again; one the body rebound (a library converting its layout
    back) is settled by layerwise/rebinds.py: its new bytes become the truth."""
    with torch.inference_mode(False):
        copies: dict = {}
        truth = [(e, i, _true_tensor(manager, e, i, copies)) for _, e, i in plain]
    try:
        with interrupts.defer_interrupts():
            for e, _, t in truth:
                host_store.bind_to_slot(e, t)
        yield
    finally:
        with interrupts.defer_interrupts():
            ring = manager.ring
            moved: dict = {}
            for e, i, t in truth:
                if e.param.data_ptr() != t.data_ptr():
                    moved.setdefault(i, []).append(e)
                else:
                    host_store.bind_to_slot(e, e.view_in(ring.slots[ring.slot_of[i]]))
            for i, entries in moved.items():
                rebinds.settle(manager, i, entries, f"{type(mod).__qualname__}._save_to_state_dict")


def _state_dict_hook(manager, owned):
    def hook(module, state_dict, prefix, local_metadata):
        if not manager.streaming:
            return
        with torch.inference_mode(False):  # version counters exist outside inference mode only
            copies = {}  # layers whose truth is not in host memory: read once per call
            for attr, e, i in owned:
                key = prefix + attr
                if isinstance(e, Wrapped) or key not in state_dict:  # (a wrapper: saved over its truth)
                    continue
                host = manager.layer_host(i)
                if host is None:
                    # A copy of the true bytes (a layer on disk, say): a write into it does not
                    # reach the model; load_state_dict does.
                    if i not in copies:
                        copies[i] = manager.read_layer(i)
                    state_dict[key] = e.wrap(host_store.materialize(e, copies[i], "cpu"))
                    continue
                t, raw = _host_alias(e, host)
                # The base is held, not the alias: a write through an alias freed since
                # still shows in the base's version at the next check.
                manager.guard.handed_out.append((weakref.ref(t), raw, raw._version, i))
                state_dict[key] = e.wrap(t)

    return hook


def check_handed_out(manager) -> None:
    """state_dict() tensors alias the arena; one written in place since it was
    handed out makes its layer reload. O(tensors still alive), usually none.
    The alias's version counter is its own (the arena block's does not move), so
    the layer's source is told (host_written): its version grows, and whatever is
    keyed on it (the slot ring, the routed experts' device cache) sees the write."""
    live = []
    for ref, raw, version, i in manager.guard.handed_out:
        if raw._version != version:
            manager.sources[i].host_written()
            if manager.ring.slot_of[i] < 0:  # handed out while streamed, resident since (set_residency)
                manager.refresh_resident(i)
            else:
                arena_written(manager, i)
            version = raw._version
        if ref() is not None:  # checked once more after the alias died, then dropped
            live.append((ref, raw, version, i))
    manager.guard.handed_out = live


def arena_written(manager, i: int) -> None:
    """Layer i's bytes in the arena changed: its slot reloads, and a backward that
    saved its old weights refuses instead of reading the new ones."""
    manager.ring.written(i)
