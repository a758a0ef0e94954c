"""The state contract of an offloaded model (DESIGN.md): it is still a torch
module. What a user reads is true, what a user writes takes effect exactly or is
refused with a clear error and the model unchanged, an exception or Ctrl-C at
any point leaves nothing half done, and several threads never see a wrong
output.

Streamed parameters stay bound to views of ring slots (that is what keeps the
hooks O(1)), so the contract is kept around them, not by rebinding them:

- `state_dict()` of any module that owns streamed parameters gives views of
  their bytes in the host arena (CPU tensors; a write into one reaches the
  model: the arena's version counter tells the next pre-hook to reload).
- `load_state_dict()` writes streamed parameters into the arena and turns
  torch's own copy into a no-op; `strict` keeps PyTorch's meaning. `assign=True`
  loads a streamed parameter's values the same way (the parameter stays bound
  to its slot, so it does not alias the state dict's tensor afterwards; one that
  would change a streamed dtype is an error); into a resident layer it is
  PyTorch's own, and the parameters it put there are the ones that stream when
  the layer leaves the device (set_residency).
- an in-place write into a slot view (`weight.add_(d)` under no_grad) bumps the
  slot's version counter: the next pre-hook discards it and raises.
- casts and moves (`.half()`, `.to(dtype)`, `.to(other device)`) that would
  change streamed weights raise before anything changes; ones that leave them
  as they are (`.to(the streaming device)`) run on everything else.
- backward: tensors that autograd saves from a slot are checked when unpacked;
  if the slot was refilled since, the layer's bytes are read back from the arena.
  A placement change (set_residency) is refused from a forward under grad mode
  until its backward has finished or its graph is dropped (track_backward).
- peft's `merge` / `unmerge` (LoRA fusing) run with the layer's true weights in
  its slot, and what they wrote goes back into the arena.
- `copy.deepcopy` and pickling refuse with an error naming the remedy.
- a model-level lock serialises layers of concurrent forwards; interrupted
  forwards are cleaned up at the next call of the model.
"""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time
import types
import weakref

import torch
from torch import nn

from layerwise import drift, dynamo_guard, packing, stages
from layerwise.formats import quantized
from layerwise.plan import Wrapped, local_tensor

_MANAGERS = "_layerwise_managers"
_LOCK = "_layerwise_lock"
_HANDLES = "_layerwise_contract_handles"
_FORWARDS = "_layerwise_forwards"  # forwards in progress per thread, for removal
_CONFIGURING = "_layerwise_configuring"  # front doors under way on the model (rollback_on_failure)

COPY_REFUSED = (
    "an offloaded model cannot be deep-copied or pickled: its streamed weights live in layerwise's host arena. "
    "Save model.state_dict() instead (it gives the true weights), or call "
    "layerwise.remove_layerwise_offload(model) first."
)


# ------------------------------------------------------------------ registry
def managers_of(model: nn.Module) -> list:
    return list(model.__dict__.get(_MANAGERS, []))


class GroupGuard:
    """What the state contract keeps for one streamed group (its own fields; the
    manager reads `error` in its pre-hook and checks `handed_out` at each step)."""

    def __init__(self):
        self.handed_out: list = []  # state_dict() tensors that alias the arena (check_handed_out)
        self.loaded_keys: set[str] = set()  # taken by the load_state_dict pre-hooks and written at once
        self.loads: list = []  # LoadBatch of each load_state_dict in progress (written at its end)
        self.loads_lock = threading.Lock()  # around changes of `loads` (never held while anything blocks)
        self.error: str | None = None  # a broken contract found outside a forward
        self.saved = weakref.WeakSet()  # slot weights saved for a backward still to run (saved_slot_hooks)
        self.graphs = weakref.WeakSet()  # layer forwards under grad mode, alive with their graphs (track_backward)

    def backward_pending(self) -> bool:
        """A graph built through this group's layers is alive and its backward has not
        finished, or one saved its streamed weights (until the backward frees them)."""
        return len(self.saved) > 0 or any(not g.done for g in list(self.graphs))


