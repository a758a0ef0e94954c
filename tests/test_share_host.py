"""share_host (docs/share-host.md): one host arena per machine.

In one process (two models attach to one arena through the process's own
rendezvous server): every way a write reaches a layer copies it on write and
leaves the other model exact; figures, refusals. In several processes
(helpers/share_model_worker.py): tiny Flux and Llama from one checkpoint, each
process bitwise against its resident model at its own pace; PSS; a
load_state_dict in one; a different layout; compress and the disk tier;
SIGKILL of the packer mid-pack and of a process mid-forward, and nothing left
behind once the last one exits.
"""
import copy
import gc
import os
import uuid
from pathlib import Path

import pytest
import torch

import layerwise
from layerwise.runtime import capture

from helpers import archs
from helpers.contract import assert_fingerprint, fingerprint, inputs, make, run
from helpers.ranks import run_sharers

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="share_host needs Linux (memfd_create)")

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


def _pair(key=None, **kw):
    """Two TwoGroupModels with the same weights, both configured with share_host
    (the second attaches to what the first packed), and a resident reference."""
    key = key or f"test-{uuid.uuid4().hex}"
    ref = make(seed=0)
    a, b = make(seed=0), make(seed=0)
    ma = layerwise.configure_layerwise_offload(a, GROUPS, device="cpu", share_host=key, **kw)
    mb = layerwise.configure_layerwise_offload(b, GROUPS, device="cpu", share_host=key, **kw)
    return ref, (a, ma), (b, mb)


def _roles(managers):
    return [m.stats()["share_host"]["role"] for m in managers]


def _equal(x, y):
    return all(torch.equal(p, q) for p, q in zip(x, y))


def test_a_second_model_attaches_and_both_stream_exactly():
    ref, (a, ma), (b, mb) = _pair()
    assert _roles(ma) == ["packer", "packer"] and _roles(mb) == ["attached", "attached"]
    xs = inputs()
    want = run(ref, xs)
    assert _equal(run(a, xs), want) and _equal(run(b, xs), want)
    for m, n in zip(ma, mb):
        sa, sb = m.stats()["share_host"], n.stats()["share_host"]
        assert sa["key"] == sb["key"] and sa["shared_bytes"] == sb["shared_bytes"] > 0
        assert sb["private_bytes"] == 0 and sb["copied_layers"] == []
        assert sb["holders"] == 1  # processes: both models are this one's
        assert m.layer_host(0) is None  # read-only: state_dict() hands out copies
    assert "share_host:" in str(layerwise.report(b))


def test_different_weights_or_layout_never_attach():
    key = f"test-{uuid.uuid4().hex}"
    a = make(seed=0)
    ma = layerwise.configure_layerwise_offload(a, GROUPS, device="cpu", share_host=True)
    b = make(seed=1)  # other weights: share_host=True identifies them by their bytes
    mb = layerwise.configure_layerwise_offload(b, GROUPS, device="cpu", share_host=True)
    c = make(seed=0, d=48)  # another layout, same key string
    mc = layerwise.configure_layerwise_offload(c, GROUPS, device="cpu", share_host=key)
    assert _roles(ma) == _roles(mb) == _roles(mc) == ["packer", "packer"]
    keys = {m.stats()["share_host"]["key"] for m in ma + mb + mc}
    assert len(keys) == 6
    for model, seed in ((a, 0), (b, 1)):
        assert _equal(run(model, inputs()), run(make(seed=seed), inputs()))


def _write_paths():
    def lsd(model, ref):
        name = "transformer_blocks.1.up.weight"
        sd = {name: ref.state_dict()[name] + 1}
        model.load_state_dict(sd, strict=False)
        ref.load_state_dict(sd, strict=False)

    def rebind(model, ref):
        for m in (model, ref):
            m.transformer_blocks[1].up.weight.data = ref.transformer_blocks[1].up.weight.detach() * 2

    def residency(model, ref):
        m = layerwise.managers_of(model)[0]
        m.set_residency([1])
        with torch.no_grad():
            model.transformer_blocks[1].up.weight.add_(1)
            ref.transformer_blocks[1].up.weight.add_(1)
        m.set_residency([])  # the changed resident layer is written back: copied on write

    return {"load_state_dict": lsd, "rebind": rebind, "set_residency": residency}


