"""load_state_dict into streamed layers (docs/design.md, "The state contract").

A load writes each streamed layer's true bytes once, at the end of the outermost
load (its values are collected per layer by pre-hooks, which take them out of the
state dict so torch never copies into a slot view); an exception or Ctrl-C mid-load
leaves every streamed layer as it was; torch-reported errors keep torch's meaning.
Loads that cannot be taken exactly are refused where they start, before anything is
written: values that split-fetch ranks disagree on, layers read from a checkpoint
file, quantized values of another form.
"""
from __future__ import annotations

import functools
import sys
import threading
import types
import weakref

import torch
from torch import nn

from layerwise import stages
from layerwise.contract import interrupts, locking, registry
from layerwise.formats import quantized
from layerwise.planning.layout import Wrapped, local_tensor


def split_load_guards(manager) -> list:
    """split fetch: a load_state_dict that gives the ranks different values for the
    split layers is refused where it starts (the module it was called on, or the
    model when it is loaded as part of something larger), before anything changed:
    one collective compares them (stages/split/, ShareStore.check_load). The
    per-layer check in the source's write() stays the last word."""
    store = manager.tiers.split_store
    if store is None:
        return []
    split = {id(e.param): e.wrapped is not None for i in manager.ring.streamed if i in store.spans
             for e in manager.plan.layers[i].params}
    handles = []
    for name, mod in manager.model.named_modules():
        inner = [(rel, split[id(p)]) for rel, p in mod.named_parameters(remove_duplicate=False) if id(p) in split]
        if inner:
            handles.append(mod.register_load_state_dict_pre_hook(_check_split_load(manager, mod, inner)))
    return handles


def _check_split_load(manager, mod, inner):
    def hook(module, state_dict, prefix, *args):
        if not manager.streaming or (prefix and module is not manager.model):
            return  # inside a load that started above: checked there
        manager.tiers.split_store.check_load(_split_load_values(state_dict, prefix, inner))

    return hook


def _split_load_values(state_dict, prefix, inner) -> list:
    """[(key, plain tensor)]: the values a load_state_dict gives the split parameters
    `inner` ([(relative name, is a quantized wrapper)]), as plain tensors the ranks
    can compare byte for byte: a wrapper under its key (torchao) as its leaves, and
    for a wrapper also the tensors its library saves under keys of its own below
    the parameter's (quanto: `weight._data`, `weight._scale`)."""
    named = []
    wrapped = set()
    for rel, is_wrapped in inner:
        key = prefix + rel
        value = state_dict.get(key)
        if is_wrapped:
            wrapped.add(key)
        if quantized.is_wrapper(value):
            named.extend((f"{key}:{'.'.join(path)}", t) for path, t in quantized.leaf_tensors(value).items())
        elif isinstance(value, torch.Tensor):
            named.append((key, value))
    if wrapped:  # (one pass over the keys, each looked up by its prefixes)
        for key, value in state_dict.items():
            parts = key.split(".")
            if isinstance(value, torch.Tensor) and not quantized.is_wrapper(value) and any(
                    ".".join(parts[:j]) in wrapped for j in range(1, len(parts))):
                named.append((key, value))
    return named


def read_only_guards(manager, streamed) -> list:
    """Layers whose truth cannot be written (a checkpoint file the disk tier reads):
    a load_state_dict that would change one is refused where it starts - in the
    outermost module it was called on, before any tensor was copied."""
    fixed = {id(e.param): i for i in streamed if not manager.sources[i].writable
             for e in manager.plan.layers[i].params}
    return _load_guards(manager, fixed, _refuse_read_only)


def _load_guards(manager, chosen: dict, make_hook) -> list:
    """A load_state_dict pre-hook `make_hook(manager, [(relative name, chosen[id(p)])])`
    on every module of the model that holds one of the parameters `chosen` names
    ({id(parameter): what the hook needs of it})."""
    if not chosen:
        return []
    handles = []
    for name, mod in manager.model.named_modules():
        inner = [(rel, chosen[id(p)]) for rel, p in mod.named_parameters(remove_duplicate=False) if id(p) in chosen]
        if inner:
            handles.append(mod.register_load_state_dict_pre_hook(make_hook(manager, inner)))
    return handles


def _refuse_read_only(manager, inner):
    def hook(module, state_dict, prefix, *args):
        if not manager.streaming:
            return
        for rel, i in inner:
            if prefix + rel in state_dict:
                manager.sources[i].refuse_write()  # names the file and the way out

    return hook


