"""Real architectures (diffusers Flux, HunyuanVideo, Wan; transformers Llama), built
from tiny configs with random weights, streamed on the CPU backend: outputs
bitwise equal to the resident model, remove() gives the state_dict back, and
detect_layer_groups finds the right block lists. Plus synthetic detection cases.

diffusers and transformers are test extras: each test that needs one skips
cleanly where it is not installed."""
import copy
import logging

import pytest
import torch
from torch import nn

import layerwise
from layerwise.configure import managers_of
from layerwise.planning.detect import detect_layer_groups

from helpers.archs import ARCHS, SEEDS, _flux_inputs, assert_state_equal, build, clone_state, recopied, run, run_bf16

DEPTH_RESIDENT = [(0, 0), (1, 0), (2, 1)]


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


# ------------------------------------------------- bitwise outputs, remove
@pytest.mark.parametrize("depth,resident", DEPTH_RESIDENT)
@pytest.mark.parametrize("name", list(ARCHS))
def test_offloaded_outputs_bitwise_and_remove_restores(name, depth, resident):
    arch = ARCHS[name]
    model = build(arch)
    ref = copy.deepcopy(model)
    sd = clone_state(model)
    hooks = hook_count(model)
    refs = [run(arch, ref, s) for s in SEEDS]
    assert not torch.equal(refs[0], refs[1])  # the inputs matter: equality below is not vacuous

    managers = layerwise.configure_layerwise_offload(model, arch.groups, device="cpu", prefetch_depth=depth,
                                                     resident_layers=resident)
    assert [m.layer_name for m in managers] == arch.groups
    assert [m.num_layers for m in managers] == [arch.layers[g] for g in arch.groups]
    # Every block parameter is managed: bound to a ring slot or a resident block, not its own storage.
    managed = {id(e.param) for m in managers for lp in m.plan.layers for e in lp.params}
    for g in arch.groups:
        assert all(id(p) in managed for p in model.get_submodule(g).parameters()), g
    for _ in range(2):  # repeated steps: the ring wraps around
        for s, r in zip(SEEDS, refs):
            out = run(arch, model, s)
            assert torch.equal(out, r), (name, s, (out - r).abs().max())
    for m in managers:
        st = m.stats()
        assert st["steps"] == 2 * len(SEEDS), st
        if depth > 0:  # with prefetch, every layer's copy was issued ahead of its pre-hook
            assert st["sync_loads"] == 0, st
        assert st["resident_layers"] == list(range(min(resident, m.num_layers)))
        assert st["last_step"]["copies"] == recopied(m), st
    # Not vacuous: some layers really stream through shared slots in every step.
    assert sum(recopied(m) for m in managers) > 0

    layerwise.remove_layerwise_offload(model)
    assert not managers_of(model) and hook_count(model) == hooks
    assert_state_equal(model, sd)
    assert torch.equal(run(arch, model, SEEDS[0]), refs[0])  # an ordinary model again


@pytest.mark.parametrize("name", list(ARCHS))
def test_real_architectures_stream_to_cuda_bitwise(name):
    # The same check on the GPU (scripts/gpu_check.sh): the model starts on the
    # host, the reference is the resident model on the device.
    if not (torch.cuda.is_available() and layerwise.build_info()["with_cuda"]):
        pytest.skip("no CUDA device (or a CPU-only build)")
    arch = ARCHS[name]
    model = build(arch)
    ref = copy.deepcopy(model).to("cuda")
    refs = [run(arch, ref, s, "cuda") for s in SEEDS]
    managers = layerwise.configure_layerwise_offload(model, arch.groups, device="cuda", prefetch_depth=1)
    for _ in range(2):
        for s, r in zip(SEEDS, refs):
            assert torch.equal(run(arch, model, s, "cuda"), r), (name, s)
    assert all(m.stats()["sync_loads"] == 0 for m in managers)
    assert all(p.device.type == "cuda" for p in model.parameters())


