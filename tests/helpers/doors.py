"""The front doors called alike, for the tests that refuse a bad option at every
one of them (tests/test_options.py, tests/planning/test_planning.py)."""
import torch

import layerwise


class Holder:  # any object holding modules is a pipeline for offload_pipeline
    def __init__(self, model):
        self.model = model


def save_checkpoint(model, path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


def front_door(door: str, make, groups, checkpoint=None):
    """(call(**options), the model it configures), on device "cpu". `make()` builds
    the model; for load_offloaded it is built on the meta device and loads
    `checkpoint` (save_checkpoint of a model `make()` built); for the manager,
    `groups[0]` is its group."""
    if door == "load_offloaded":
        with torch.device("meta"):
            model = make()
        return (lambda **kw: layerwise.load_offloaded(model, checkpoint, groups, **{"device": "cpu", **kw})), model
    model = make()
    if door == "offload_pipeline":
        holder = Holder(model)
        return (lambda **kw: layerwise.offload_pipeline(holder, **{"device": "cpu", **kw})), model
    if door == "LayerwiseOffloadManager":
        return (lambda **kw: layerwise.LayerwiseOffloadManager(model, groups[0], **{"device": "cpu", **kw})), model
    assert door == "configure_layerwise_offload", door
    return (lambda **kw: layerwise.configure_layerwise_offload(model, groups, **{"device": "cpu", **kw})), model
