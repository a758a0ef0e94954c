"""tune's test stack and a reading of its plan (tests/test_tune.py and the script it
runs on the simulated bus in a fresh process)."""
from layerwise.bench.models import MixedStack

Stack = MixedStack  # big light layers ("B") irregularly among small heavy ones ("H")


def largest_share(m, depth, policy, room):
    """The largest resident share of `m` at `depth` that fits `room` bytes (as layerwise.planning.device_budget plans)."""
    from layerwise.options import resolve_resident
    from layerwise.planning.device_budget import largest_share as share

    return share(lambda f: m.device_bytes(resolve_resident(f, m.num_layers, policy), depth) <= room) or 0.0


def only_layer_hooks(m) -> bool:
    """Each layer of group `m` has its own two forward hooks and no others (a probe's are gone)."""
    return all(len(lp.module._forward_pre_hooks) == 1 and len(lp.module._forward_hooks) == 1 for lp in m.plan.layers)