@pytest.mark.parametrize("path", sorted(_write_paths()))
def test_a_write_copies_the_layer_on_write_and_the_other_model_stays_exact(path):
    ref, (a, ma), (b, mb) = _pair()
    xs = inputs()
    before = run(ref, xs)
    changed = copy.deepcopy(ref)
    _write_paths()[path](b, changed)
    assert _equal(run(b, xs), run(changed, xs)) and not _equal(run(b, xs), before)
    assert _equal(run(a, xs), before)
    sh = mb[0].stats()["share_host"]
    assert sh["copied_layers"] == [1] and sh["private_bytes"] == mb[0].plan.layers[1].nbytes
    assert ma[0].stats()["share_host"]["copied_layers"] == []
    layerwise.remove_layerwise_offload(b)  # the copy goes with it; the arena stays
    assert _equal(run(a, xs), before)
    assert _equal(run(b, xs), run(changed, xs))


@pytest.mark.parametrize("compress", [None, "lossless"])
def test_a_write_of_the_same_bytes_keeps_the_layer_shared(compress):
    """load_state_dict of the weights the model has (a server reloading its
    checkpoint) copies nothing: N processes doing so keep one copy, not N + 1."""
    ref, (a, ma), (b, mb) = _pair(compress=compress)
    b.load_state_dict(make(seed=0).state_dict())
    for m in mb:
        sh = m.stats()["share_host"]
        assert sh["copied_layers"] == [] and sh["private_bytes"] == 0
    xs = inputs()
    assert _equal(run(b, xs), run(ref, xs)) and _equal(run(a, xs), run(ref, xs))


def test_a_lora_merge_in_one_model_leaves_the_other_exact():
    peft = pytest.importorskip("peft")
    pytest.importorskip("diffusers")
    from peft.tuners.tuners_utils import BaseTunerLayer

    arch = archs.ARCHS["flux"]
    key = f"test-{uuid.uuid4().hex}"
    ref, a, b = (archs.build(arch) for _ in range(3))
    layerwise.configure_layerwise_offload(a, arch.groups, device="cpu", share_host=key)
    layerwise.configure_layerwise_offload(b, arch.groups, device="cpu", share_host=key)
    want = archs.run(arch, ref, 1)
    merged = archs.build(arch)
    for m in (b, merged):
        m.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "proj_out"]))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for n, p in sorted(m.named_parameters()):
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for mod in m.modules():
            if isinstance(mod, BaseTunerLayer):
                mod.merge()
    assert torch.equal(archs.run(arch, b, 1), archs.run(arch, merged, 1))
    assert torch.equal(archs.run(arch, a, 1), want)
    assert layerwise.managers_of(b)[0].stats()["share_host"]["copied_layers"]


def test_removing_the_packer_leaves_the_attached_model_streaming():
    ref, (a, ma), (b, mb) = _pair()
    layerwise.remove_layerwise_offload(a)
    xs = inputs()
    assert _equal(run(b, xs), run(ref, xs)) and _equal(run(a, xs), run(ref, xs))
    c = make(seed=0)  # a newcomer still finds the arena: the attached model serves it now
    mc = layerwise.configure_layerwise_offload(c, GROUPS, device="cpu", share_host=mb[0].options.share_host)
    assert _roles(mc) == ["attached", "attached"]
    assert _equal(run(c, xs), run(ref, xs))


def test_state_dict_hands_out_copies_of_shared_layers():
    ref, (a, ma), (b, mb) = _pair()
    sd = b.state_dict()
    with torch.no_grad():
        sd["transformer_blocks.0.up.weight"].add_(1)  # a copy: the model does not change
    xs = inputs()
    assert _equal(run(b, xs), run(ref, xs)) and _equal(run(a, xs), run(ref, xs))


def test_compress_and_residency_share_and_stay_exact():
    ref, (a, ma), (b, mb) = _pair(compress="lossless", resident_layers=1)
    assert _roles(mb) == ["attached", "attached"]
    xs = inputs()
    assert _equal(run(a, xs), run(ref, xs)) and _equal(run(b, xs), run(ref, xs))


