"""One process of the share_host tests (tests/test_share_host.py): it streams a
tiny real model from a checkpoint with share_host=True and checks its outputs
bitwise against the resident model built from the same checkpoint, with inputs
of its own and at its own pace.

    python tests/helpers/share_model_worker.py INDEX N TMPDIR SCENARIO ARCH CKPT [OPTIONS_JSON]

OPTIONS_JSON: {"options": {...load_offloaded keywords}, "per": {"INDEX": {...}},
"wait": bool (wait until all N hold the model before the forwards), "lsd": INDEX
(that process changes one weight with load_state_dict once all hold the model;
the others run after it), "slow_pack_ms": ms slept per packed layer (prints
"packing layer K"), "hang": {"INDEX": K} (that process's forward prints "in layer K" and
sleeps there), "config": a configure_layerwise_offload on an in-memory model instead,
"after_packing": [INDEX, ...] (those join only once a process packs)}.
Prints "role R", "inode I", "shared_pss B", "shared_bytes B", "copied L",
"rank INDEX ok".
"""
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import layerwise  # noqa: E402

from helpers import archs  # noqa: E402


def say(*a):
    print(*a, flush=True)


def barrier(tmp: Path, name: str, i: int, n: int, timeout=120) -> None:
    (tmp / f"{name}.{i}").touch()
    end = time.monotonic() + timeout
    while sum((tmp / f"{name}.{j}").exists() for j in range(n)) < n:
        if time.monotonic() > end:
            raise TimeoutError(f"barrier {name}")
        time.sleep(0.01)


def wait_for(path: Path, timeout=120) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(str(path))
        time.sleep(0.01)


def memfd_mappings() -> tuple[set, int]:
    """(inodes, Pss bytes) of this process's mappings of layerwise's memfds."""
    inodes, pss, inside = set(), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                inside = len(parts) >= 6 and parts[5].startswith("/memfd:layerwise:")
                if inside:
                    inodes.add(int(parts[4]))
            elif inside and line.startswith("Pss:"):
                pss += int(parts[1]) * 1024
    return inodes, pss


def reference_of(arch, ckpt, dtype=None):
    from safetensors.torch import load_file

    ref = arch.build()
    if dtype is not None:
        ref = ref.to(dtype)
    ref.load_state_dict(load_file(ckpt))
    return ref.eval()


def main():
    index, n, tmp, scenario, arch_name, ckpt = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], \
        sys.argv[5], sys.argv[6]
    cfg = json.loads(sys.argv[7]) if len(sys.argv) > 7 else {}
    torch.set_num_threads(1)
    arch = archs.ARCHS[arch_name]
    options = {**cfg.get("options", {}), **cfg.get("per", {}).get(str(index), {})}
    options = {k: str(tmp) if v == "$TMP" else v for k, v in options.items()}
    dtype = getattr(torch, options.pop("dtype")) if "dtype" in options else None
    reference = reference_of(arch, ckpt, dtype)

    if cfg.get("slow_pack_ms"):  # the packer only records layers: a slow pack, observable from outside
        from layerwise.runtime import host_store

        record = host_store.HostLayers._record

        def slow(self, lp, route, share):
            say(f"packing layer {lp.index}")
            (tmp / "packing").touch()  # (only a packer records layers)
            time.sleep(cfg["slow_pack_ms"] / 1e3)
            return record(self, lp, route, share)
        host_store.HostLayers._record = slow

    if str(index) in cfg.get("after_packing", []):  # join once another process is packing: a waiter
        wait_for(tmp / "packing")
    if cfg.get("config"):
        model = reference_of(arch, ckpt, dtype)
        managers = layerwise.configure_layerwise_offload(model, arch.groups, device="cpu", share_host=True,
                                                         **options)
    else:
        model = layerwise.empty_model(arch.build)
        managers = layerwise.load_offloaded(model, ckpt, arch.groups, device="cpu", share_host=True, dtype=dtype,
                                            **options)
    roles = [m.stats()["share_host"]["role"] for m in managers]
    say("role", ",".join(roles))
    say("key", ",".join(m.stats()["share_host"]["key"] for m in managers))
    inodes, _ = memfd_mappings()
    say("inode", ",".join(str(x) for x in sorted(inodes)))
    say("shared_bytes", sum(m.stats()["share_host"]["shared_bytes"] for m in managers))
    say("disk_layers", sum(len(m.tier_plan()) - sum(r.where in ("arena", "device") for r in m.tier_plan())
                           for m in managers))
    say("encoded_layers", sum(sum(r.encoded for r in m.tier_plan()) for m in managers))
    if cfg.get("wait", True):
        barrier(tmp, f"{scenario}.held", index, n)

    rng = random.Random(index)
    pace = lambda *_: time.sleep(rng.random() * 0.003)  # noqa: E731 - each process at its own pace
    hang = cfg.get("hang", {}).get(str(index))
    for g in arch.groups:
        for k, block in enumerate(model.get_submodule(g)):
            block.register_forward_pre_hook(pace)
            if hang == k and g == arch.groups[0]:
                block.register_forward_pre_hook(lambda *_: (say(f"in layer {hang}"), time.sleep(60)))

    if "lsd" in cfg:
        changed = cfg["lsd"]
        name = next(k for k in model.state_dict() if k.startswith(arch.groups[0] + ".1.") and k.endswith("weight"))
        if index == changed:
            sd = {name: reference.state_dict()[name] + 1}
            model.load_state_dict(sd, strict=False)
            reference.load_state_dict(sd, strict=False)
            say("copied", [m.stats()["share_host"]["copied_layers"] for m in managers])
            (tmp / "lsd.done").touch()
        else:
            wait_for(tmp / "lsd.done")

    with torch.no_grad():
        for k in range(cfg.get("rounds", 3)):
            seed = 1000 * index + k
            out, ref = archs.run(arch, model, seed), archs.run(arch, reference, seed)
            assert torch.equal(out, ref), (index, k, (out - ref).abs().max().item())
    inodes, pss = memfd_mappings()
    say("shared_pss", pss)
    if cfg.get("wait", True) and not cfg.get("hang"):
        barrier(tmp, f"{scenario}.ran", index, n)  # (every process still maps the arena when each measured)
    layerwise.remove_layerwise_offload(model)
    inodes_after, _ = memfd_mappings()
    say("inodes_after_remove", len(inodes_after))
    say(f"rank {index} ok")


if __name__ == "__main__":
    main()