class ModelLock:
    """One model's reentrant lock, shared by all its groups (prefetch crosses groups).

    A forward holds it from a layer's pre-hook to its post-hook. torch runs
    always_call forward hooks when an Exception leaves a module, not a
    KeyboardInterrupt or SystemExit: such a forward leaves its hold behind. A hold
    is *stale* once its thread has died or has left the module call that took it
    (that call's frame is no longer on the thread's stack); a thread waiting for the
    lock then takes it over (`on_take_over` forgets the layers the abandoned forward
    left marked as computing) instead of waiting for that thread to call the model
    again. Holds taken by `with` blocks are released by Python, never stale.

    Mutual exclusion is a C RLock (`threading.RLock`), whose acquire and release a
    signal cannot split; taking over replaces it with a fresh one (the abandoned
    hold keeps the old one, which nobody waits on any more). The bookkeeping next to
    it (owner, holds) is Python and may be cut short by a KeyboardInterrupt: a lock
    held with no bookkeeping is taken over too, once it has stayed so for a while.
    `wait` / `notify_all` stand in for a condition on the lock (the removal waits
    for forwards with them), by polling."""

    _POLL = 0.05  # s between looks at a held lock's owner
    _UNKNOWN_S = 1.0  # a lock held with no owner on record for this long is taken over

    def __init__(self):
        self._rl = threading.RLock()
        self._swap = threading.Lock()  # one take-over at a time
        self._owner = None
        self._holds: list = []  # the owner's holds: (module-call frame or None, the RLock it holds)
        self._reset_pending = False
        self.on_take_over = None
        self.taken_over = 0

    def _stale(self, unknown_since: float | None) -> bool:
        owner, holds = self._owner, list(self._holds)
        if owner is None or not holds:  # held, with nothing on record (a hold cut short)
            return unknown_since is not None and time.monotonic() - unknown_since > self._UNKNOWN_S
        if any(f is None for f, _ in holds):
            return False
        return not _on_stack(owner, {id(f) for f, _ in holds})

    def acquire(self, frame=None) -> bool:
        me = threading.get_ident()
        unknown_since = None
        while True:
            rl = self._rl
            if rl.acquire(timeout=self._POLL):
                if rl is not self._rl:  # taken over meanwhile: the current one is the lock
                    rl.release()
                    continue
                if self._owner != me:
                    self._owner, self._holds = me, []
                elif any(f is not None for f, _ in self._holds):
                    self._drop_abandoned(me)
                self._holds.append((frame, rl))
                if self._reset_pending:
                    self._reset_pending = False
                    if self.on_take_over is not None:
                        self.on_take_over()
                return True
            known = self._owner is not None and bool(self._holds)
            unknown_since = None if known else (unknown_since or time.monotonic())
            if self._stale(unknown_since):
                with self._swap:
                    if self._rl is rl:
                        self._rl = threading.RLock()
                        self._owner, self._holds, self._reset_pending = None, [], True
                        self.taken_over += 1

    def _drop_abandoned(self, me) -> None:
        """This thread holds the lock again: its holds from module calls that are no
        longer on its stack (a block called alone that a KeyboardInterrupt left) are
        dropped, and what they left marked computing is forgotten (on_take_over)."""
        live = {id(f) for f in _stack_frames(me)}
        keep = [(f, rl) for f, rl in self._holds if f is None or id(f) in live]
        if len(keep) == len(self._holds):
            return
        for f, rl in self._holds:
            if f is not None and id(f) not in live:
                rl.release()
        self._holds = keep
        self._reset_pending = True

    def release(self) -> None:
        """Release this thread's last hold (nothing, where it holds none on record)."""
        if self._owner != threading.get_ident() or not self._holds:
            return
        _, rl = self._holds.pop()
        if not self._holds:
            self._owner = None
        rl.release()

    def _is_owned(self) -> bool:
        return self._owner == threading.get_ident() and bool(self._holds)

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def wait(self, timeout: float | None = None) -> None:
        """Release every hold of this thread, sleep a little (at most `timeout`),
        and hold the lock again as before."""
        me = threading.get_ident()
        saved = list(self._holds) if self._owner == me else []
        if saved:
            self._owner, self._holds = None, []
            for _, rl in reversed(saved):
                rl.release()
        again = 0
        try:
            time.sleep(min(0.01, timeout) if timeout is not None else 0.01)
            for frame, _ in saved:
                self.acquire(frame)
                again += 1
        except BaseException:
            for _ in range(again):  # interrupted: hold nothing rather than part
                self.release()
            raise

    def notify_all(self) -> None:
        """(The waiters poll.)"""


def _stack_frames(ident):
    frame = sys._getframe() if ident == threading.get_ident() else sys._current_frames().get(ident)
    while frame is not None:
        yield frame
        frame = frame.f_back


def _on_stack(ident, frame_ids: set) -> bool:
    """Whether thread `ident` is alive and one of `frame_ids` is on its stack."""
    return any(id(f) in frame_ids for f in _stack_frames(ident))


