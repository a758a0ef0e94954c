"""What torch.compile's dynamo must see of a streamed model, without importing dynamo.

[Note: streaming subclass] (undone by `unmark_streamed` at removal) dynamo does not guard on a module's hooks
(`torch._dynamo.config.skip_nnmodule_hook_guards`, on by default): a graph traced
through a block that had no hooks (the same block compiled before configure, or any
other instance of its class, compiled before or after) would run for the streamed
block without the hooks that place its weights in its slot. dynamo does guard on the
type of every module it traces through or is called on, so a streamed block gets a
class of its own while it streams: a subclass of its class that adds nothing (same
name, module and methods; torch.nn.utils.parametrize swaps classes the same way), one
per class so that the blocks of a group share their graphs. A graph traced without
streaming then fails its guards on a streamed block, and one traced with streaming
fails them after removal, whatever the order of configure and compile, and nothing
else compiled in the process is touched. Resetting dynamo's code caches at configure
instead would discard every compiled graph of the process and still miss a twin of
the same class compiled after the configure. Where dynamo specializes graphs on
module instances instead (torch 2.4), it guards their ids, not their classes: there
configure and removal drop its code caches (`drop_instance_graphs`).

[Note: dynamo import hook] (undone by itself: the finder leaves `sys.meta_path` once
torch._dynamo is imported) The hooks run eagerly under torch.compile
(torch.compiler.disable: the graph breaks at a hook and resumes, with no recompile
per layer or step), but torch.compiler.disable imports torch._dynamo (144 MiB of host
memory, torch 2.13 CPU on x86-64). Until torch._dynamo is imported nothing can be
compiled, so a hook is registered plain and wrapped in place (same handle id, order
and flags) when torch._dynamo is imported, before anything can be traced: an import
hook on torch._dynamo runs the wrapping at the end of its import.
"""
from __future__ import annotations

import sys
import threading
import weakref

import torch
from torch import nn

_DYNAMO = "torch._dynamo"
_PLAIN = "_layerwise_plain_class"  # on a streamed class: the class it stands in for

_lock = threading.RLock()  # (reentrant: user code run under it may import torch._dynamo)
_streamed_classes: dict[type, type] = {}
_plain_hooks: list = []  # (hooks dict weakref, handle id, hook weakref) registered before dynamo was imported
_kept_after_prune = 0


# ------------------------------------------------------------------ classes
def mark_streamed(module: nn.Module) -> None:
    """Give `module` its class's streamed twin class (undone by `unmark_streamed`)."""
    cls = type(module)
    if _PLAIN in cls.__dict__:
        return
    with _lock:
        streamed = _streamed_classes.get(cls)
        if streamed is None:
            streamed = type(cls)(cls.__name__, (cls,), {
                "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__, _PLAIN: cls})
            _streamed_classes[cls] = streamed
    module.__class__ = streamed


def unmark_streamed(module: nn.Module) -> None:
    plain = type(module).__dict__.get(_PLAIN)
    if plain is not None:
        module.__class__ = plain


def drop_instance_graphs() -> None:
    """Where dynamo specializes graphs on module instances (torch 2.4, or
    `inline_inbuilt_nn_modules=False` before it was always on), it guards a module's
    id, not its class: a graph compiled for this very model before its hooks changed
    would run again. dynamo cannot drop the graphs of one instance: drop its code caches
    (every compiled function recompiles at its next call). Nothing compiled where
    torch._dynamo was never imported."""
    dynamo = sys.modules.get(_DYNAMO)
    if dynamo is not None and _specializes_instances(dynamo):
        dynamo.reset_code_caches()


def _specializes_instances(dynamo) -> bool:
    # (get_config_copy: reading the option itself warns where it is deprecated)
    return not dynamo.config.get_config_copy().get("inline_inbuilt_nn_modules", False)


# -------------------------------------------------------------------- hooks
def register_hook(register, hook, **kwargs):
    """`register(hook, **kwargs)` (a module's register_forward_pre_hook or
    register_forward_hook), with `hook` run eagerly under torch.compile. Returns the handle."""
    with _lock:
        if _DYNAMO not in sys.modules:
            if _FINDER not in sys.meta_path:  # (torch._dynamo was imported, then taken out of sys.modules)
                sys.meta_path.insert(0, _FINDER)
            handle = register(hook, **kwargs)
            _plain_hooks.append((handle.hooks_dict_ref, handle.id, weakref.ref(hook)))
            if _DYNAMO in sys.modules and _FINDER not in sys.meta_path:  # the registration itself imported it
                _dynamo_imported()
            _prune()
            return handle
    return register(torch.compiler.disable(hook), **kwargs)


def _prune() -> None:
    """Forget removed hooks (amortised: the list is rebuilt when it has doubled)."""
    global _kept_after_prune
    if len(_plain_hooks) < 2 * _kept_after_prune + 64:
        return
    _plain_hooks[:] = [e for e in _plain_hooks if _registered(*e) is not None]
    _kept_after_prune = len(_plain_hooks)


def _registered(dict_ref, key, hook_ref):
    """(the hooks dict, the hook) while the hook is still registered, else None."""
    hooks, hook = dict_ref(), hook_ref()
    return (hooks, hook) if hooks is not None and hook is not None and hooks.get(key) is hook else None


def mark_static(t: torch.Tensor) -> None:
    """Tell dynamo that `t` (a hook operator's token or fence, runtime/ops.py) keeps
    its address across calls, so that the CUDA graphs of torch.compile neither copy
    it into a static buffer at each replay nor refuse a graph that declares a write
    to it. Unguarded: one graph serves every block of a class. Before torch._dynamo
    is imported, marked at its import (the import hook above)."""
    with _lock:
        if _DYNAMO not in sys.modules:
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            _static_pending.append(weakref.ref(t))
            return
    sys.modules[_DYNAMO].mark_static_address(t, guard=False)


_static_pending: list = []


def _dynamo_imported() -> None:
    with _lock:
        pending = _plain_hooks[:]
        _plain_hooks.clear()
        statics = [t for t in (r() for r in _static_pending) if t is not None]
        _static_pending.clear()
        if _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
    # (torch.compiler.disable is this, reached through the `torch` package: inside the
    # import, the package may not have its attribute yet)
    dynamo = sys.modules[_DYNAMO]
    for t in statics:
        dynamo.mark_static_address(t, guard=False)
    disable = dynamo.disable
    for dict_ref, key, hook_ref in pending:
        found = _registered(dict_ref, key, hook_ref)
        if found is not None:
            hooks, hook = found
            hooks[key] = disable(hook)


class _WrapAfterImport:
    """torch._dynamo's own loader, which wraps the plain hooks once the module has run."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self.loader
        _dynamo_imported()

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _DynamoImportFinder:
    """A sys.meta_path entry that only answers for torch._dynamo, with the spec the
    other finders give and a loader that wraps the plain hooks after the import."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _DYNAMO:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _WrapAfterImport(spec.loader)
                return spec
        return None


_FINDER = _DynamoImportFinder()
# Installed with layerwise itself (while torch._dynamo is not imported): an import of it
# on another thread can then never slip between a hook's registration and the finder.
if _DYNAMO not in sys.modules:
    sys.meta_path.insert(0, _FINDER)