def test_capture_of_a_shared_layer_is_refused_naming_share_host():
    _, (a, ma), _ = _pair()

    class Api:
        def pinned(self, t):
            return True
    with torch.no_grad():
        why = capture.refusal(ma[0], Api())
    assert why and "share_host" in why


@pytest.mark.parametrize("compress", [None, "lossless"])
def test_one_key_string_for_two_checkpoints_of_one_layout_is_refused(tmp_path, compress):
    from safetensors.torch import save_file

    from layerwise.runtime.shared_arena import SharedArenaError

    key = f"test-{uuid.uuid4().hex}"
    paths = []
    for seed in (0, 1):
        path = tmp_path / f"m{seed}.safetensors"
        save_file({k: v.contiguous() for k, v in make(seed=seed).state_dict().items()}, str(path))
        paths.append(str(path))
    a = layerwise.empty_model(make)
    layerwise.load_offloaded(a, paths[0], GROUPS, device="cpu", share_host=key, compress=compress)
    b = layerwise.empty_model(make)
    with pytest.raises(SharedArenaError, match="the key names other weights"):
        layerwise.load_offloaded(b, paths[1], GROUPS, device="cpu", share_host=key, compress=compress)
    assert not layerwise.managers_of(b) and all(p.is_meta for p in b.parameters())
    c = layerwise.empty_model(make)  # the same checkpoint under the key attaches, exact
    mc = layerwise.load_offloaded(c, paths[0], GROUPS, device="cpu", share_host=key, compress=compress)
    assert _roles(mc) == ["attached", "attached"]
    assert _equal(run(c, inputs()), run(make(seed=0), inputs()))


def test_share_host_refusals_name_the_option():
    with pytest.raises(ValueError, match="share_host must be"):
        layerwise.configure_layerwise_offload(make(), GROUPS, device="cpu", share_host="")
    with pytest.raises(ValueError, match="share_host must be"):
        layerwise.configure_layerwise_offload(make(), GROUPS, device="cpu", share_host=3)
    model = layerwise.empty_model(make)
    with pytest.raises(ValueError, match="meta device"):
        layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", share_host=True)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_a_failure_once_the_arena_is_served_is_the_callers_and_leaves_nothing(monkeypatch, exc):
    from layerwise.runtime import rendezvous

    publish = rendezvous.Membership.publish

    def served_then_fails(self, fd):  # (an interrupt lands just after the fd is served)
        publish(self, fd)
        raise exc("injected")

    key = f"test-{uuid.uuid4().hex}"
    model = make(seed=0)
    before = fingerprint(model)
    monkeypatch.setattr(rendezvous.Membership, "publish", served_then_fails)
    with pytest.raises(exc, match="injected"):
        layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", share_host=key)
    monkeypatch.undo()
    assert_fingerprint(model, before)
    other = make(seed=0)  # the failed configure serves nothing: the next one packs
    mo = layerwise.configure_layerwise_offload(other, GROUPS, device="cpu", share_host=key)
    assert _roles(mo) == ["packer", "packer"]
    mm = layerwise.configure_layerwise_offload(model, GROUPS, device="cpu", share_host=key)
    assert _roles(mm) == ["attached", "attached"]
    xs = inputs()
    assert _equal(run(model, xs), run(make(seed=0), xs)) and _equal(run(other, xs), run(make(seed=0), xs))


def _memfds() -> int:
    """This process's open fds of layerwise's shared arenas (each keeps one alive)."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return sum("memfd:layerwise" in f for f in fds)


def test_an_arena_refused_for_its_layout_is_closed(monkeypatch):
    """An arena whose manifest holds another layout under this key is refused, the
    model unchanged, and the file received closed: an fd kept open would keep the
    arena's memory alive for the life of the process."""
    from layerwise.runtime import shared_arena

    key = f"test-{uuid.uuid4().hex}"
    a = make(seed=0)
    layerwise.configure_layerwise_offload(a, GROUPS, device="cpu", share_host=key)
    gc.collect()
    fds = _memfds()
    real_open = shared_arena.SharedFile.open.__func__

    def forged(cls, fd, digest, where):
        file, manifest = real_open(cls, fd, digest, where)
        return file, {**manifest, "layout": []}

    monkeypatch.setattr(shared_arena.SharedFile, "open", classmethod(forged))
    b = make(seed=0)
    before = fingerprint(b)
    with pytest.raises(shared_arena.SharedArenaError, match="does not hold this group's layout"):
        layerwise.configure_layerwise_offload(b, GROUPS, device="cpu", share_host=key)
    monkeypatch.undo()
    assert_fingerprint(b, before)
    gc.collect()
    assert _memfds() == fds