def test_flux_random_copy_delays_never_change_outputs():
    arch = ARCHS["flux"]
    model = build(arch, seed=1)
    ref = copy.deepcopy(model)
    seeds = [21, 22, 23, 24]
    refs = [run(arch, ref, s) for s in seeds]
    sd = clone_state(model)
    for depth in (1, 2):
        managers = layerwise.configure_layerwise_offload(model, arch.groups, device="cpu", prefetch_depth=depth,
                                                         debug_copy_delay_us=500)
        assert all(m._engine.debug_delay_us == 500 for m in managers)
        for _ in range(3):
            for s, r in zip(seeds, refs):
                assert torch.equal(run(arch, model, s), r), (depth, s)
        copies = managers[1].stats()["last_step"]["copies"]  # single blocks copied through shared slots
        assert copies == recopied(managers[1]) >= 6, copies
        layerwise.remove_layerwise_offload(model)
        assert_state_equal(model, sd)


def test_flux_batch_of_two_and_inference_mode():
    arch = ARCHS["flux"]
    model = build(arch, seed=2)
    ref = copy.deepcopy(model)
    args, kwargs = _flux_inputs(5, batch=2, tokens=12, text=4)
    with torch.no_grad():
        expected = ref(*args, **kwargs)[0]
    layerwise.configure_layerwise_offload(model, arch.groups, device="cpu", prefetch_depth=1)
    with torch.inference_mode():
        for _ in range(2):
            assert torch.equal(model(*args, **kwargs)[0], expected)


@pytest.mark.parametrize("depth,resident", DEPTH_RESIDENT)
def test_llama_generate_matches_resident(depth, resident):
    arch = ARCHS["llama"]
    model = build(arch, seed=3)
    ref = copy.deepcopy(model)
    sd = clone_state(model)
    prompts = [torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(s)) for s in (31, 32)]
    gen = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True,
               pad_token_id=0)
    with torch.no_grad():
        expected = [ref.generate(p, attention_mask=torch.ones_like(p), **gen) for p in prompts]
    assert expected[0].sequences.shape == (2, 11)

    layerwise.configure_layerwise_offload(model, "model.layers", device="cpu", prefetch_depth=depth,
                                          resident_layers=resident)
    with torch.no_grad():
        for p, e in zip(prompts, expected):
            out = model.generate(p, attention_mask=torch.ones_like(p), **gen)
            assert torch.equal(out.sequences, e.sequences)
            assert len(out.logits) == len(e.logits) == 6
            for a, b in zip(out.logits, e.logits):
                assert torch.equal(a, b)
    # One step per forward: prefill plus one per new token (the last token's forward is not needed).
    assert managers_of(model)[0].stats()["steps"] >= 2 * 6
    layerwise.remove_layerwise_offload(model)
    assert_state_equal(model, sd)


# ------------------------------------------------- detect_layer_groups, real
@pytest.mark.parametrize("name", list(ARCHS))
def test_detect_real_architectures_and_auto(name, caplog):
    arch = ARCHS[name]
    model = build(arch, seed=4)
    ref = copy.deepcopy(model)
    sd = clone_state(model)
    hooks = hook_count(model)

    with caplog.at_level(logging.INFO, logger="layerwise"):
        found = detect_layer_groups(model)
    assert found == arch.groups
    lines = [r.getMessage() for r in caplog.records if "detected" in r.getMessage()]
    assert len(lines) == 1
    for g in arch.groups:
        assert f"{g} ({arch.layers[g]} x " in lines[0]
    assert "% of parameter bytes" in lines[0]

    # With example inputs: the order of one real forward; the model is left as it was.
    assert detect_layer_groups(model, example_inputs=arch.inputs(0)) == arch.groups
    assert hook_count(model) == hooks and not model.training
    assert_state_equal(model, sd)

    refs = [run(arch, ref, s) for s in SEEDS[:2]]
    managers = layerwise.configure_layerwise_offload(model, "auto", device="cpu")
    assert [m.layer_name for m in managers] == arch.groups
    for s, r in zip(SEEDS[:2], refs):
        assert torch.equal(run(arch, model, s), r)
    layerwise.remove_layerwise_offload(model)
    assert_state_equal(model, sd)


