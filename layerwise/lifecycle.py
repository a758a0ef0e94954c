"""is_offloaded / managers_of: what a server asks of a model or a pipeline before
it streams, removes, reconfigures or reports it, without try/except."""
from __future__ import annotations

from torch import nn

from layerwise import contract
from layerwise.pipelines import component_modules


def _components(obj, caller: str) -> list[nn.Module]:
    try:
        return list(component_modules(obj).values())
    except TypeError:
        raise TypeError(f"layerwise.{caller} takes a model (an nn.Module) or a pipeline (an object holding "
                        f"nn.Module components), got {type(obj).__name__}") from None


def managers_of(model_or_pipe) -> list:
    """The LayerwiseOffloadManager of every layer group that streams.

    A model: its groups, in the order they were named (configure_layerwise_offload,
    load_offloaded, offload_pipeline, or LayerwiseOffloadManager); [] when it is not
    offloaded. The groups are recorded on the model that was configured, so a
    module that merely holds an offloaded model has none of its own.
    A pipeline (an object holding nn.Module components, as offload_pipeline takes
    it): every manager of every component, component by component in the
    pipeline's order (diffusers' `components`, else its attributes), whether
    offload_pipeline streamed the component or it was configured on its own.
    Anything else is a TypeError."""
    if isinstance(model_or_pipe, nn.Module):
        return contract.managers_of(model_or_pipe)
    return [m for module in _components(model_or_pipe, "managers_of") for m in contract.managers_of(module)]


def is_offloaded(model_or_pipe) -> bool:
    """True when a layer group of the model streams; for a pipeline, when any of
    its components has one (offload_pipeline, or a component configured on its
    own): bool(managers_of(model_or_pipe)). Anything else is a TypeError."""
    if isinstance(model_or_pipe, nn.Module):
        return bool(contract.managers_of(model_or_pipe))
    return any(contract.managers_of(module) for module in _components(model_or_pipe, "is_offloaded"))
