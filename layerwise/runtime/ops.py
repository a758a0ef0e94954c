"""The hooks' effect as torch operators, so that torch.compile traces a streamed
model whole (docs/compile.md).

A streamed layer's forward pre-hook and forward hook, and the model's root hooks,
are plain functions that dynamo traces. Eager, they call the group's own methods
(`enter_layer`, `leave_layer`: the kernels of the operators below). Traced, they
put one operator in the graph at each end of the module:

    layerwise::layer_ready(Tensor(a!) fence, Tensor token, Tensor(b!)[] inputs)
    layerwise::layer_done(Tensor(a!) fence, Tensor token, Tensor(b!)[] outputs)
    layerwise::step_begin / layerwise::step_end (the model's root hooks, same schema)

and the compiled code calls the same kernels at run time.

[Note: ordering by declared mutation] The operators declare that they write the
module's input tensors (ready) and output tensors (done), and one fence tensor
per device that every operator writes. They change none of them: the
declarations are what keeps the compiler's order. Every computation of the
layer reads its inputs, so it runs after `layer_ready` (a read after a write);
`layer_done` writes what the layer computed, so it runs after all of it; the
fence chains every ready and done of a graph in program order, whatever reads
what. The parameters themselves are not declared: they are views of one ring
slot, and a mutation declared on inputs that share storage makes AOTAutograd
replace them with a synthetic base and inductor run the layer on a clone of its
weights (measured: torch 2.13, every streamed weight cloned each step). A
computation that reads a weight and no activation (a dequantize of the weight
alone) is ordered by inductor's topological order, not by a dependency; the
tests check that such blocks stay exact.

The eager hooks do not call the operators: a declared mutation bumps the version
counters of the activations, which autograd would then refuse in a backward.

The token (one byte on the group's device, stored on the module) names the
module: the graph reads it from the module on every call, so one graph compiled
for a block class serves every block of that class (per-block compile) with no
constant that differs between blocks, and the kernel finds the hooks from the
token's address.
"""
from __future__ import annotations

import threading
import weakref

import torch
import torch.utils._pytree as pytree
from torch import nn

from layerwise.contract import compile_guard

TOKEN = "_layerwise_token"
FENCE = "_layerwise_fence"
_ENTRY = "_layerwise_entry"

_LIB = torch.library.Library("layerwise", "DEF")
_OPS = ("layer_ready", "layer_done", "step_begin", "step_end")
for _name in _OPS:
    _LIB.define(f"{_name}(Tensor(a!) fence, Tensor token, Tensor(b!)[] tensors) -> ()")

_lock = threading.Lock()
_entries: dict[int, weakref.ref] = {}  # token address -> the module that holds it
_fences: dict[torch.device, torch.Tensor] = {}


def _fence(device: torch.device) -> torch.Tensor:
    with _lock:
        fence = _fences.get(device)
        if fence is None:
            fence = _fences[device] = torch.zeros(1, dtype=torch.uint8, device=device)
            compile_guard.mark_static(fence)
        return fence


def _module_of(token: torch.Tensor) -> nn.Module:
    ref = _entries.get(token.data_ptr())
    module = ref() if ref is not None else None
    if module is None or module.__dict__.get(TOKEN) is None:
        raise RuntimeError(
            "layerwise: a compiled graph or an exported program called the hooks of a module that no longer "
            "streams in this process (it was traced while the module streamed). torch.compile: call "
            "torch._dynamo.reset() and compile again. torch.export: an exported program of a streamed model runs "
            "only while that model streams, in the process that exported it (its weights are ring slots); export "
            "the model after remove_layerwise_offload for a program that stands alone.")
    return module


def _kernel(entering: bool):
    def kernel(fence: torch.Tensor, token: torch.Tensor, tensors: list) -> None:
        entry = _module_of(token).__dict__[_ENTRY]
        if entering:
            entry[0](None)
        else:
            entry[2](tensors)
    return kernel


def _fake(fence, token, tensors) -> None:
    return None


for _name in _OPS:
    _LIB.impl(_name, _kernel(_name in ("layer_ready", "step_begin")), "CompositeExplicitAutograd")
    torch.library.register_fake(f"layerwise::{_name}", _fake, lib=_LIB)


# ------------------------------------------------------------------ traced side
def _tensors(tree) -> list:
    """The distinct activation tensors of `tree` (parameters left out: they are slot
    views, see the note)."""
    out: list = []
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and not any(t is u for u in out):
            out.append(t)
    return out