# A layer whose truth is encoded or in a file is rewritten whole by each write, and a
# per-expert MoE layer has 2E + 1 modules holding its parameters: the values a load
# gives a group's streamed layers are collected per layer and written once, at the end
# of the load (the post-hook of the module where it began for the group). A load that
# an exception or a Ctrl-C stops in between writes nothing into them.
#
# torch iterates a module's load hooks over the live dict: a hook removed (a removal on
# another thread) while one before it waits for the model's lock makes the next step
# of that iteration raise. So each module has one pre-hook and one post-hook of a
# group, only the post-hook of the module where the load began and the pre-hook of a
# module holding streamed parameters take the lock, and a removal waits for the loads
# that other threads are running (`loads_elsewhere`).
_LOAD_CODE = next((c for c in nn.Module.load_state_dict.__code__.co_consts
                   if isinstance(c, types.CodeType) and c.co_name == "load"), None)


class LoadBatch:
    """What one load_state_dict gives one group's streamed layers, not written yet."""

    def __init__(self, root: nn.Module, frame, missing: list, errors: list):
        self.root = weakref.ref(root)  # the module whose post-hook ends the load for the group
        # torch's call that loads `root` (held: an id alone could be reused); off the
        # thread's stack, the load is over, its end reached or not
        self.frame = frame
        self.thread = threading.get_ident()
        self.missing = missing  # torch's list of missing keys: one per load, which tells loads apart
        self.errors = errors  # torch's error messages of the load (raised at its end)
        self.edits: dict = {}  # layer index -> [(key, edit(block))], in load order
        self.keys: set[str] = set()  # taken from torch: it does not copy them nor report them missing

    def live(self) -> bool:
        return locking.on_stack(self.thread, {id(self.frame)})


def _torch_load_frame(module, frame):
    """The frame of torch's load_state_dict recursion that loads `module` (its post-hooks
    run when it returns), looked for from `frame` up, or None: `module` loaded some other
    way (a library calling `_load_from_state_dict` itself, which runs no post-hook)."""
    while frame is not None and frame.f_code is not _LOAD_CODE:
        frame = frame.f_back
    return frame if frame is not None and frame.f_locals.get("module") is module else None


def _holders(manager, owners) -> list:
    """The modules of the model above those of `owners` (the model itself included)."""
    named = {id(mod): name for name, mod in manager.model.named_modules()}
    inside = {""}
    for mod in owners:
        name = named.get(id(mod))
        while name:
            inside.add(name)
            name = name.rpartition(".")[0]
    return [mod for name, mod in manager.model.named_modules() if name in inside and mod not in owners]


def load_batch_hooks(manager, owners) -> list:
    """The load hooks of the modules above those holding streamed parameters (where a
    load may begin and end for the group)."""
    handles = []
    for mod in _holders(manager, owners):
        handles.append(mod.register_load_state_dict_pre_hook(load_pre_hook(manager, [])))
        handles.append(mod.register_load_state_dict_post_hook(load_post_hook(manager)))
    return handles


def _batch_of(manager, missing):
    return next((b for b in manager.guard.loads if b.missing is missing), None)


def _begin_load(manager, module, missing, errors, frame) -> None:
    """A load reaches `module` (the first of the group's modules it reaches begins it)."""
    guard = manager.guard
    if _LOAD_CODE is None or not manager.streaming or _batch_of(manager, missing) is not None:
        return  # (inside a load that began above; or a torch whose load_state_dict is built otherwise:
        # every value written at once)
    frame = _torch_load_frame(module, frame)
    if frame is None:
        return
    batch = LoadBatch(module, frame, missing, errors)
    with guard.loads_lock:
        guard.loads = [b for b in guard.loads if b.live()] + [batch]
    if not manager.streaming:  # removed meanwhile (it forgot the loads before this one)
        _end_load(manager, batch)


def _end_load(manager, batch) -> None:
    with manager.guard.loads_lock:
        manager.guard.loads = [b for b in manager.guard.loads if b is not batch]


def drop_stopped_loads(manager) -> None:
    """Forget the values of loads that an exception or a Ctrl-C stopped before their end
    (they hold the state dict's tensors)."""
    guard = manager.guard
    if guard.loads:
        with guard.loads_lock:
            guard.loads = [b for b in guard.loads if b.live()]


def loads_elsewhere(model, me) -> bool:
    """A load_state_dict into the model's streamed layers runs on a thread other than `me`."""
    return any(b.thread != me and b.live() for m in registry.managers_of(model) for b in list(m.guard.loads))


