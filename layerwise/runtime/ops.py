"""The hooks' effect as torch operators, so that torch.compile traces a streamed
model whole (docs/compile.md).

A streamed layer's forward pre-hook and forward hook, and the model's root hooks,
are plain functions that dynamo traces. Eager, they call the group's own methods
(`enter_layer`, `leave_layer`: the kernels of the operators below). Traced, they
put one operator in the graph at each end of the module:

    layerwise::layer_ready(Tensor(a!) fence, Tensor token, Tensor(b!)[] inputs)
    layerwise::layer_done(Tensor(a!) fence, Tensor token, Tensor(b!)[] outputs)
    layerwise::step_begin / layerwise::step_end (the model's root hooks, same schema)

and the compiled code calls the same kernels at run time. Two more:

    layerwise::experts_ready(Tensor(a!) fence, Tensor token, Tensor(b!)[] inputs, bool routed)
        an expert module's pre-hook (experts="routed": runtime/expert_hooks.py),
        with the routing first among its inputs: its kernel copies the experts the
        router picked, so the data-dependent fetch is one opaque call, no graph break;
    layerwise::refuse(Tensor(a!) fence, Tensor token, str message)
        put in the graph instead of layer_ready / layer_done where the compiled
        forward would build a backward through a streamed layer; its kernel raises
        the message (see _grad_refusal).

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
_ROUTING = "_layerwise_routing"  # an expert module's (position, keyword) of its routing argument

_LIB = torch.library.Library("layerwise", "DEF")
_OPS = ("layer_ready", "layer_done", "step_begin", "step_end")
for _name in _OPS:
    _LIB.define(f"{_name}(Tensor(a!) fence, Tensor token, Tensor(b!)[] tensors) -> ()")
_LIB.define("experts_ready(Tensor(a!) fence, Tensor token, Tensor(b!)[] tensors, bool routed) -> ()")
_LIB.define("refuse(Tensor(a!) fence, Tensor token, str message) -> ()")

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


def _experts_kernel(fence: torch.Tensor, token: torch.Tensor, tensors: list, routed: bool) -> None:
    _module_of(token).__dict__[_ENTRY](tensors[0] if routed else None)


def _refuse_kernel(fence: torch.Tensor, token: torch.Tensor, message: str) -> None:
    raise RuntimeError(message)


def _fake_experts(fence, token, tensors, routed) -> None:
    return None


def _fake_refuse(fence, token, message) -> None:
    return None


for _name in _OPS:
    _LIB.impl(_name, _kernel(_name in ("layer_ready", "step_begin")), "CompositeExplicitAutograd")
    torch.library.register_fake(f"layerwise::{_name}", _fake, lib=_LIB)
_LIB.impl("experts_ready", _experts_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("layerwise::experts_ready", _fake_experts, lib=_LIB)
_LIB.impl("refuse", _refuse_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("layerwise::refuse", _fake_refuse, lib=_LIB)


# ------------------------------------------------------------------ traced side
def _tensors(tree) -> list:
    """The distinct activation tensors of `tree` (parameters left out: they are slot
    views, see the note)."""
    out: list = []
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and not any(t is u for u in out):
            out.append(t)
    return out


def _grad_refusal(module, tensors: list, what: str) -> str | None:
    """The error of a compiled forward that would build a backward through a streamed
    layer (`tensors`: its inputs or outputs), or None.

    [Note: grad under compile] The compiled backward would read the weights it saved
    from ring slots that later layers refilled (eager, saved-tensor hooks read them
    back; a compiled graph saves them at its end, outside every layer): wrong
    gradients, whether the parameters or only the activations require grad. The
    error is raised at run time by layerwise::refuse, not while dynamo traces: an
    exception raised in traced code makes dynamo wrap it (fullgraph) or fall back
    to eager frame by frame and trace into the manager (default)."""
    if not torch.is_grad_enabled():
        return None
    if any(p.requires_grad for p in module.parameters()):
        cause = "its parameters require grad"
    elif any(t.requires_grad for t in tensors):
        cause = f"its {what} require grad"
    else:
        return None
    return (f"layerwise: a compiled forward of a streamed layer with grad enabled ({type(module).__name__}: {cause}): "
            "the compiled backward would read weights from ring slots that later layers refill. Run the compiled "
            "model under torch.no_grad() or torch.inference_mode(), or freeze it (model.requires_grad_(False)) "
            "and pass inputs that do not require grad; a backward through a streamed model runs eagerly "
            "(uncompiled).")


def _traced_layer(module, tensors: list, what: str, op) -> None:
    """One end of a traced layer: `op` (layer_ready or layer_done) with the module's
    fence, token and `tensors` (its `what`: inputs or outputs), or layerwise::refuse
    where the compiled forward would build a backward through the layer."""
    refusal = _grad_refusal(module, tensors, what)
    if refusal is not None:
        torch.ops.layerwise.refuse(getattr(module, FENCE), getattr(module, TOKEN), refusal)
    else:
        op(getattr(module, FENCE), getattr(module, TOKEN), tensors)


def _layer_pre(module, args, kwargs):
    if torch.compiler.is_compiling():
        _traced_layer(module, _tensors((args, kwargs)), "inputs", torch.ops.layerwise.layer_ready)
        return None
    return module.__dict__[_ENTRY][0](args)


def _layer_post(module, args, kwargs, output):
    if torch.compiler.is_compiling():
        _traced_layer(module, _tensors(output), "outputs", torch.ops.layerwise.layer_done)
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
        module.__dict__.pop(_ROUTING, None)
        if token is not None:
            with _lock:
                if (ref := _entries.get(token.data_ptr())) is not None and ref() in (module, None):
                    del _entries[token.data_ptr()]


def _routing_of(module, args, kwargs):
    pos, name = module.__dict__[_ROUTING]
    if name in kwargs:
        return kwargs[name]
    return args[pos] if pos < len(args) else None


def _experts_pre(module, args, kwargs):
    routing = _routing_of(module, args, kwargs)
    if torch.compiler.is_compiling():
        tensors = _tensors((args, kwargs))
        routed = isinstance(routing, torch.Tensor)
        if routed:  # first, where the kernel finds it
            tensors = [routing] + [t for t in tensors if t is not routing]
        torch.ops.layerwise.experts_ready(getattr(module, FENCE), getattr(module, TOKEN), tensors, routed)
        return None
    module.__dict__[_ENTRY](routing if isinstance(routing, torch.Tensor) else None)
    return None


def _register(module: nn.Module, device, entry) -> torch.Tensor:
    token = torch.zeros(1, dtype=torch.uint8, device=device)
    compile_guard.mark_static(token)
    module.__dict__[TOKEN] = token
    module.__dict__[FENCE] = _fence(device)
    module.__dict__[_ENTRY] = entry
    with _lock:
        _entries[token.data_ptr()] = weakref.ref(module)
    return token


def install_experts(module: nn.Module, ready, routing: tuple, device) -> Installed:
    """A pre-hook on the expert module `module` that calls `ready(the routing
    tensor, or None where the forward got none)` before its forward, eagerly; where
    torch.compile traces it, layerwise::experts_ready, whose kernel calls `ready`
    with the routing the graph computed. `routing`: (position in the forward's
    arguments after self, keyword name), kept on the module as constants, so that
    one graph serves every expert module of a class. The pre-hook goes first."""
    device = torch.device(device)
    module.__dict__[_ROUTING] = tuple(routing)
    _register(module, device, ready)
    return Installed(module, [_fixed_id(module.register_forward_pre_hook(_experts_pre, prepend=True, with_kwargs=True),
                                        EXPERTS_ID, first=True)])


def install(module: nn.Module, enter, leave, leave_compiled, device, root: bool = False) -> Installed:
    """Hooks on `module` that call `enter(args)` before its forward and
    `leave(output)` after it (also when it raises: `always_call`; its return value
    replaces the output), eagerly; where torch.compile traces the module, the
    matching operators, whose kernels call `enter(None)` and `leave_compiled(the
    output's tensors)`. The pre-hook goes first (prepend)."""
    device = torch.device(device)
    _register(module, device, (enter, leave, leave_compiled))
    pre, post = (_root_pre, _root_post) if root else (_layer_pre, _layer_post)
    handles = [_fixed_id(module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True), PRE_ID, first=True),
               _fixed_id(module.register_forward_hook(post, with_kwargs=True, always_call=True), POST_ID)]
    return Installed(module, handles)


# [Note: fixed hook ids] torch keys a module's hooks by a process-wide counter, and
# dynamo, tracing a module call, guards on `id in module._forward_hooks_always_called`
# (and `..._with_kwargs`) with that number: every streamed model would compile a
# graph of its own, and the ninth instance of a class would hit dynamo's recompile
# limit (measured: torch 2.13, torch.compile(model, fullgraph=True) of 10 models).
# Our hooks take one fixed key per kind on every module instead (negative: torch's
# counter never gives one), so one graph serves every instance of a class.
PRE_ID, POST_ID, EXPERTS_ID = -0x1A7E, -0x1A7F, -0x1A80


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
