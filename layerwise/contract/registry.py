"""Which models stream, with which groups, and the model-level hooks
(docs/design.md, "The state contract").

The groups are recorded in the model's `__dict__` (never as attributes torch would
register); `attach` installs the root forward hooks that clean up after an abandoned
forward and close each step, and the cast guards; `detach`, with the last group,
removes all of it.
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

from layerwise.contract import casts, edits, load_state_dict, locking, state_dict
from layerwise.runtime import ops, turns

MANAGERS = "_layerwise_managers"
_HANDLES = "_layerwise_contract_handles"
FORWARDS = "_layerwise_forwards"  # forwards in progress per thread, for removal
COHORT = "_layerwise_cohort"  # the calls under way and the fetches they share (runtime/cohort.py)
_CONFIGURING = "_layerwise_configuring"  # front doors under way on the model (rollback_on_failure)


# ------------------------------------------------------------------ registry
def managers_of(model: nn.Module) -> list:
    return list(model.__dict__.get(MANAGERS, []))


def forget_abandoned(model) -> None:
    """The lock was taken over from a forward that an interrupt abandoned inside a
    layer: nobody else is inside a layer now, so what is marked computing is stale."""
    for m in managers_of(model) if model is not None else []:
        if m.streaming and m.ring.computing():
            m.forget_entered()


# The models that stream now, weakly held: the process-wide module-registration hook
# (contract/edits.py) lives exactly while one does.
_STREAMING: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _release_if_none_streams() -> None:
    # Iterated, not len(): the finalizer of a dropped model runs before the WeakSet's own
    # callback discards the dead reference, so len() still counts it; iteration skips it.
    if next(iter(_STREAMING), None) is None:
        edits.release_registration_hook()


def attach(model: nn.Module, managers) -> None:
    """Record the managers on the model and install the model-level guards once."""
    if model not in _STREAMING:
        _STREAMING.add(model)
        weakref.finalize(model, _release_if_none_streams)  # (a model dropped without its removal)
    model.__dict__.setdefault(MANAGERS, []).extend(managers)
    if _HANDLES not in model.__dict__:
        model.__dict__[FORWARDS] = {"threads": {}, "removing": False, "cond": locking.model_lock(model)}
        # (traced under torch.compile into layerwise::step_begin / step_end: runtime/ops.py)
        model.__dict__[_HANDLES] = [ops.install(
            model, lambda args: _root_pre_hook(model, args), lambda output: _root_post_hook(model, None, output),
            lambda tensors: _root_post_hook(model, None, None), managers[0].device, root=True)]
    casts.install_cast_guards(model)


def detach(model: nn.Module) -> None:
    for h in model.__dict__.pop(_HANDLES, []):
        h.remove()
    for mod in model.modules():
        for attr in ("_apply", "__deepcopy__", "__reduce_ex__", "_save_to_state_dict"):
            if getattr(mod.__dict__.get(attr), "layerwise_guard", False):
                del mod.__dict__[attr]
    model.__dict__.pop(MANAGERS, None)
    model.__dict__.pop(FORWARDS, None)
    model.__dict__.pop(locking.LOCK, None)
    model.__dict__.pop(COHORT, None)
    turns.detach(model)
    _STREAMING.discard(model)
    _release_if_none_streams()


def move_non_layer_weights(model: nn.Module, device: torch.device) -> None:
    """The single model.to(device); skipped for DTensor weights (each rank keeps its shards)."""
    if any(hasattr(p, "placements") and hasattr(p, "to_local") for p in model.parameters()):
        return
    model.to(device)


def check_configurable(model: nn.Module, managers) -> None:
    """Refuse, before anything changes, what packing cannot do exactly."""
    for name, p in model.named_parameters():
        if p.is_meta:
            raise ValueError(
                f"parameter {name!r} is on the meta device (the model was built without weights): "
                "configure_layerwise_offload needs real weights. Load it with "
                "layerwise.load_offloaded(model, checkpoint, layer_names, ...) instead."
            )
    for name, b in model.named_buffers():
        if b.is_meta:
            raise ValueError(
                f"buffer {name!r} is on the meta device: give it real values before configuring "
                "(layerwise.load_offloaded fills buffers from the checkpoint)."
            )


def front_door(parts, step: int) -> None:
    """Count the front doors under way on each model of `parts` (+1 entering, -1 leaving)."""
    for model, _ in parts:
        n = model.__dict__.get(_CONFIGURING, 0) + step
        if n > 0:
            model.__dict__[_CONFIGURING] = n
        else:
            model.__dict__.pop(_CONFIGURING, None)


def register_outside_front_door(manager) -> None:
    """A group finalised by its caller's own sequence, not inside a front door
    (LayerwiseOffloadManager(..., initialize=False), then _initialize_layer_weights(),
    one model.to, _finalize_initialization(): the seed's multi-group flow) is
    completed as a front door completes its groups: rollback data dropped, recorded
    on the model (managers_of, removal, report, the model-level guards), and linked
    to the model's other groups for cross-group prefetch (in the order finalised).
    Inside a front door (rollback_on_failure) it does nothing: the front door does it
    once every group is whole."""
    model = manager.model
    if model.__dict__.get(_CONFIGURING) or any(m is manager for m in managers_of(model)):
        return
    manager.commit_configure()
    attach(model, [manager])
    link([m for m in managers_of(model) if m.enabled])


# ---------------------------------------------------------- forward guard
def _root_pre_hook(model, args):
    """At the top of a forward of the model: clean up after a forward that an
    interrupt abandoned inside a layer (its lock still held by this thread,
    layers still marked computing). No other thread is inside a layer once the
    lock is ours, so anything still marked is stale."""
    lock = model.__dict__.get(locking.LOCK)
    if lock is None:
        return
    lock.release_all()
    # The frame of this call of the model: gone from the thread's stack, the
    # forward is over even if an interrupt skipped the post-hook.
    frame = locking.module_call_frame()
    # run_together's calls on a split-fetch model wait for their turn (runtime/turns.py)
    turns.begin(model, frame)
    co = None
    with lock:
        forwards = model.__dict__.get(FORWARDS)
        if forwards is not None:
            while forwards["removing"]:  # a removal is under way: it ends, then this forward runs plain
                forwards["cond"].wait()
            forwards["threads"][threading.get_ident()] = frame
            co = model.__dict__.get(COHORT)
            if co is not None:  # calls under way at once share each layer's fetch (runtime/cohort.py)
                co.begin(frame)
        # While calls overlap, one step spans them all: from the first one's start to the
        # last one's end (its figures are the bytes and waits of the whole batch).
        joining = co is not None and len(co.calls) > 1
        for m in managers_of(model):
            if not m.streaming:
                continue
            m.forget_abandoned_forward()
            if m.guard.handed_out:
                state_dict.check_handed_out(m)
            load_state_dict.drop_stopped_loads(m)
            m.meter.follow_root()
            m.new_step(joining)


def _root_post_hook(model, args, output):
    """The end of the model's forward closes the step of every group: report()
    has per-step figures from the first forward on."""
    forwards = model.__dict__.get(FORWARDS)
    last = True
    if forwards is not None:
        co = model.__dict__.get(COHORT)
        if co is not None:
            co.end()
            last = not co.calls  # (other calls go on: the step they share ends with the last of them)
        with forwards["cond"]:
            forwards["threads"].pop(threading.get_ident(), None)
            forwards["cond"].notify_all()
    try:
        for m in managers_of(model):
            if not m.streaming:
                continue
            m.end_captured_step()
            if last and m.meter.step_open:
                m.meter.end_step()
    finally:
        turns.end(model)  # (a call of a split-fetch turn hands the baton on: runtime/turns.py)


def forget(model: nn.Module, managers) -> None:
    """Managers removed: off the model's list, and the model's guards gone with the last one."""
    registered = model.__dict__.get(MANAGERS)
    if registered is None:
        return
    registered[:] = [m for m in registered if all(m is not r for r in managers)]
    if not registered:
        detach(model)
        return
    link([m for m in registered if m.enabled])


def link(enabled) -> None:
    """Cross-group prefetch: each group's last layer prefetches the next group's first."""
    for a, b in zip(enabled, enabled[1:] + enabled[:1]):
        a.link_next(b)
