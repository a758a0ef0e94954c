"""detect_layer_groups: find a model's block lists, the groups that
configure_layerwise_offload(model, "auto") streams.

A group is an nn.ModuleList / nn.Sequential (at any depth) whose children are
at least two blocks of one class, that holds at least `min_fraction` of the
model's parameter bytes, and that does not sit inside another chosen group (the
outermost list wins: a list of sub-blocks inside each block is not a group).

Groups come back in execution order, the order in which the first block of each
list runs. Without example inputs that order is approximated by declaration
order (named_modules()); with `example_inputs=(args, kwargs)` one forward pass
records it with forward pre-hooks on each group's first block, stopping as soon
as every group has been entered. A model built on the meta device (e.g. under
`with torch.device("meta")`) with meta example inputs is enough for that: no
weights need exist and nothing is computed. The pass runs in eval mode under
no_grad with the CPU RNG forked; training flags and buffer objects are put back
and the hooks removed, even on error.

A list whose blocks are not all of one class (a hybrid stack of two layer
types) is not a group: name such lists explicitly in layer_names.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from layerwise.planning.layout import local_tensor

log = logging.getLogger("layerwise")


class _AllGroupsEntered(BaseException):
    """Raised from a pre-hook to cut the recording forward short (a BaseException,
    so that a model's own `except Exception` around its blocks does not swallow it)."""


def _param_bytes(module: nn.Module) -> int:
    """Local bytes of the distinct parameters under `module` (tied ones once)."""
    total = 0
    for p in module.parameters():  # parameters() already skips duplicates
        t = local_tensor(p)
        total += t.numel() * t.element_size()
    return total


def _is_block_list(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    children = list(module.children())
    if len(children) < 2 or len(children) != len(module):
        return False  # fewer than two blocks, or a None entry
    cls = type(children[0])
    return all(type(c) is cls for c in children)


def _split_example_inputs(example_inputs) -> tuple[tuple, dict]:
    if not isinstance(example_inputs, Sequence) or isinstance(example_inputs, (str, bytes)) or len(example_inputs) != 2:
        raise TypeError(
            "example_inputs must be a pair (args, kwargs), e.g. ((x,), {'timestep': t}), "
            f"got {type(example_inputs).__name__}"
        )
    args, kwargs = example_inputs
    if args is None:
        args = ()
    elif isinstance(args, list):
        args = tuple(args)
    elif not isinstance(args, tuple):
        args = (args,)
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"example_inputs[1] must be a dict of keyword arguments, got {type(kwargs).__name__}")
    return args, dict(kwargs)


def _execution_order(model: nn.Module, groups: dict[str, nn.Module], example_inputs) -> dict[str, int]:
    """Rank of each group in one forward pass (groups never entered are absent)."""
    args, kwargs = _split_example_inputs(example_inputs)
    order: dict[str, int] = {}
    handles = []

    def make_hook(path: str):
        def hook(module, hook_args):
            if path not in order:
                order[path] = len(order)
                if len(order) == len(groups):
                    raise _AllGroupsEntered
        return hook

    # Leave the model as it was: eval() for the pass (no dropout, no running-stat
    # updates), training flags and buffer objects put back, global RNG state forked.
    training = [(m, m.training) for m in model.modules()]
    buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items()]
    try:
        for path, module_list in groups.items():
            first = next(iter(module_list.children()))
            handles.append(first.register_forward_pre_hook(make_hook(path)))
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            try:
                model(*args, **kwargs)
            except _AllGroupsEntered:
                pass
    finally:
        for h in handles:
            h.remove()
        for m, flag in training:
            m.training = flag
        for m, name, b in buffers:
            if m._buffers.get(name) is not b:
                m._buffers[name] = b
    return order


def detect_layer_groups(model: nn.Module, min_fraction: float = 0.05, example_inputs=None) -> list[str]:
    """Dotted paths of the block lists of `model`, in execution order.

    min_fraction: the least share of the model's parameter bytes a list must hold.
    example_inputs: optional (args, kwargs) for one forward pass under no_grad that
    records which list's first block runs first; the pass stops as soon as every
    list has been entered, and its hooks are removed even on error. Without it,
    declaration order (named_modules()) stands in for execution order.

    Raises ValueError when no list qualifies (pass layer_names explicitly then).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(min_fraction, bool) or not isinstance(min_fraction, (int, float)) or not 0 <= min_fraction <= 1:
        raise ValueError(f"min_fraction must be a number in [0, 1], got {min_fraction!r}")

    total = _param_bytes(model)
    chosen: dict[str, nn.Module] = {}
    info: dict[str, tuple[int, str, float]] = {}  # path -> (layers, block class, share)
    claimed: set[int] = set()  # ids of every module under a chosen list
    # named_modules() is pre-order: an outer list is always seen before the lists inside it.
    for path, module in model.named_modules():
        if not path or not _is_block_list(module):
            continue
        nbytes = _param_bytes(module)
        if nbytes == 0 or total == 0 or nbytes < min_fraction * total:
            continue
        subs = {id(m) for m in module.modules()}
        if subs & claimed:
            continue  # inside (or sharing blocks with) a list already chosen
        claimed |= subs
        chosen[path] = module
        info[path] = (len(module), type(module[0]).__name__, nbytes / total)

    if not chosen:
        raise ValueError(
            f"detect_layer_groups: {type(model).__name__} has no nn.ModuleList / nn.Sequential of >= 2 blocks "
            f"of the same class holding >= {min_fraction:.1%} of its parameter bytes; "
            "pass layer_names explicitly, e.g. configure_layerwise_offload(model, ['blocks'])"
        )

    paths = list(chosen)
    how = "declaration order"
    if example_inputs is not None:
        rank = _execution_order(model, chosen, example_inputs)
        decl = {p: i for i, p in enumerate(paths)}
        # Lists that ran, in the order they ran; any that did not run, after them in declaration order.
        paths.sort(key=lambda p: (p not in rank, rank.get(p, 0), decl[p]))
        missing = [p for p in paths if p not in rank]
        how = "execution order" if not missing else f"execution order; never ran: {', '.join(missing)}"

    log.info(
        "layerwise: detected %d layer group(s) in %s (%s): %s",
        len(paths), type(model).__name__, how,
        ", ".join(f"{p} ({info[p][0]} x {info[p][1]}, {info[p][2]:.1%} of parameter bytes)" for p in paths),
    )
    return paths