def module_call_frame():
    """The frame of torch's module call that runs the calling hook (None where there
    is none: such a hold is never taken over). The frame object itself, held with
    the hold: an id alone could be reused by the next call at the same depth."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return None
        if frame.f_code is _CALL_IMPL:
            return frame
        frame = frame.f_back
    return None


_CALL_IMPL = nn.Module._call_impl.__code__


def model_lock(model: nn.Module) -> ModelLock:
    lock = model.__dict__.get(_LOCK)
    if lock is None:
        lock = model.__dict__.setdefault(_LOCK, ModelLock())
        ref = weakref.ref(model)
        lock.on_take_over = lambda: _forget_abandoned(ref())
    return lock


def _forget_abandoned(model) -> None:
    """The lock was taken over from a forward that an interrupt abandoned inside a
    layer: nobody else is inside a layer now, so what is marked computing is stale."""
    for m in managers_of(model) if model is not None else []:
        if m._finalized and m.ring.computing():
            m._forget_entered()


def attach(model: nn.Module, managers) -> None:
    """Record the managers on the model and install the model-level guards once."""
    model.__dict__.setdefault(_MANAGERS, []).extend(managers)
    if _HANDLES not in model.__dict__:
        model.__dict__[_FORWARDS] = {"threads": {}, "removing": False, "cond": model_lock(model)}
        handles = [dynamo_guard.register_hook(model.register_forward_pre_hook, _root_pre_hook, prepend=True),
                   dynamo_guard.register_hook(model.register_forward_hook, _root_post_hook, always_call=True)]
        model.__dict__[_HANDLES] = handles
    _install_cast_guards(model)


def detach(model: nn.Module) -> None:
    for h in model.__dict__.pop(_HANDLES, []):
        h.remove()
    for mod in model.modules():
        for attr in ("_apply", "__deepcopy__", "__reduce_ex__", "_save_to_state_dict"):
            if getattr(mod.__dict__.get(attr), "_layerwise", False):
                del mod.__dict__[attr]
    model.__dict__.pop(_MANAGERS, None)
    model.__dict__.pop(_FORWARDS, None)
    model.__dict__.pop(_LOCK, None)


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


# ------------------------------------------------------------- interrupts
@contextlib.contextmanager
def defer_interrupts():
    """Hold SIGINT back while a rollback runs (main thread only), then deliver it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    try:
        previous = signal.signal(signal.SIGINT, lambda *a: caught.append(a))
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if previous is signal.default_int_handler:
                raise KeyboardInterrupt
            if previous == signal.SIG_DFL:  # the default action: the process ends by SIGINT
                os.kill(os.getpid(), signal.SIGINT)
            elif callable(previous):
                previous(*caught[0])


def _snapshot_devices(model: nn.Module) -> list:
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
    snaps = [_snapshot_devices(model) for model, _ in parts]
    held = defer_interrupts()
    try:
        _front_door(parts, 1)  # (the groups finalised inside are completed here, not by register_outside_front_door)
        yield
        held.__enter__()  # nothing below this point in the try can fail
    except BaseException:
        _front_door(parts, -1)
        with defer_interrupts():
            for (model, managers), snap in zip(parts, snaps):
                for m in managers:
                    m.remove(original_devices=True)
                _restore_devices(snap)
                if not model.__dict__.get(_MANAGERS):
                    model.__dict__.pop(_LOCK, None)
            if undo is not None:
                undo()
        raise
    try:
        for model, managers in parts:
            link([m for m in managers if m.enabled])
            for m in managers:
                m._commit()
            if managers:
                attach(model, managers)
        if finish is not None:
            finish()
    finally:
        _front_door(parts, -1)
        held.__exit__(None, None, None)


def _front_door(parts, step: int) -> None:
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
    manager._commit()
    attach(model, [manager])
    link([m for m in managers_of(model) if m.enabled])


# ---------------------------------------------------------- forward guard
def _root_pre_hook(model, args):
    """At the top of a forward of the model: clean up after a forward that an
    interrupt abandoned inside a layer (its lock still held by this thread,
    layers still marked computing). No other thread is inside a layer once the
    lock is ours, so anything still marked is stale."""
    lock = model.__dict__.get(_LOCK)
    if lock is None:
        return
    while lock._is_owned():
        lock.release()
    with lock:
        forwards = model.__dict__.get(_FORWARDS)
        if forwards is not None:
            while forwards["removing"]:  # a removal is under way: it ends, then this forward runs plain
                forwards["cond"].wait()
            # The frame of this call of the model: gone from the thread's stack, the
            # forward is over even if an interrupt skipped the post-hook.
            forwards["threads"][threading.get_ident()] = module_call_frame()
        me = threading.get_ident()
        for m in managers_of(model):
            if not m._finalized:
                continue
            if m.ring.computing() or any(o == me for o, _ in m._grad_hooks):
                m._reset_entered()
            if m.guard.handed_out:
                check_handed_out(m)
            drop_stopped_loads(m)
            m.meter.follow_root()
            m._new_step()


