"""The offload schemes layerwise is compared with.

naive_offload      per-tensor synchronous offload: accelerate's ``cpu_offload``
                   when accelerate is importable and the device is a GPU, else
                   NaiveOffload below.
NaiveOffload       pre-hook: copy each parameter of the block to the device
                   (one synchronous copy per tensor); post-hook: drop them.
diffusers_group_offload
                   diffusers' ``apply_group_offloading`` (block level, one block
                   per group, copies on a side stream): the state of the art.

Each function takes a model whose weights are on the host and returns
(model ready to run on `device`, label); it raises Skip when the scheme is not
available here.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from layerwise.bench.common import Skip


class NaiveOffload:
    """Synchronous per-tensor offload of the blocks in `layer_names`; everything
    else moves to the device once.

    Host copies stay where they were (pageable memory). Before a block runs,
    each of its parameters is copied to the device with its own blocking
    ``.to(device, copy=True)``; after it ran they point at the host copies
    again, and the device copies are freed. Work per hook: O(parameters).
    """

    def __init__(self, model: nn.Module, layer_names, device: torch.device):
        self.device = device
        blocks = [block for name in layer_names for block in model.get_submodule(name)]
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        with torch.no_grad():
            for p in model.parameters():
                if id(p) not in in_blocks:
                    p.data = p.data.to(device)
            for module in model.modules():
                for key, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[key] = buf.to(device)
        self.handles = []
        for block in blocks:
            pairs = [(p, p.data) for p in block.parameters()]
            self.handles.append(block.register_forward_pre_hook(functools.partial(self._load, pairs)))
            self.handles.append(block.register_forward_hook(functools.partial(self._drop, pairs), always_call=True))

    def _load(self, pairs, module, args):
        for p, host in pairs:
            p.data = host.to(self.device, copy=True)

    def _drop(self, pairs, module, args, output):
        for p, host in pairs:
            p.data = host


def naive_offload(model: nn.Module, layer_names, device: torch.device, prefer_accelerate: bool = True):
    """Per-tensor synchronous offload: accelerate's cpu_offload if importable
    (and `prefer_accelerate`), else NaiveOffload."""
    if prefer_accelerate:
        try:
            return accelerate_offload(model, device)
        except Skip:
            pass
    NaiveOffload(model, layer_names, device)
    return model, "naive hooks"


def accelerate_offload(model: nn.Module, device: torch.device, preload_module_classes=None):
    if device.type != "cuda":
        # Its hooks swap in the host tensors themselves when the execution device
        # is the host: nothing is copied, so there is nothing to compare with.
        raise Skip("accelerate's cpu_offload copies nothing when the execution device is the CPU")
    try:
        from accelerate import cpu_offload
    except Exception as e:  # noqa: BLE001 - ImportError or a broken install
        raise Skip(f"accelerate is not importable ({type(e).__name__}: {e})") from None
    # preload_module_classes: modules whose parameters live in children that
    # never run on their own (a ParameterList), hooked as a whole.
    cpu_offload(model, execution_device=device, preload_module_classes=preload_module_classes)
    return model, "accelerate cpu_offload"


def diffusers_group_offload(model: nn.Module, device: torch.device):
    if device.type != "cuda":
        raise Skip("diffusers group offloading with use_stream needs a CUDA device")
    try:
        from diffusers.hooks import apply_group_offloading
    except Exception as e:  # noqa: BLE001
        raise Skip(f"diffusers is not importable ({type(e).__name__}: {e})") from None
    apply_group_offloading(model, onload_device=device, offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=True)
    return model, "diffusers group offload"