@pytest.mark.parametrize("compress", [None, "lossless"])
def test_a_layer_of_no_bytes_of_its_own_attaches(compress):
    """TiedModel's layer 2 is layer 0's linear again: its block is empty, and the
    manifest places it like any other."""
    from helpers.models import TiedModel

    def tied():
        torch.manual_seed(0)
        return TiedModel()

    key = f"test-{uuid.uuid4().hex}"
    a, b = tied(), tied()
    ma = layerwise.configure_layerwise_offload(a, ["blocks"], device="cpu", share_host=key, compress=compress)
    mb = layerwise.configure_layerwise_offload(b, ["blocks"], device="cpu", share_host=key, compress=compress)
    assert _roles(ma) == ["packer"] and _roles(mb) == ["attached"]
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = tied()(x)
        assert torch.equal(a(x), want) and torch.equal(b(x), want)


def test_a_pipeline_key_string_keeps_components_of_one_layout_apart():
    """Two components of one class and layout but other weights (Wan 2.2's two
    transformers): one key string for the pipeline shares each with its namesake
    in another pipeline, never with each other."""
    class Pipe:
        def __init__(self):
            self.transformer, self.transformer_2 = make(seed=0), make(seed=1)

    key = f"test-{uuid.uuid4().hex}"
    comps = {"transformer": GROUPS, "transformer_2": GROUPS}
    p, q = Pipe(), Pipe()
    mp = layerwise.offload_pipeline(p, device="cpu", components=comps, share_host=key)
    mq = layerwise.offload_pipeline(q, device="cpu", components=comps, share_host=key)
    assert _roles(mp["transformer"] + mp["transformer_2"]) == ["packer"] * 4
    assert _roles(mq["transformer"] + mq["transformer_2"]) == ["attached"] * 4
    xs = inputs()
    for pipe in (p, q):
        assert _equal(run(pipe.transformer, xs), run(make(seed=0), xs))
        assert _equal(run(pipe.transformer_2, xs), run(make(seed=1), xs))


# ---------------------------------------------------------------- processes
def _checkpoint(tmp_path: Path, arch_name: str) -> str:
    from safetensors.torch import save_file

    arch = archs.ARCHS[arch_name]
    model = archs.build(arch)
    path = tmp_path / f"{arch_name}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return str(path)


def _facts(lines: list, what: str) -> list:
    return [line.split(" ", 1)[1] for line in lines if line.startswith(what + " ")]