def _root_post_hook(model, args, output):
    """The end of the model's forward closes the step of every group: report()
    has per-step figures from the first forward on."""
    forwards = model.__dict__.get(_FORWARDS)
    if forwards is not None:
        with forwards["cond"]:
            forwards["threads"].pop(threading.get_ident(), None)
            forwards["cond"].notify_all()
    for m in managers_of(model):
        if m._finalized and m.meter.step_open:
            m.meter.end_step()


@contextlib.contextmanager
def removing(model: nn.Module):
    """Hold the model for a removal: forwards (and loads into its streamed layers) that
    other threads are running end first; forwards that start meanwhile wait and then
    run on the plain model."""
    lock = model_lock(model)
    forwards = model.__dict__.get(_FORWARDS)
    with lock:
        try:
            if forwards is not None:
                forwards["removing"] = True
                me = threading.get_ident()
                while True:
                    # Forwards an interrupt abandoned (their call is off the thread's stack) or
                    # whose thread died are over.
                    for t, frame in list(forwards["threads"].items()):
                        if t != me and (frame is None and not _threads_alive([t], me)
                                        or frame is not None and not _on_stack(t, {id(frame)})):
                            del forwards["threads"][t]
                    if not any(t != me for t in forwards["threads"]) and not loads_elsewhere(model, me):
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
                if m._finalized:
                    with m._lock:
                        settle_loads(m)
        prepared = [[(m, m._prepare_removal(original_devices)) for m in managers] for _, managers in parts]
        with defer_interrupts():
            for (model, _), group in zip(parts, prepared):
                for m, p in group:
                    streamed = m._finalized
                    m._commit_removal(p)
                    if streamed:
                        with m.guard.loads_lock:  # (a load begun since finds the group removed: it writes nothing)
                            m.guard.loads = []
                forget(model, [m for m, _ in group])
            if finish is not None:
                finish()


def forget(model: nn.Module, managers) -> None:
    """Managers removed: off the model's list, and the model's guards gone with the last one."""
    registered = model.__dict__.get(_MANAGERS)
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
        a.next_manager = b


def _threads_alive(threads, me) -> bool:
    alive = {t.ident for t in threading.enumerate()}
    return any(t in alive for t in threads if t != me)


# ----------------------------------------------------------- casts, moves
def _managed(model: nn.Module):
    ids, probes = set(), {}
    for m in managers_of(model):
        if not m._finalized:
            continue
        for lp in m.plan.layers:
            for e in lp.params:
                ids.add(id(e.param))
                # (a quantized wrapper is cast as a whole, by its outer dtype: fn never
                # sees its leaves, and `.bfloat16()` of a bf16 torchao weight is a no-op)
                dtype = e.wrapped.param.dtype if e.wrapped is not None else e.dtype
                probes.setdefault((dtype, m.device), m.layer_name)
    return ids, probes


def _install_cast_guards(model: nn.Module) -> None:
    """`_apply` (behind .to, .half, .float, .cuda, .cpu, .type, ...) of every module
    that holds streamed parameters refuses a change to them and applies the
    rest to everything else."""
    holders = set()
    for m in managers_of(model):
        holders.add(id(m.plan.module_list))
        for mod in m.plan.module_list.modules():
            holders.add(id(mod))
    for name, mod in model.named_modules():
        inside = any(id(sub) in holders for sub in mod.modules())
        if inside and not getattr(mod.__dict__.get("_apply"), "_layerwise", False):
            mod.__dict__["_apply"] = _guarded_apply(model, mod, name)
            # deepcopy / pickle look these up on the instance first: refuse with the remedy
            # rather than fail deep inside on a hook or the native arena.
            mod.__dict__["__deepcopy__"] = _refuse_copy
            mod.__dict__["__reduce_ex__"] = _refuse_copy


def _refuse_copy(*args, **kwargs):
    raise TypeError(COPY_REFUSED)


_refuse_copy._layerwise = True


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

    _apply._layerwise = True
    return _apply


# ------------------------------------------------- state_dict, load, edits
def _owned(manager, streamed=None):
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