def settle_loads(manager) -> None:
    """Before the group is removed (under its lock; loads on other threads have ended):
    the values a load running on this thread collected are written now (a hook of it
    removes the offload: what the removal gives back includes them, the rest of the
    load goes to the plain model); those of stopped loads are dropped."""
    drop_stopped_loads(manager)
    for batch in list(manager.guard.loads):
        write_loaded(manager, batch)


def write_loaded(manager, batch) -> None:
    """Write what `batch` collected: each layer once (its bytes read, every value
    copied in, written back), with Ctrl-C held back per layer, so that each layer
    takes all of its values or none. A write that fails as a copy fails in torch
    (RuntimeError: an encode out of host memory, say) is reported as torch reports
    those, and the others go on: that layer keeps all of its old values. Any other
    failure (no space for a spill file, a split-fetch refusal, Ctrl-C) raises: the
    layers before it hold their new values, it and those after it their old ones."""
    edits, batch.edits = batch.edits, {}
    if not edits or not manager.streaming:
        return
    with torch.no_grad(), torch.inference_mode(False):
        manager.bound.check_all(manager, sorted(edits))

        def edit(block, items):
            for _, fn in items:
                fn(block)

        for i in sorted(edits):
            try:
                with interrupts.defer_interrupts():
                    manager.write_layer(i, functools.partial(edit, items=edits[i]))
                    if manager.ring.slot_of[i] < 0:  # made resident since (set_residency on another thread)
                        manager.refresh_resident(i)
            except stages.split.SplitError:
                raise  # (the same on every rank: the ranks stay in step)
            except (RuntimeError, NotImplementedError) as err:
                names = ", ".join(repr(key) for key, _ in edits[i])
                batch.errors.append(f"While copying the parameters named {names}: {err} (they are layer "
                                    f"{manager.layer_name}[{i}], written as a whole: it keeps its old values)")


def _take(manager, i, key, edit, state_dict, missing_keys, error_msgs=None) -> None:
    """A value of key for layer i, as `edit(block)`: collected for the load's end, or
    written now where the load has no end this group sees (no batch; a failed write
    is then reported in `error_msgs` where given, else raised)."""
    batch = _batch_of(manager, missing_keys)
    if batch is not None:
        batch.edits.setdefault(i, []).append((key, edit))
        batch.keys.add(key)
    else:
        try:
            manager.write_layer(i, edit)
        except stages.split.SplitError:
            # Refused on every rank (different values per rank, ranks out of lockstep): raised as
            # it is. As a message in error_msgs torch would go on and copy the refused value
            # into the parameter (a ring slot view).
            manager.guard.loaded_keys.clear()
            raise
        except (RuntimeError, NotImplementedError) as err:  # torch's own wording; the layer keeps its bytes
            if error_msgs is None:
                raise
            error_msgs.append(f"While copying the parameter named {key!r}: {err}")
        manager.guard.loaded_keys.add(key)
    # Taken: torch does not copy it into the slot (that would only bump the slot's version
    # counter, which says "written in place"), and the post-hook takes it off the missing keys.
    state_dict.pop(key, None)


def load_pre_hook(manager, owned):
    """The group's load pre-hook of a module: where a load begins for the group, and
    where the values of the streamed parameters the module holds (`owned`) are taken."""
    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        _begin_load(manager, module, missing_keys, error_msgs, sys._getframe(1))
        if not owned:
            return
        assign = local_metadata.get("assign_to_params_buffers", False)
        with manager.lock, torch.no_grad(), torch.inference_mode(False):
            if not manager.streaming:  # (checked under the lock: removed meanwhile, torch copies as usual)
                return
            manager.bound.check_all(manager, sorted({i for _, _, i in owned}))
            for attr, e, i in owned:
                key = prefix + attr
                value = state_dict.get(key)
                param = module._parameters.get(attr)
                if isinstance(e, Wrapped):
                    _load_wrapped(manager, module, attr, e, i, key, value, state_dict, missing_keys)
                    continue
                if not isinstance(value, torch.Tensor) or param is None or value.shape != param.shape:
                    continue  # torch reports it, as for a resident model
                if assign and value.dtype != e.dtype:
                    error_msgs.append(
                        f"{key}: load_state_dict(assign=True) would make a streamed {e.dtype} parameter "
                        f"{value.dtype}; streamed dtypes are fixed while offloaded (cast the state dict, or "
                        "call layerwise.remove_layerwise_offload(model) first)"
                    )
                    continue

                def copy(block, e=e, key=key, value=value):
                    try:
                        e.view_in(block).copy_(local_tensor(value))
                    except (RuntimeError, NotImplementedError) as err:  # a meta tensor, say: torch's own wording
                        # Reported as torch reports it; not copied by torch into the ring slot view
                        # either (read as an in-place write at the next forward): the layer keeps its bytes.
                        error_msgs.append(f"While copying the parameter named {key!r}: {err}")

                _take(manager, i, key, copy, state_dict, missing_keys, error_msgs)

    return hook


