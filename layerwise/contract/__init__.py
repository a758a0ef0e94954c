"""The state contract of an offloaded model (docs/design.md): it is still a torch
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
from layerwise.contract.autograd import saved_slot_hooks, track_backward  # noqa: F401
from layerwise.contract.casts import COPY_REFUSED  # noqa: F401
from layerwise.contract.edits import editing, unwatch  # noqa: F401
from layerwise.contract.guards import GroupGuard, install_layer_hooks  # noqa: F401
from layerwise.contract.interrupts import defer_interrupts  # noqa: F401
from layerwise.contract.locking import model_lock, module_call_frame  # noqa: F401
from layerwise.contract.registry import (  # noqa: F401
    check_configurable,
    managers_of,
    move_non_layer_weights,
    register_outside_front_door,
)
from layerwise.contract.state_dict import arena_written, check_handed_out  # noqa: F401
from layerwise.contract.transaction import (  # noqa: F401
    apply_moves,
    device_moves,
    remove_models,
    rollback_on_failure,
    snapshot_devices,
)