def install_layer_hooks(manager, streamed=None) -> list:
    """state_dict / load_state_dict hooks on every module that holds streamed
    parameters, and peft merge guards in every streamed layer (`streamed`: the
    streamed layers, default the ring's; set_residency installs the new
    placement's before it commits). On failure none stays registered."""
    streamed = list(manager.ring.streamed if streamed is None else streamed)
    handles: list = []
    watched = watching(manager)
    try:
        handles += _split_load_guards(manager)  # first: they refuse before any write hook ran
        handles += _quantized_load_guards(manager, streamed)
        owners = _owned(manager, streamed)
        handles += _load_batch_hooks(manager, owners)
        for mod, owned in owners.items():
            handles.append(_guard_save(mod, manager, owned))
            handles.append(mod.register_load_state_dict_pre_hook(_load_pre_hook(manager, owned)))
            handles.append(mod.register_load_state_dict_post_hook(_load_post_hook(manager)))
        for i in streamed:
            module = manager.plan.layers[i].module
            for sub in module.modules():
                _WATCHED[sub] = (weakref.ref(manager), i)
                handles.extend(_guard_merge(sub))
        handles.extend(_read_only_guards(manager, streamed))
        _ensure_registration_hook()
    except BaseException:
        for h in handles:
            h.remove()
        unwatch(manager)
        _WATCHED.update(watched)
        raise
    return handles


def watching(manager) -> dict:
    """{module: record} of the modules watched for `manager` (install_layer_hooks)."""
    return {mod: rec for mod, rec in list(_WATCHED.items()) if rec[0]() is manager}


def unwatch(manager, keep=()) -> None:
    """Forget the modules install_layer_hooks watched for `manager`, but those of
    the layers in `keep` (set_residency: the layers that stream after the change)."""
    keep = set(keep)
    for mod, (ref, i) in list(_WATCHED.items()):
        if ref() is manager and i not in keep:
            del _WATCHED[mod]


def _split_load_guards(manager) -> list:
    """split fetch: a load_state_dict that gives the ranks different values for the
    split layers is refused where it starts (the module it was called on, or the
    model when it is loaded as part of something larger), before anything changed:
    one collective compares them (stages/gather.py, ShareStore.check_load). The
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
        if not manager._finalized or (prefix and module is not manager.model):
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


def _read_only_guards(manager, streamed) -> list:
    """Layers whose truth cannot be written (a checkpoint file the disk tier reads):
    a load_state_dict that would change one is refused where it starts - in the
    outermost module it was called on, before any tensor was copied."""
    fixed = {id(e.param): i for i in streamed if not manager._src[i].writable
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
        if not manager._finalized:
            return
        for rel, i in inner:
            if prefix + rel in state_dict:
                manager._src[i].refuse_write()  # names the file and the way out

    return hook


def _host_alias(e, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The parameter's bytes in the arena as a tensor with a storage of its own
    (no copy), and the base it is a view of (they share one version counter):
    torch.save, safetensors and transformers treat a state dict whose tensors
    share one storage under several dtypes as shared or refuse it."""
    raw = torch.from_numpy(block.numpy()[e.offset : e.offset + e.span_bytes])
    return torch.as_strided(raw.view(e.dtype), e.shape, e.stride), raw


def _guard_save(mod, manager, owned):
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
        with manager._lock:
            if manager._finalized:
                manager.bound.check_all(manager, layers)  # (layerwise/drift.py: a rebound parameter is settled first)
            with contextlib.ExitStack() as stack:
                if wrapped and manager._finalized:
                    stack.enter_context(_bound_to_truth(manager, wrapped, destination, prefix))
                if plain and manager._finalized:
                    stack.enter_context(_plain_bound_to_truth(manager, mod, plain))
                original(destination, prefix, keep_vars)
            fix(mod, destination, prefix, None)

    _save_to_state_dict._layerwise = True
    mod.__dict__["_save_to_state_dict"] = _save_to_state_dict
    return _Unwrap(mod, ("_save_to_state_dict",))


def _true_tensor(manager, e, i, copies):
    """Entry e's true bytes (layer i) as a tensor: an alias of the arena (handed out:
    a write through it reaches the model), or a copy where the truth is elsewhere."""
    host = manager._layer_host(i)
    if host is None:
        # A copy of the true bytes (a layer on disk, say): a write into it does not
        # reach the model; load_state_dict does.
        if i not in copies:
            copies[i] = manager._read_layer(i)
        return packing.materialize(e, copies[i], "cpu")
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
        with defer_interrupts():
            for _, w, _ in wrapped:
                packing.bind_leaves([(e, truth[id(w)][e.leaf]) for e in w.entries])
        yield
    finally:
        with defer_interrupts():
            ring = manager.ring
            for attr, w, i in wrapped:
                packing.bind_layer_to_slot(w.entries, ring.slots[ring.slot_of[i]])
                if destination.get(prefix + attr) is w.param:
                    destination[prefix + attr] = quantized.rebuild(w.form, truth[id(w)])