def _load_wrapped(manager, module, attr, w, i, key, value, state_dict, missing_keys) -> None:
    """load_state_dict into a streamed quantized wrapper (its form checked first, at
    the outermost call: quantized_load_guards): a wrapper under its key (torchao)
    is written leaf by leaf into the layer's true bytes; a parameter the module's
    library built from keys of its own and set in place of ours (quanto) is taken
    the same way, and ours is put back."""
    new = module._parameters.get(attr)
    if new is not w.param and quantized.is_wrapper(new):
        source, what = new, f"{key} (as {type(module).__qualname__} loaded it)"
        module._parameters[attr] = w.param
    elif quantized.is_wrapper(value):
        source, what = value, key
    else:
        return  # not in this state dict (or a plain tensor: refused by the guard at the outermost call)
    why = w.form.mismatch(quantized.structure(source))
    if why:
        raise RuntimeError(_quantized_mismatch(w, what, why))
    leaves = quantized.leaf_tensors(source)

    def edit(block):
        for e in w.entries:
            e.view_in(block).copy_(leaves[e.leaf])

    # (the value torch would copy: taken only where it is the state dict's own)
    _take(manager, i, key, edit, state_dict if source is value else {}, missing_keys)


def _quantized_mismatch(w, key, why) -> str:
    return (f"layerwise: load_state_dict: {key} cannot be loaded into the streamed {w.library_type} parameter "
            f"{w.qualname}: {why}. Quantize the model the same way the state dict was made (or call "
            "layerwise.remove_layerwise_offload(model) first). The model is unchanged.")


def quantized_load_guards(manager, streamed) -> list:
    """A load_state_dict whose quantized values do not have the form of the model's
    streamed wrappers is refused where it starts, before anything is written: a
    wrapper under the parameter's key (torchao) must flatten the same way; the
    tensors a library saves under keys of its own (quanto: `weight._data`, ...)
    must have the dtypes and shapes the module's own state_dict gives."""
    wrapped = {}
    streamed = set(streamed)
    for lp in manager.plan.layers:
        if lp.index in streamed:
            for e in lp.params:
                if e.wrapped is not None:
                    wrapped[id(e.param)] = e.wrapped
    return _load_guards(manager, wrapped, _check_quantized_load)


def _check_quantized_load(manager, inner):
    def hook(module, state_dict, prefix, *args):
        if not manager.streaming or (prefix and module is not manager.model):
            return  # inside a load that started above: checked there
        for rel, w in inner:
            key = prefix + rel
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor):
                if not quantized.is_wrapper(value):
                    raise RuntimeError(_quantized_mismatch(
                        w, key, f"it is a plain {value.dtype}{list(value.shape)} tensor, not a quantized wrapper"))
                why = w.form.mismatch(quantized.structure(value))
                if why:
                    raise RuntimeError(_quantized_mismatch(w, key, why))
                continue
            own_keys = [k for k in state_dict if k.startswith(key + ".")]
            if not own_keys:
                continue
            parent, _, attr = rel.rpartition(".")
            holder = module.get_submodule(parent) if parent else module
            own: dict = {}
            holder._save_to_state_dict(own, "", False)  # (the true bytes: _guard_save)
            for k in own_keys:
                mine = own.get(k[len(prefix) + len(parent) + (1 if parent else 0):])
                theirs = state_dict[k]
                if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and (
                        mine.dtype != theirs.dtype or mine.shape != theirs.shape):
                    raise RuntimeError(_quantized_mismatch(
                        w, k, f"it is {theirs.dtype}{list(theirs.shape)}, "
                        f"the model's is {mine.dtype}{list(mine.shape)}"))

    return hook


def load_post_hook(manager):
    """The group's load post-hook of a module: the keys taken off the missing ones; at
    the module where the load began for the group, what it collected is written."""
    def hook(module, incompatible_keys):
        missing = incompatible_keys.missing_keys
        batch = _batch_of(manager, missing)
        if missing:  # (the keys taken since the last post-hook, at most: one pass per load)
            now = manager.guard.loaded_keys
            later = batch.keys if batch is not None else ()
            missing[:] = [k for k in missing if k not in now and k not in later]
        manager.guard.loaded_keys.clear()
        if batch is not None and batch.root() is module:
            try:
                with manager.lock:
                    write_loaded(manager, batch)
            finally:
                _end_load(manager, batch)

    return hook
