"""The contract's record of one streamed group and the hooks it installs on the
group's modules (state_dict, load_state_dict, merges, read-only layers)."""
from __future__ import annotations

import threading
import weakref

from layerwise.contract import edits, load_state_dict, state_dict


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


def install_layer_hooks(manager, streamed=None) -> list:
    """state_dict / load_state_dict hooks on every module that holds streamed
    parameters, and peft merge guards in every streamed layer (`streamed`: the
    streamed layers, default the ring's; set_residency installs the new
    placement's before it commits). On failure none stays registered."""
    streamed = list(manager.ring.streamed if streamed is None else streamed)
    handles: list = []
    watched = edits.watching(manager)
    try:
        handles += load_state_dict.split_load_guards(manager)  # first: they refuse before any write hook ran
        handles += load_state_dict.quantized_load_guards(manager, streamed)
        owners = state_dict.owned(manager, streamed)
        handles += load_state_dict.load_batch_hooks(manager, owners)
        for mod, owned in owners.items():
            handles.append(state_dict.guard_save(mod, manager, owned))
            handles.append(mod.register_load_state_dict_pre_hook(load_state_dict.load_pre_hook(manager, owned)))
            handles.append(mod.register_load_state_dict_post_hook(load_state_dict.load_post_hook(manager)))
        for i in streamed:
            module = manager.plan.layers[i].module
            for sub in module.modules():
                edits.WATCHED[sub] = (weakref.ref(manager), i)
                handles.extend(edits.guard_merge(sub))
        handles.extend(load_state_dict.read_only_guards(manager, streamed))
        edits.ensure_registration_hook()
    except BaseException:
        for h in handles:
            h.remove()
        edits.unwatch(manager)
        edits.WATCHED.update(watched)
        raise
    return handles