@contextlib.contextmanager
def _plain_bound_to_truth(manager, mod, plain):
    """The plain parameters `plain` ([(attr, entry, layer index)]) of `mod` bound to
    their true bytes while the body (the module's library's own save) runs, then to
    their slot views again; one the body rebound (a library converting its layout
    back) is settled by layerwise/drift.py: its new bytes become the truth."""
    with torch.inference_mode(False):
        copies: dict = {}
        truth = [(e, i, _true_tensor(manager, e, i, copies)) for _, e, i in plain]
    try:
        with defer_interrupts():
            for e, _, t in truth:
                packing.bind_to_slot(e, t)
        yield
    finally:
        with defer_interrupts():
            ring = manager.ring
            moved: dict = {}
            for e, i, t in truth:
                if e.param.data_ptr() != t.data_ptr():
                    moved.setdefault(i, []).append(e)
                else:
                    packing.bind_to_slot(e, e.view_in(ring.slots[ring.slot_of[i]]))
            for i, entries in moved.items():
                drift.settle(manager, i, entries, f"{type(mod).__qualname__}._save_to_state_dict")


def _state_dict_hook(manager, owned):
    def hook(module, state_dict, prefix, local_metadata):
        if not manager._finalized:
            return
        with torch.inference_mode(False):  # version counters exist outside inference mode only
            copies = {}  # layers whose truth is not in host memory: read once per call
            for attr, e, i in owned:
                key = prefix + attr
                if isinstance(e, Wrapped) or key not in state_dict:  # (a wrapper: saved over its truth)
                    continue
                host = manager._layer_host(i)
                if host is None:
                    # A copy of the true bytes (a layer on disk, say): a write into it does not
                    # reach the model; load_state_dict does.
                    if i not in copies:
                        copies[i] = manager._read_layer(i)
                    state_dict[key] = e.wrap(packing.materialize(e, copies[i], "cpu"))
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
            manager._src[i].host_written()
            if manager.ring.slot_of[i] < 0:  # handed out while streamed, resident since (set_residency)
                manager._refresh_resident(i)
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
        return _on_stack(self.thread, {id(self.frame)})


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


def _load_batch_hooks(manager, owners) -> list:
    """The load hooks of the modules above those holding streamed parameters (where a
    load may begin and end for the group)."""
    handles = []
    for mod in _holders(manager, owners):
        handles.append(mod.register_load_state_dict_pre_hook(_load_pre_hook(manager, [])))
        handles.append(mod.register_load_state_dict_post_hook(_load_post_hook(manager)))
    return handles


def _batch_of(manager, missing):
    return next((b for b in manager.guard.loads if b.missing is missing), None)


def _begin_load(manager, module, missing, errors, frame) -> None:
    """A load reaches `module` (the first of the group's modules it reaches begins it)."""
    guard = manager.guard
    if _LOAD_CODE is None or not manager._finalized or _batch_of(manager, missing) is not None:
        return  # (inside a load that began above; or a torch whose load_state_dict is built otherwise:
        # every value written at once)
    frame = _torch_load_frame(module, frame)
    if frame is None:
        return
    batch = LoadBatch(module, frame, missing, errors)
    with guard.loads_lock:
        guard.loads = [b for b in guard.loads if b.live()] + [batch]
    if not manager._finalized:  # removed meanwhile (it forgot the loads before this one)
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
    return any(b.thread != me and b.live() for m in managers_of(model) for b in list(m.guard.loads))


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
    if not edits or not manager._finalized:
        return
    with torch.no_grad(), torch.inference_mode(False):
        manager.bound.check_all(manager, sorted(edits))

        def edit(block, items):
            for _, fn in items:
                fn(block)

        for i in sorted(edits):
            try:
                with defer_interrupts():
                    manager._write_layer(i, functools.partial(edit, items=edits[i]))
                    if manager.ring.slot_of[i] < 0:  # made resident since (set_residency on another thread)
                        manager._refresh_resident(i)
            except stages.gather.SplitError:
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
            manager._write_layer(i, edit)
        except stages.gather.SplitError:
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


def _load_pre_hook(manager, owned):
    """The group's load pre-hook of a module: where a load begins for the group, and
    where the values of the streamed parameters the module holds (`owned`) are taken."""
    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        _begin_load(manager, module, missing_keys, error_msgs, sys._getframe(1))
        if not owned:
            return
        assign = local_metadata.get("assign_to_params_buffers", False)
        with manager._lock, torch.no_grad(), torch.inference_mode(False):
            if not manager._finalized:  # (checked under the lock: removed meanwhile, torch copies as usual)
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
    the outermost call: _quantized_load_guards): a wrapper under its key (torchao)
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