def test_detect_hunyuan_execution_order_follows_the_forward():
    # The token refiner (inside context_embedder) runs before the dual-stream blocks:
    # record what the forward really enters first, independently of detect_layer_groups.
    arch = ARCHS["hunyuan"]
    model = build(arch, seed=5)
    entered = []
    handles = [model.get_submodule(g)[0].register_forward_pre_hook(lambda m, a, g=g: entered.append(g))
               for g in arch.groups]
    try:
        run(arch, model, 0)
    finally:
        for h in handles:
            h.remove()
    first_seen = list(dict.fromkeys(entered))
    assert first_seen == arch.groups
    assert detect_layer_groups(model, example_inputs=arch.inputs(0)) == first_seen
    # min_fraction decides whether the small refiner counts as a group of its own.
    share = sum(p.numel() for p in model.get_submodule(arch.groups[0]).parameters()) / sum(
        p.numel() for p in model.parameters())
    assert detect_layer_groups(model, min_fraction=share * 1.01) == arch.groups[1:]


def test_detect_full_size_configs_on_the_meta_device():
    # The published default configs, built on the meta device (no memory, no weights).
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from diffusers import FluxTransformer2DModel, HunyuanVideoTransformer3DModel, WanTransformer3DModel
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        flux, hunyuan, wan = FluxTransformer2DModel(), HunyuanVideoTransformer3DModel(), WanTransformer3DModel()
        llama = LlamaForCausalLM(LlamaConfig())
    assert len(flux.transformer_blocks) == 19 and len(flux.single_transformer_blocks) == 38
    assert detect_layer_groups(flux) == ARCHS["flux"].groups
    assert detect_layer_groups(wan) == ["blocks"]
    assert detect_layer_groups(llama) == ["model.layers"]
    # At full size the 2 token-refiner blocks hold about 2% of HunyuanVideo's bytes:
    # below the default min_fraction, found with a lower one.
    assert detect_layer_groups(hunyuan) == ["transformer_blocks", "single_transformer_blocks"]
    assert detect_layer_groups(hunyuan, min_fraction=0.01) == ARCHS["hunyuan"].groups
    # Execution order from a forward on meta tensors (cut short once every list has run).
    meta = dict(device="meta")
    kwargs = dict(hidden_states=torch.empty(1, 16, 1, 4, 4, **meta), timestep=torch.ones(1, dtype=torch.long, **meta),
                  encoder_hidden_states=torch.empty(1, 4, 4096, **meta),
                  encoder_attention_mask=torch.ones(1, 4, **meta), pooled_projections=torch.empty(1, 768, **meta),
                  guidance=torch.ones(1, **meta))
    assert detect_layer_groups(hunyuan, min_fraction=0.01, example_inputs=((), kwargs)) == ARCHS["hunyuan"].groups


# ------------------------------------------------ detect_layer_groups, synthetic
class Block(nn.Module):
    def __init__(self, d, inner=False):
        super().__init__()
        self.fc = nn.Linear(d, d)
        if inner:
            self.sub = nn.ModuleList([nn.Linear(d, d) for _ in range(3)])  # a list inside each block

    def forward(self, x):
        x = torch.relu(self.fc(x))
        for s in getattr(self, "sub", []):
            x = s(x)
        return x


class Flat(nn.Module):
    """No repeated blocks: a Sequential of mixed classes and single modules."""

    def __init__(self, d=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))
        self.one = nn.ModuleList([nn.Linear(d, d)])
        self.acts = nn.ModuleList([nn.ReLU(), nn.ReLU()])  # repeated, but no parameters
        self.head = nn.Linear(d, d)

    def forward(self, x):
        return self.head(self.one[0](self.net(x)))


