"""Configure and remove as transactions (docs/design.md, "The state contract").

`rollback_on_failure` puts every parameter and buffer back bitwise if a configure
fails or is interrupted anywhere; `remove_models` builds every ordinary tensor first
(a failure there changes nothing) and only then rebinds, with Ctrl-C held back.
"""
from __future__ import annotations

import contextlib
import threading

from torch import nn

from layerwise.contract import interrupts, load_state_dict, locking, registry
from layerwise.formats import quantized


def snapshot_devices(model: nn.Module) -> list:
    """Where every parameter and buffer lives now (devices only: holding the
    tensors themselves would keep a second copy of the model alive)."""
    snap = [(p, p.device) for p in model.parameters()]
    snap += [(m, name, b.device) for m in model.modules() for name, b in m._buffers.items() if b is not None]
    return snap


def device_moves(snap: list, skip=frozenset()) -> list:
    """[(snapshot item, its tensor on the device it had)] for the parameters (ids
    not in `skip`) and buffers that are not where the snapshot saw them; nothing
    changes until `apply_moves`."""
    out = []
    for item in snap:
        if len(item) == 2:
            p, dev = item
            if id(p) not in skip and p.device != dev:
                if quantized.is_wrapper(p):  # rebuilt over its leaves moved (formats/quantized.py)
                    out.append((item, (quantized.structure(p),
                                       {path: t.to(dev) for path, t in quantized.leaf_tensors(p).items()})))
                else:
                    out.append((item, p.data.to(dev)))
        else:
            m, name, dev = item
            b = m._buffers.get(name)
            if b is not None and b.device != dev:
                out.append((item, b.to(dev)))
    return out


def apply_moves(moves: list) -> None:
    for item, t in moves:
        if len(item) == 2 and isinstance(t, tuple):
            quantized.rebind(item[0], *t)
        elif len(item) == 2:
            item[0].data = t
        else:
            item[0]._buffers[item[1]] = t


def _restore_devices(snap: list) -> None:
    apply_moves(device_moves(snap))


@contextlib.contextmanager
def rollback_on_failure(parts, undo=None, finish=None):
    """Run a configure of the models in `parts` ([(model, managers)]).

    If it fails at any point (an exception or KeyboardInterrupt), every parameter
    and buffer of every model is put back bitwise as before, with no hooks. If it
    succeeds, each model is completed (rollback data dropped, groups linked for
    cross-group prefetch, managers attached) and `finish()` runs, with Ctrl-C held
    back until every model is whole: an interrupt that lands then is delivered
    afterwards, on a model that is completely configured, never half of one."""
    snaps = [snapshot_devices(model) for model, _ in parts]
    held = interrupts.defer_interrupts()
    try:
        # (the groups finalised inside are completed here, not by register_outside_front_door)
        registry.front_door(parts, 1)
        yield
        held.__enter__()  # nothing below this point in the try can fail
    except BaseException:
        registry.front_door(parts, -1)
        with interrupts.defer_interrupts():
            for (model, managers), snap in zip(parts, snaps):
                for m in managers:
                    m.remove(original_devices=True)
                _restore_devices(snap)
                if not model.__dict__.get(registry.MANAGERS):
                    model.__dict__.pop(locking.LOCK, None)
                    model.__dict__.pop(registry.COHORT, None)
            if undo is not None:
                undo()
        raise
    try:
        for model, managers in parts:
            registry.link([m for m in managers if m.enabled])
            for m in managers:
                m.commit_configure()
            if managers:
                registry.attach(model, managers)
        if finish is not None:
            finish()
    finally:
        registry.front_door(parts, -1)
        held.__exit__(None, None, None)


@contextlib.contextmanager
def removing(model: nn.Module):
    """Hold the model for a removal: forwards (and loads into its streamed layers) that
    other threads are running end first; forwards that start meanwhile wait and then
    run on the plain model."""
    lock = locking.model_lock(model)
    forwards = model.__dict__.get(registry.FORWARDS)
    with lock:
        try:
            if forwards is not None:
                forwards["removing"] = True
                me = threading.get_ident()
                while True:
                    # Forwards an interrupt abandoned (their call is off the thread's stack) or
                    # whose thread died are over.
                    for t, frame in list(forwards["threads"].items()):
                        if t != me and (frame is None and not locking.threads_alive([t], me)
                                        or frame is not None and not locking.on_stack(t, {id(frame)})):
                            del forwards["threads"][t]
                    if not any(t != me for t in forwards["threads"]) and not load_state_dict.loads_elsewhere(model, me):
                        break
                    forwards["cond"].wait(timeout=0.5)
            yield
        finally:
            if forwards is not None:
                forwards["removing"] = False
                forwards["cond"].notify_all()


def remove_models(parts, original_devices: bool = False, finish=None, prepare=None) -> None:
    """Remove the offload of several models as one transaction ([(model, managers)]).

    Phase one builds every parameter's ordinary tensor and changes nothing: if it
    fails (a layer that cannot be read, no memory) or is interrupted, every model
    still streams exactly and the removal can be called again. Phase two rebinds
    and releases, with Ctrl-C held back, and `finish()` runs inside it. Forwards,
    state_dict() and load_state_dict() calls on other threads end first; forwards
    that start meanwhile wait and then run on the plain model. `prepare()`, if given,
    runs in phase one with every model held (its result is the caller's, for `finish`)."""
    with contextlib.ExitStack() as held:
        for model, _ in parts:
            held.enter_context(removing(model))
        if prepare is not None:
            prepare()
        for _, managers in parts:
            for m in managers:
                if m.streaming:
                    with m.lock:
                        load_state_dict.settle_loads(m)
        prepared = [[(m, m.prepare_removal(original_devices)) for m in managers] for _, managers in parts]
        with interrupts.defer_interrupts():
            for (model, _), group in zip(parts, prepared):
                for m, p in group:
                    streamed = m.streaming
                    m.commit_removal(p)
                    if streamed:
                        with m.guard.loads_lock:  # (a load begun since finds the group removed: it writes nothing)
                            m.guard.loads = []
                registry.forget(model, [m for m, _ in group])
            if finish is not None:
                finish()