def _quantized_load_guards(manager, streamed) -> list:
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
        if not manager._finalized or (prefix and module is not manager.model):
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
                        w, k, f"it is {theirs.dtype}{list(theirs.shape)}, the model's is {mine.dtype}{list(mine.shape)}"))

    return hook


def _load_post_hook(manager):
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
                with manager._lock:
                    write_loaded(manager, batch)
            finally:
                _end_load(manager, batch)

    return hook


@contextlib.contextmanager
def editing(manager, i: int):
    """Layer i's true weights in place (its slot, loaded and kept) while the body
    runs; afterwards whatever the body wrote (in place, or by rebinding a
    parameter's .data) goes back into the arena."""
    lp = manager.plan.layers[i]
    ring = manager.ring
    s = ring.slot_of[i]
    with manager._lock, torch.no_grad():
        if s >= 0 and not manager._src[i].writable:
            manager._src[i].refuse_write()  # refused before the body runs: names the file and the way out
        if s >= 0:
            manager.bound.check_all(manager, [i])
            manager._wait_ready(i)
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
                        packing.assign([(e, view)])
                if s >= 0:
                    if manager.device.type == "cuda":
                        torch.cuda.current_stream(manager.device).synchronize()
                    manager._write_layer(i, lambda block: block.copy_(ring.dst[i]))
                    ring.kept(i, manager._src[i].version())  # the slot holds the edited bytes already
            except BaseException:
                if s >= 0:
                    ring.forget(i)  # the slot may hold bytes the truth does not: reload
                raise
            finally:
                if s >= 0:
                    ring.unpin(i)


# peft's tuner layers (LoRA & co.) merge adapters into the base weight through
# `.data`, which no version counter sees: run merge/unmerge inside `editing`.
_WATCHED: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()
_REGISTRATION_HOOK = []


def _is_tuner_layer(mod) -> bool:
    return all(callable(getattr(mod, n, None)) for n in ("merge", "unmerge", "get_base_layer"))


class _Unwrap:
    def __init__(self, mod, names):
        self.mod, self.names = weakref.ref(mod), names

    def remove(self):
        mod = self.mod()
        if mod is not None:
            for n in self.names:
                mod.__dict__.pop(n, None)


def _guard_merge(mod) -> list:
    if not _is_tuner_layer(mod) or getattr(mod.__dict__.get("merge"), "_layerwise", False):
        return []
    for name in ("merge", "unmerge"):
        method = getattr(type(mod), name)

        @functools.wraps(method)
        def guarded(*args, _method=method, _mod=mod, **kwargs):
            owner = _WATCHED.get(_mod)
            manager = owner[0]() if owner else None
            if manager is None or not manager._finalized:
                return _method(_mod, *args, **kwargs)
            with editing(manager, owner[1]):
                return _method(_mod, *args, **kwargs)

        guarded._layerwise = True
        mod.__dict__[name] = guarded
    return [_Unwrap(mod, ("merge", "unmerge"))]


def _on_register(parent, name, sub):
    """A module registered inside a streamed layer after configure (peft's
    add_adapter / inject_adapter does that): watch it and guard its merges."""
    owner = _WATCHED.get(parent)
    if owner is None or sub is None:
        return None
    manager = owner[0]()
    if manager is None or not manager._finalized:
        return None
    for m in sub.modules():
        _WATCHED[m] = owner
        manager.add_hooks(_guard_merge(m))
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


def _ensure_registration_hook() -> None:
    if not _REGISTRATION_HOOK:
        from torch.nn.modules.module import register_module_module_registration_hook

        _REGISTRATION_HOOK.append(register_module_module_registration_hook(_on_register))


# ------------------------------------------------------------------ backward
class _SlotRef:
    __slots__ = ("tensor", "ring", "slot", "gen", "layer", "version", "slot_ptr", "slot_bytes", "__weakref__")

    def __init__(self, tensor, ring, slot, gen, layer, version):
        self.tensor, self.ring, self.slot, self.gen, self.layer, self.version = tensor, ring, slot, gen, layer, version
        base = ring.slots[slot]  # (a ring replaced since, set_residency, no longer names it)
        self.slot_ptr, self.slot_bytes = base.untyped_storage().data_ptr(), base.numel()