def _refuse_grad(module, inputs) -> None:
    """A traced layer that a backward would run through: its compiled backward would
    read the layer's weights (to compute its inputs' gradients too, where the weights
    themselves are frozen) from a ring slot that later layers refill; and the write
    that layer_ready declares on its inputs bumps their version counters, which
    autograd then refuses."""
    if not torch.is_grad_enabled():
        return
    if any(p.requires_grad for p in module.parameters()):
        what = "with grad enabled"
    elif any(t.requires_grad for t in inputs):
        what = "with grad enabled and an input that requires grad (a backward through its frozen layers)"
    else:
        return
    raise RuntimeError(
        f"layerwise: torch.compile of a streamed model traced {what}: the compiled backward would "
        "read weights from ring slots that later layers refill. Run the compiled model under "
        "torch.no_grad() or torch.inference_mode() (or model.requires_grad_(False) and inputs that do not "
        "require grad); a backward through a streamed model runs eagerly.")


def _layer_pre(module, args, kwargs):
    if torch.compiler.is_compiling():
        inputs = _tensors((args, kwargs))
        _refuse_grad(module, inputs)
        torch.ops.layerwise.layer_ready(getattr(module, FENCE), getattr(module, TOKEN), inputs)
        return None
    return module.__dict__[_ENTRY][0](args)


def _layer_post(module, args, kwargs, output):
    if torch.compiler.is_compiling():
        torch.ops.layerwise.layer_done(getattr(module, FENCE), getattr(module, TOKEN), _tensors(output))
        return None
    return module.__dict__[_ENTRY][1](output)


# The root operators take no activations: the fence orders them before and after every
# layer's, which is all a step needs; and where torch.compile(model) runs the root hooks
# as frames of their own (outside the forward's graph), a graph that names no activation
# is not compiled again for each input shape.
def _root_pre(module, args, kwargs):
    if torch.compiler.is_compiling():
        torch.ops.layerwise.step_begin(getattr(module, FENCE), getattr(module, TOKEN), [])
        return None
    return module.__dict__[_ENTRY][0](args)


def _root_post(module, args, kwargs, output):
    if torch.compiler.is_compiling():
        torch.ops.layerwise.step_end(getattr(module, FENCE), getattr(module, TOKEN), [])
        return None
    return module.__dict__[_ENTRY][1](output)


# ------------------------------------------------------------------ install
class Installed:
    """The hooks of one module and its token; `remove()` takes all of it away."""

    def __init__(self, module: nn.Module, handles: list):
        self._module = weakref.ref(module)
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        module = self._module()
        if module is None:
            return
        token = module.__dict__.pop(TOKEN, None)
        module.__dict__.pop(FENCE, None)
        module.__dict__.pop(_ENTRY, None)
        if token is not None:
            with _lock:
                if (ref := _entries.get(token.data_ptr())) is not None and ref() in (module, None):
                    del _entries[token.data_ptr()]


def install(module: nn.Module, enter, leave, leave_compiled, device, root: bool = False) -> Installed:
    """Hooks on `module` that call `enter(args)` before its forward and
    `leave(output)` after it (also when it raises: `always_call`; its return value
    replaces the output), eagerly; where torch.compile traces the module, the
    matching operators, whose kernels call `enter(None)` and `leave_compiled(the
    output's tensors)`. The pre-hook goes first (prepend)."""
    device = torch.device(device)
    token = torch.zeros(1, dtype=torch.uint8, device=device)
    compile_guard.mark_static(token)
    module.__dict__[TOKEN] = token
    module.__dict__[FENCE] = _fence(device)
    module.__dict__[_ENTRY] = (enter, leave, leave_compiled)
    with _lock:
        _entries[token.data_ptr()] = weakref.ref(module)
    pre, post = (_root_pre, _root_post) if root else (_layer_pre, _layer_post)
    handles = [_fixed_id(module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True), PRE_ID, first=True),
               _fixed_id(module.register_forward_hook(post, with_kwargs=True, always_call=True), POST_ID)]
    return Installed(module, handles)


# [Note: fixed hook ids] torch keys a module's hooks by a process-wide counter, and
# dynamo, tracing a module call, guards on `id in module._forward_hooks_always_called`
# (and `..._with_kwargs`) with that number: every streamed model would compile a
# graph of its own, and the ninth instance of a class would hit dynamo's recompile
# limit (measured: torch 2.13, torch.compile(model, fullgraph=True) of 10 models).
# Our two hooks take the same two keys on every module instead (negative: torch's
# counter never gives one), so one graph serves every instance of a class.
PRE_ID, POST_ID = -0x1A7E, -0x1A7F


def _fixed_id(handle, key: int, first: bool = False):
    """Move the hook `handle` registered under its counter id to `key`, in the same
    place of the module's hook dicts (`first`: at the front, as prepend put it)."""
    for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
        d = ref()
        if d is not None and handle.id in d:
            if key in d:
                raise RuntimeError("layerwise: internal: a module with layerwise's hooks twice")
            d[key] = d.pop(handle.id)
            if first and ref is handle.hooks_dict_ref:
                d.move_to_end(key, last=False)
    handle.id = key
    return handle