class Nested(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList([Block(d, inner=True) for _ in range(3)])

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return x


class WithTiny(nn.Module):
    def __init__(self, d=64, t=4):
        super().__init__()
        self.tiny = nn.ModuleList([nn.Linear(t, t) for _ in range(2)])  # ~40 params of ~12.5k
        self.layers = nn.Sequential(*[Block(d) for _ in range(3)])

    def forward(self, x):
        return self.layers(x)


class ReversedDeclaration(nn.Module):
    """decoder_blocks is declared first but runs after encoder_blocks; unused_blocks never runs."""

    def __init__(self, d=16):
        super().__init__()
        self.decoder_blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.unused_blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.encoder_blocks = nn.ModuleList([Block(d) for _ in range(3)])
        self.head = nn.Linear(d, d)
        self.drop = nn.Dropout(0.5)
        self.head_calls = 0

    def forward(self, x):
        x = self.drop(x)
        for b in self.encoder_blocks:
            x = b(x)
        for b in self.decoder_blocks:
            x = b(x)
        self.head_calls += 1
        return self.head(x)


def test_detect_no_repeated_blocks_raises():
    with pytest.raises(ValueError, match="no nn.ModuleList / nn.Sequential.*pass layer_names explicitly"):
        detect_layer_groups(Flat())
    with pytest.raises(ValueError, match="layer_names"):
        layerwise.configure_layerwise_offload(Flat(), "auto", device="cpu")
    with pytest.raises(ValueError, match="min_fraction"):
        detect_layer_groups(Nested(), min_fraction=1.5)


def test_detect_keeps_the_outermost_list():
    model = Nested()
    # The inner lists alone would qualify (each holds ~25% of the bytes) ...
    assert sum(p.numel() for p in model.blocks[0].sub.parameters()) / sum(
        p.numel() for p in model.parameters()) > 0.05
    # ... but they sit inside the blocks of a chosen list.
    assert detect_layer_groups(model) == ["blocks"]
    assert detect_layer_groups(model, min_fraction=0.0) == ["blocks"]


def test_detect_ignores_a_list_below_min_fraction():
    model = WithTiny()
    assert detect_layer_groups(model) == ["layers"]
    assert detect_layer_groups(model, min_fraction=0.0) == ["tiny", "layers"]
    share = sum(p.numel() for p in model.layers.parameters()) / sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError):
        detect_layer_groups(model, min_fraction=share + 0.001)


def test_detect_execution_order_with_example_inputs():
    torch.manual_seed(0)
    model = ReversedDeclaration().train()
    sd = clone_state(model)
    x = torch.randn(2, 16)
    rng = torch.get_rng_state()
    assert detect_layer_groups(model) == ["decoder_blocks", "unused_blocks", "encoder_blocks"]
    order = detect_layer_groups(model, example_inputs=((x,), {}))
    assert order == ["encoder_blocks", "decoder_blocks", "unused_blocks"]  # ran first, then never ran
    assert model.head_calls == 1  # unused_blocks never runs: the whole forward ran, once
    # A bare tensor instead of a tuple of args, and kwargs=None, are accepted too.
    assert detect_layer_groups(model, example_inputs=(x, None)) == order
    # The model is left as it was: training flags, state, hooks, global RNG.
    assert model.training and all(m.training for m in model.modules())
    assert_state_equal(model, sd)
    assert hook_count(model) == 0
    assert torch.equal(torch.get_rng_state(), rng)


def test_detect_stops_the_recording_forward_once_every_group_ran():
    torch.manual_seed(0)
    model = ReversedDeclaration()
    del model.unused_blocks
    x = torch.randn(2, 16)
    assert detect_layer_groups(model, example_inputs=((x,), {})) == ["encoder_blocks", "decoder_blocks"]
    assert model.head_calls == 0  # cut short after decoder_blocks[0] was entered
    managers = layerwise.configure_layerwise_offload(model, "auto", device="cpu")
    assert [m.layer_name for m in managers] == ["decoder_blocks", "encoder_blocks"]  # declaration order


def test_detect_removes_hooks_when_the_forward_fails():
    model = Nested().train()
    bad = torch.randn(2, 7)  # wrong width: embed raises before any block runs
    with pytest.raises(RuntimeError):
        detect_layer_groups(model, example_inputs=((bad,), {}))
    assert hook_count(model) == 0 and model.training
    with pytest.raises(TypeError, match="example_inputs"):
        detect_layer_groups(model, example_inputs=torch.randn(2, 16))


def test_detect_skips_lists_that_share_blocks_with_a_chosen_one():
    model = Nested()
    model.alias = nn.ModuleList(list(model.blocks)[:2])  # the same block objects, listed again
    assert detect_layer_groups(model) == ["blocks"]