def _slot_of(ring, t):
    """The ring slot a saved tensor's bytes live in, or None: a plain tensor by its
    storage, a quantized wrapper (formats/quantized.py) by its leaves' (a library's
    autograd function may save the weight wrapper itself: quanto's does)."""
    if type(t) in (torch.Tensor, nn.Parameter):
        return ring.ptrs.get(t.untyped_storage().data_ptr())
    if quantized.is_wrapper(t):
        for leaf in quantized.leaf_tensors(t).values():
            s = ring.ptrs.get(leaf.untyped_storage().data_ptr())
            if s is not None:
                return s
    return None


class _Graph:
    """A layer forward under grad mode: pending until a backward through its output
    has finished. It lives as long as that output's graph (a hook of a node of it
    holds it), so a graph dropped without its backward takes it along."""

    __slots__ = ("done", "__weakref__")

    def __init__(self):
        self.done = False

    def finish(self) -> None:
        self.done = True


def _grad_fns(output) -> list:
    """The autograd nodes of the tensors a layer returned (a tensor, or tuples,
    lists and dicts of them: a model output); a few suffice."""
    out, todo = [], [output]
    while todo and len(out) < 8:
        o = todo.pop()
        if isinstance(o, torch.Tensor):
            if o.grad_fn is not None:
                out.append(o.grad_fn)
        elif isinstance(o, (tuple, list)):
            todo.extend(o)
        elif isinstance(o, dict):
            todo.extend(o.values())
    return out


def track_backward(manager, output) -> None:
    """A layer of `manager` returned `output` under grad mode. Its graph may use the
    group's parameters without saving them (`x + self.shift`: an AccumulateGrad node
    holds the parameter itself), which saved_slot_hooks never sees: a placement change
    swaps those parameters (torch.utils.swap_tensors), and torch then fails the
    backward ("AccumulateGrad node that was poisoned by swap_tensors"), or, where the
    swap lands in the middle of a backward on another thread, leaves their gradients
    unset. So the group counts the graph as pending (GroupGuard.backward_pending)
    until a backward through the output has finished: a hook on the output's node
    queues a callback that the autograd engine runs once the whole backward is done,
    so no change gets in while any part of it runs. Recorded under the model's lock,
    which set_residency holds for its check and its swap."""
    fns = _grad_fns(output)
    if not fns:
        return
    graph = _Graph()

    def started(grad_outputs):
        torch.autograd.Variable._execution_engine.queue_callback(graph.finish)

    for fn in fns:
        fn.register_prehook(started)
    manager.guard.graphs.add(graph)


def saved_slot_hooks(manager):
    """Autograd saved-tensor hooks for one streamed layer's forward: a tensor
    saved from a ring slot is given back as it was even if the slot has been
    refilled since (its layer's bytes are read back from the arena)."""

    def pack(t):
        s = _slot_of(manager.ring, t) if t.device == manager.device else None
        if s is None:
            # Not ours: kept as autograd would keep it, but never with its grad_fn: an op that
            # saves its own output (tanh, softmax) would hold its node through the output,
            # a cycle through C++ that no collector frees (a graph dropped without its
            # backward would never be). Unpacking puts the grad_fn back.
            return t.detach() if t.grad_fn is not None else t
        ring = manager.ring
        i = ring.holder[s]
        ref = _SlotRef(t, ring, s, ring.gen[s], i, ring.layer_gen[i])
        manager.guard.saved.add(ref)
        return ref

    def unpack(ref):
        if type(ref) is not _SlotRef:
            return ref
        if manager._finalized and manager.guard.handed_out:
            check_handed_out(manager)  # a write through state_dict() since the forward
        if manager._finalized and manager.ring is ref.ring and manager.ring.gen[ref.slot] == ref.gen:
            return ref.tensor
        if not manager._finalized or manager.ring.layer_gen[ref.layer] != ref.version:
            raise RuntimeError(
                f"layerwise: backward needs the weights of {manager.layer_name}[{ref.layer}] as they were in "
                "the forward, but they were changed (load_state_dict) or the model was un-offloaded since. "
                "Run forward and backward without changing the weights in between."
            )
        t = ref.tensor
        block = manager._read_layer(ref.layer)
        fresh = torch.empty(ref.slot_bytes, dtype=torch.uint8, device=manager.device)
        fresh[: block.numel()].copy_(block)

        def again(x):  # x as it was, over `fresh` where it was a view of the slot
            if x.untyped_storage().data_ptr() != ref.slot_ptr:
                return x
            out = torch.empty(0, dtype=x.dtype, device=manager.device)
            return out.set_(fresh.untyped_storage(), x.storage_offset(), x.size(), x.stride())

        if quantized.is_wrapper(t):
            return quantized.rebuild(quantized.structure(t),
                                     {path: again(x) for path, x in quantized.leaf_tensors(t).items()})
        return again(t)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
