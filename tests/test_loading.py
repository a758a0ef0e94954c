"""load_offloaded: safetensors straight into the arena, for a model built on meta."""
import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

import layerwise
from layerwise.configure import managers_of

from helpers.models import TwoGroupModel

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


def empty_model(**kw):
    """The model without weights: parameters on meta, buffers on the host."""
    with torch.device("meta"):
        model = TwoGroupModel(**kw)
    for mod in model.modules():
        for k, b in mod._buffers.items():
            mod._buffers[k] = torch.linspace(0.5, 1.5, b.shape[0])  # what Block's __init__ computes
    return model


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    ref = TwoGroupModel()
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    return ref, sd, path


def outputs(model, device="cpu", n=3):
    torch.manual_seed(1)
    xs = [torch.randn(2, 32) for _ in range(n)]
    with torch.no_grad():
        return [model(x.to(device)).cpu() for x in xs]


@pytest.mark.parametrize("depth,resident", [(0, 0), (1, 0), (2, 2)])
def test_loaded_model_is_bitwise_the_resident_one(device, saved, depth, resident):
    ref, sd, path = saved
    model = empty_model()
    managers = layerwise.load_offloaded(model, path, GROUPS, device=device, prefetch_depth=depth,
                                        resident_layers=resident)
    assert [m.layer_name for m in managers] == GROUPS
    assert not any(p.is_meta for p in model.parameters())
    for a, b in zip(outputs(model, device), outputs(copy.deepcopy(ref).to(device), device)):
        assert torch.equal(a, b)
    for blk in model.transformer_blocks:  # strides of the model's own definition survive
        assert blk.down_t.stride() == (1, 64)
    layerwise.remove_layerwise_offload(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v.cpu(), sd[k]), k


def test_sharded_checkpoint_with_an_index(tmp_path, saved):
    ref, sd, _ = saved
    keys = sorted(sd)
    shards = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2:]}
    weight_map = {}
    for name, ks in shards.items():
        save_file({k: sd[k] for k in ks}, str(tmp_path / name))
        weight_map.update({k: name for k in ks})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = empty_model()
    layerwise.load_offloaded(model, index, GROUPS, device="cpu", debug_copy_delay_us=300)
    for a, b in zip(outputs(model), outputs(ref)):
        assert torch.equal(a, b)


def _untouched(model):
    return (all(p.is_meta for p in model.parameters()) and not managers_of(model)
            and sum(len(m._forward_pre_hooks) for m in model.modules()) == 0)


@pytest.mark.parametrize("edit,exc,match", [
    (lambda sd: sd.pop("transformer_blocks.2.up.weight"), KeyError, "missing 1 tensor.*transformer_blocks.2.up.weight"),
    (lambda sd: sd.__setitem__("extra.weight", torch.zeros(3)), KeyError, "unexpected 1 tensor.*extra.weight"),
    (lambda sd: sd.__setitem__("head.weight", torch.zeros(32, 31)), ValueError,
     r"'head.weight' is torch.float32\[32, 31\] but the model expects torch.float32\[32, 32\]"),
    (lambda sd: sd.__setitem__("transformer_blocks.0.up.bias", torch.zeros(64)), ValueError,
     "'transformer_blocks.0.up.bias' is torch.float32.* expects torch.bfloat16"),
])
def test_checkpoint_mismatch_is_named_before_anything_loads(tmp_path, saved, edit, exc, match):
    _, sd, _ = saved
    sd = dict(sd)
    edit(sd)
    path = tmp_path / "bad.safetensors"
    save_file(sd, str(path))
    model = empty_model()
    with pytest.raises(exc, match=match):
        layerwise.load_offloaded(model, path, GROUPS, device="cpu")
    assert _untouched(model)


def test_unexpected_keys_pass_when_not_strict(tmp_path, saved):
    ref, sd, _ = saved
    path = tmp_path / "extra.safetensors"
    save_file({**sd, "unused.bias": torch.zeros(2)}, str(path))
    model = empty_model()
    layerwise.load_offloaded(model, path, GROUPS, device="cpu", strict=False)
    assert torch.equal(outputs(model, n=1)[0], outputs(ref, n=1)[0])


def test_meta_buffer_without_a_checkpoint_entry_is_an_error(saved):
    _, _, path = saved
    with torch.device("meta"):
        model = TwoGroupModel()
    model.head.register_buffer("rope", torch.empty(4, device="meta"), persistent=False)
    with pytest.raises(ValueError, match="buffer '.*' is on the meta device"):
        layerwise.load_offloaded(model, path, GROUPS, device="cpu")


def test_not_a_safetensors_file(tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\x05")
    with pytest.raises(ValueError, match="not a safetensors file"):
        layerwise.load_offloaded(empty_model(), bad, GROUPS, device="cpu")


def test_failure_while_packing_restores_the_meta_model(saved, monkeypatch):
    _, _, path = saved
    model = empty_model()
    before = {n: id(p) for n, p in model.named_parameters()}
    import layerwise.formats.safetensors as L

    calls = []
    real = L.read_into

    def flaky(stored, out):
        calls.append(1)
        if len(calls) == 7:
            raise OSError("simulated read error")
        return real(stored, out)

    monkeypatch.setattr(L, "read_into", flaky)
    with pytest.raises(OSError, match="simulated"):
        layerwise.load_offloaded(model, path, GROUPS, device="cpu")
    assert {n: id(p) for n, p in model.named_parameters()} == before
    assert _untouched(model)


def test_host_peak_while_loading_is_the_arena_plus_a_layer(tmp_path):
    # ~600 MB of layers, written here and loaded in a fresh process: reading into
    # the arena must not add a second copy (nor a mapping of the file) on top of it.
    build = textwrap.dedent("""
        import torch
        from torch import nn
        L, D = 8, 2560
        def build():
            m = nn.Module(); m.blocks = nn.ModuleList(nn.Linear(D, D * 3, bias=False) for _ in range(L))
            m.head = nn.Linear(D, 8)
            return m
    """)
    scope = {}
    exec(build, scope)
    save_file(scope["build"]().state_dict(), str(tmp_path / "big.safetensors"))
    code = build + textwrap.dedent(f"""
        import psutil, layerwise
        import torch._dynamo  # a one-time ~150 MB import (the hooks use torch.compiler.disable): not per model
        with torch.device("meta"):
            m = build()
        layer = 3 * D * D * 4
        base = psutil.Process().memory_info().rss
        layerwise.load_offloaded(m, "{tmp_path}/big.safetensors", "blocks", device="cpu")
        # VmHWM: this process's own high-water mark (ru_maxrss can carry the parent's over exec)
        peak = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) * 1024
        arena = layerwise.report(m)["total"]["arena_bytes"]
        print((peak - base - arena) / layer)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    over_arena_in_layers = float(out.stdout.split()[-1])
    assert over_arena_in_layers <= 1 + 0.05 * 8, over_arena_in_layers