# ------------------------------------------------- checkpoint loading, real
@pytest.mark.parametrize("name", list(ARCHS))
def test_real_architectures_load_from_safetensors_bitwise(name, tmp_path):
    # A real checkpoint written from the resident model, loaded into the same
    # architecture built without weights (parameters on meta, buffers on the
    # host, as accelerate.init_empty_weights(include_buffers=False) gives).
    accelerate = pytest.importorskip("accelerate")
    from safetensors.torch import save_model

    arch = ARCHS[name]
    ref = build(arch, seed=4)
    refs = [run(arch, ref, s) for s in SEEDS]
    path = tmp_path / "model.safetensors"
    save_model(ref, str(path))  # drops duplicate names of tied tensors, as real checkpoints do
    with accelerate.init_empty_weights(include_buffers=False):
        torch.manual_seed(4)
        model = arch.build().eval()
    assert all(p.is_meta for p in model.parameters())
    managers = layerwise.load_offloaded(model, path, arch.groups, device="cpu", prefetch_depth=1)
    assert [m.layer_name for m in managers] == arch.groups
    assert not any(p.is_meta for p in model.parameters())
    for _ in range(2):
        for s, r in zip(SEEDS, refs):
            assert torch.equal(run(arch, model, s), r), (name, s)
    layerwise.remove_layerwise_offload(model)
    assert_state_equal(model, clone_state(ref))


# ------------------------------------- tiers composed: disk + compress
def _smallest_host_budget(offload, start=32 << 10, step=16 << 10):
    """The smallest host_budget `offload(budget)` accepts (most layers on disk)."""
    budget = start
    while True:
        try:
            return budget, offload(budget)
        except ValueError as e:
            assert "too small" in str(e), e
            budget += step


@pytest.mark.parametrize("depth,resident", [(1, 0), (2, 1)])
@pytest.mark.parametrize("name", ["flux", "llama"])
def test_real_architectures_disk_and_compress_compose_bitwise(name, depth, resident, tmp_path):
    """A bf16 model with compress="lossless" and a host budget that sends most layers
    to spill files: those are stored encoded there (fewer bytes read and copied), the
    others encoded in memory; bitwise with random copy and read delays, through
    state_dict, load_state_dict and remove."""
    arch = ARCHS[name]
    ref = build(arch).to(torch.bfloat16)
    sd = clone_state(ref)
    other = build(arch, seed=5).to(torch.bfloat16)

    def offload(budget):
        model = copy.deepcopy(ref)
        layerwise.configure_layerwise_offload(model, arch.groups, device="cpu", prefetch_depth=depth,
                                              resident_layers=resident, compress="lossless", host_budget=budget,
                                              spill_dir=str(tmp_path), debug_copy_delay_us=150,
                                              debug_read_delay_us=150)
        return model

    _, model = _smallest_host_budget(offload)
    managers = managers_of(model)
    plan = [r for m in managers for r in m.stats()["tier_plan"]]
    assert any(r == "spill, encoded" for r in plan), plan
    refs = [run_bf16(arch, ref, s) for s in SEEDS[:2]]
    for _ in range(2):
        for s, r in zip(SEEDS, refs):
            assert torch.equal(run_bf16(arch, model, s), r), (name, s)
    moved = [m.stats(sync=True)["last_step"] for m in managers]
    assert sum(last["bytes_read"] for last in moved) > 0, moved  # some layers streamed from their spill file
    for last in moved:
        if last["bytes_raw"]:  # (a group whose layers each have a slot copies nothing after the first step)
            assert last["bytes_copied"] < last["bytes_raw"], last  # encoded on the way (random weights: < 1x)
    assert_state_equal(model, sd)
    model.load_state_dict(other.state_dict())
    assert torch.equal(run_bf16(arch, model, SEEDS[0]), run_bf16(arch, other, SEEDS[0]))
    model.load_state_dict(sd)
    layerwise.remove_layerwise_offload(model)
    assert_state_equal(model, sd)
    assert not list(tmp_path.iterdir())