def _leftovers(keys) -> list:
    """Every process's mapping or fd of one of these arenas (none once all exited)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for k in keys:
            if f"memfd:layerwise:{k}" in maps or any(f"memfd:layerwise:{k}" in f for f in fds):
                found.append((pid, k))
    return found


def _keys(outs) -> set:
    return {k for lines in outs if lines for got in _facts(lines, "key") for k in got.split(",")}


@pytest.mark.parametrize("arch_name,n", [("flux", 4), ("llama", 2)])
def test_processes_stream_one_checkpoint_from_one_arena(tmp_path, arch_name, n):
    pytest.importorskip(archs.ARCHS[arch_name].package)
    ckpt = _checkpoint(tmp_path, arch_name)
    outs = run_sharers(n, tmp_path, "stream", arch_name, ckpt, '{"rounds": 2}', worker="share_model_worker.py")
    groups = len(archs.ARCHS[arch_name].groups)
    roles = [_facts(lines, "role")[0].split(",") for lines in outs]
    for g in range(groups):  # exactly one process packed each group; the others attached
        assert sorted(r[g] for r in roles) == ["attached"] * (n - 1) + ["packer"]
    assert len({_facts(lines, "inode")[0] for lines in outs}) == 1  # the same memory in every process
    shared = int(_facts(outs[0], "shared_bytes")[0])
    pss = [int(_facts(lines, "shared_pss")[0]) for lines in outs]
    assert all(p > 0 for p in pss)
    assert sum(pss) <= 1.15 * shared + 4096 * 2 * groups * n  # one copy, counted once (pages rounded)
    assert all(_facts(lines, "inodes_after_remove") == ["0"] for lines in outs)  # remove unmaps it
    assert not _leftovers(_keys(outs))


def test_a_load_state_dict_in_one_process_changes_its_output_only(tmp_path):
    pytest.importorskip("transformers")
    ckpt = _checkpoint(tmp_path, "llama")
    outs = run_sharers(3, tmp_path, "lsd", "llama", ckpt, '{"lsd": 1}', worker="share_model_worker.py")
    assert _facts(outs[1], "copied") == ["[[1]]"]  # (each asserted its own output bitwise)


def test_another_layout_on_the_same_host_never_attaches(tmp_path):
    pytest.importorskip("transformers")
    ckpt = _checkpoint(tmp_path, "llama")
    outs = run_sharers(2, tmp_path, "layout", "llama", ckpt, '{"per": {"1": {"dtype": "bfloat16"}}}',
                       worker="share_model_worker.py")
    assert [_facts(lines, "role")[0] for lines in outs] == ["packer", "packer"]
    assert _facts(outs[0], "inode") != _facts(outs[1], "inode")


# (tiny Llama: a budget keeps every streamed layer in memory, or none: staging costs more than a layer)
@pytest.mark.parametrize("options,lsd", [({"compress": "lossless"}, True), ({"host_budget": 530000}, False),
                                         ({"host_budget": 530000, "spill_dir": "$TMP", "compress": "lossless"}, True)])
def test_compress_and_the_disk_tier_share(tmp_path, options, lsd):
    pytest.importorskip("transformers")
    import json

    ckpt = _checkpoint(tmp_path, "llama")
    cfg = {"options": options, "rounds": 2, **({"lsd": 0} if lsd else {})}
    outs = run_sharers(2, tmp_path, "tiers", "llama", ckpt, json.dumps(cfg), worker="share_model_worker.py")
    assert sorted(_facts(lines, "role")[0] for lines in outs) == ["attached", "packer"]
    disk = {int(_facts(lines, "disk_layers")[0]) for lines in outs}
    assert len(disk) == 1  # the attached process keeps on disk what the packer did
    assert (0 < disk.pop() <= 7) if "host_budget" in options else disk == {0}
    if "compress" in options and "host_budget" not in options:
        assert all(int(_facts(lines, "encoded_layers")[0]) > 0 for lines in outs)


def test_sigkill_of_the_packer_mid_pack_leaves_the_others_exact(tmp_path):
    pytest.importorskip("transformers")
    ckpt = _checkpoint(tmp_path, "llama")
    outs = run_sharers(3, tmp_path, "killpack", "llama", ckpt,
                       '{"slow_pack_ms": 400, "wait": false, "rounds": 2, "after_packing": ["1", "2"]}',
                       worker="share_model_worker.py", kill=(0, "packing layer 2"))
    assert "packing layer 2" in outs[0] and "rank 0 ok" not in outs[0]  # killed mid-pack
    survivors = [_facts(lines, "role")[0] for lines in outs[1:]]
    assert sorted(survivors) == ["attached", "packer"]  # one of those waiting packed instead
    assert not _leftovers(_keys(outs))


def test_sigkill_of_a_process_mid_forward_leaves_the_others_exact(tmp_path):
    pytest.importorskip("transformers")
    ckpt = _checkpoint(tmp_path, "llama")
    outs = run_sharers(3, tmp_path, "killfwd", "llama", ckpt, '{"hang": {"1": 2}, "rounds": 2}',
                       worker="share_model_worker.py", kill=(1, "in layer 2"))
    assert "in layer 2" in outs[1] and "rank 1 ok" not in outs[1]  # killed mid-forward
    assert not _leftovers(_keys(outs))
