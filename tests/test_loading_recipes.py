"""load_offloaded with the ways people really build an empty model and save a checkpoint:
transformers Llama (tied and untied word embeddings) saved with save_pretrained,
diffusers Flux and Wan, built under accelerate.init_empty_weights(), under
`with torch.device("meta")` or with layerwise.empty_model; `dtype=` at load; buffers
no checkpoint holds; scalar and empty tensors.

Every load is compared bitwise with the resident model it was saved from (outputs,
greedy generation, state_dict). transformers, diffusers and accelerate are test
extras: a test that needs one skips where it is not installed."""
import logging
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import layerwise
from layerwise.configure import managers_of

from helpers.archs import ARCHS, run, run_bf16

README = Path(__file__).resolve().parent.parent / "README.md"


# ------------------------------------------------------------------ helpers
def llama_config(tie: bool):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=tie,
    )


def resident_llama(tie: bool, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config(tie)).eval()
    with torch.no_grad():  # random (not zero) biases and norms, so every tensor matters
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.1)
    return model


def empty(recipe: str, build):
    """`build()` without weights, the way `recipe` says."""
    if recipe == "init_empty_weights":
        accelerate = pytest.importorskip("accelerate")
        with accelerate.init_empty_weights():
            return build()
    if recipe == "meta":
        with torch.device("meta"):
            return build()
    assert recipe == "empty_model"
    return layerwise.empty_model(build)


def checkpoint(folder) -> str:
    """What save_pretrained wrote: the index JSON if sharded, else the one file."""
    names = os.listdir(folder)
    index = [n for n in names if n.endswith(".safetensors.index.json")]
    if index:
        return os.path.join(folder, index[0])
    (single,) = [n for n in names if n.endswith(".safetensors")]
    return os.path.join(folder, single)


PROMPT = torch.tensor([[5, 17, 99, 3, 42, 7], [64, 8, 11, 120, 33, 9]])


def generate(model):
    with torch.no_grad():
        out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=8, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def state(model) -> dict:
    """state_dict plus the non-persistent buffers (rotary tables), on the host."""
    out = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    out.update({f"buffer:{k}": b.detach().cpu().clone() for k, b in model.named_buffers()})
    return out


def assert_bitwise(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (k, a[k].dtype, b[k].dtype)
        assert torch.equal(raw(a[k]), raw(b[k])), k


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` (bitwise equality: NaNs and -0.0 included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def untouched(model, before: dict) -> bool:
    """The model holds the same parameter objects under the same names as before, has no hooks."""
    now = {n: (id(p), p.dtype) for n, p in model.named_parameters(remove_duplicate=False)}
    return (now == before and not managers_of(model)
            and sum(len(m._forward_pre_hooks) for m in model.modules()) == 0)


def registered(model) -> dict:
    return {n: (id(p), p.dtype) for n, p in model.named_parameters(remove_duplicate=False)}


# ------------------------------------------------- Llama: tied and untied
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("recipe", ["init_empty_weights", "meta", "empty_model"])
def test_llama_from_save_pretrained_generates_bitwise(tmp_path, caplog, tie, recipe):
    from transformers import LlamaForCausalLM

    ref = resident_llama(tie)
    sharded = tie and recipe == "meta"  # one case through an index of several shards
    ref.save_pretrained(tmp_path, **({"max_shard_size": "20KB"} if sharded else {}))
    path = checkpoint(tmp_path)
    assert path.endswith(".index.json") == sharded
    if tie:  # save_pretrained keeps one name of the pair
        from safetensors import safe_open

        keys = set()
        for f in tmp_path.glob("*.safetensors"):
            with safe_open(str(f), "pt") as sf:
                keys |= set(sf.keys())
        assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    want_seq, want_logits = generate(ref)

    model = empty(recipe, lambda: LlamaForCausalLM(llama_config(tie)).eval())
    with caplog.at_level(logging.INFO, logger="layerwise"):
        layerwise.load_offloaded(model, path, ["model.layers"], device="cpu")
    # init_empty_weights re-creates every parameter it registers, so the pair arrives untied.
    assert ("tied them" in caplog.text) == (tie and recipe == "init_empty_weights")
    assert ("recomputed 2 buffer(s)" in caplog.text) == (recipe == "meta")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    seq, logits = generate(model)
    assert torch.equal(seq, want_seq)
    assert torch.equal(logits, want_logits)
    assert_bitwise(state(model), state(ref))
    layerwise.remove_layerwise_offload(model)
    assert_bitwise(state(model), state(ref))


def test_either_name_of_a_tied_pair_fills_both(tmp_path):
    from transformers import LlamaForCausalLM

    ref = resident_llama(True)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "model.embed_tokens.weight"}
    save_file(sd, str(tmp_path / "lm_head_only.safetensors"))  # the other half this time
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(True)).eval()
    layerwise.load_offloaded(model, tmp_path / "lm_head_only.safetensors", ["model.layers"], device="cpu")
    assert torch.equal(model.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    assert torch.equal(generate(model)[1], generate(ref)[1])


def test_a_tied_pair_stored_twice_must_agree(tmp_path):
    from transformers import LlamaForCausalLM

    ref = resident_llama(True)
    sd = {k: v.clone() for k, v in ref.state_dict().items()}  # both names, separate storages
    save_file(sd, str(tmp_path / "both.safetensors"))
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(True)).eval()
    layerwise.load_offloaded(model, tmp_path / "both.safetensors", ["model.layers"], device="cpu")
    assert torch.equal(generate(model)[1], generate(ref)[1])

    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    save_file(sd, str(tmp_path / "differ.safetensors"))
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(True)).eval()
    before = registered(model)
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' and 'lm_head.weight' differ, but the model "
                                         "ties them.*tie_word_embeddings=False"):
        layerwise.load_offloaded(model, tmp_path / "differ.safetensors", ["model.layers"], device="cpu")
    assert untouched(model, before)


def test_key_mismatch_lists_missing_and_unexpected_cleanly(tmp_path):
    from transformers import LlamaForCausalLM

    # A tied checkpoint into an untied model: lm_head.weight is really missing.
    resident_llama(True).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(False)).eval()
    with pytest.raises(KeyError) as e:
        layerwise.load_offloaded(model, checkpoint(tmp_path), ["model.layers"], device="cpu")
    assert e.value.args[0] == "checkpoint does not match the model: missing 1 tensor(s): lm_head.weight"

    sd = {k: v.contiguous() for k, v in resident_llama(False).state_dict().items()
          if ".mlp." not in k or ".layers.0." in k}
    sd.update({f"extra.{i}": torch.zeros(1) for i in range(10)})
    save_file(sd, str(tmp_path / "odd.safetensors"))
    with pytest.raises(KeyError) as e:
        layerwise.load_offloaded(model, tmp_path / "odd.safetensors", ["model.layers"], device="cpu")
    missing = [f"model.layers.{i}.mlp.{p}_proj.weight" for i in range(1, 5) for p in ("gate", "up", "down")]
    assert e.value.args[0] == (
        "checkpoint does not match the model: missing 12 tensor(s): " + ", ".join(missing[:8]) + " (and 4 more); "
        "unexpected 10 tensor(s): " + ", ".join(sorted(f"extra.{i}" for i in range(10))[:8]) + " (and 2 more)")
    with pytest.raises(KeyError) as e:
        layerwise.load_offloaded(model, tmp_path / "odd.safetensors", ["model.layers"], device="cpu", strict=False)
    assert e.value.args[0].endswith("(and 4 more)")  # unexpected ones not mentioned when not strict


def test_a_failed_load_unties_and_untypes_again(tmp_path):
    """Ties and dtype= change the model's parameter objects before planning: a load that
    fails afterwards gives the original objects back."""
    accelerate = pytest.importorskip("accelerate")
    from transformers import LlamaForCausalLM

    ref = resident_llama(True)
    sd = {k: v.clone() for k, v in ref.state_dict().items() if k not in ("model.norm.weight", "lm_head.weight")}
    save_file(sd, str(tmp_path / "short.safetensors"))
    with accelerate.init_empty_weights():
        model = LlamaForCausalLM(llama_config(True)).eval()
    before = registered(model)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    with pytest.raises(KeyError, match="missing 1 tensor.*model.norm.weight"):
        layerwise.load_offloaded(model, tmp_path / "short.safetensors", ["model.layers"], device="cpu",
                                 dtype=torch.bfloat16)
    assert untouched(model, before)


# ----------------------------------------------------- diffusers: Flux, Wan
@pytest.mark.parametrize("name", ["flux", "wan"])
def test_diffusers_from_meta_bitwise(tmp_path, name):
    arch = ARCHS[name]
    pytest.importorskip(arch.package)
    torch.manual_seed(0)
    ref = arch.build().eval()
    ref.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = type(ref).from_config(type(ref).load_config(tmp_path)).eval()
    layerwise.load_offloaded(model, checkpoint(tmp_path), arch.groups, device="cpu")
    for seed in (1, 2):
        assert torch.equal(run(arch, model, seed), run(arch, ref, seed))
    assert_bitwise(state(model), state(ref))


# ------------------------------------------------------------------ dtype=
def _cast_inputs(kwargs, dtype):
    return {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}


@pytest.mark.parametrize("name,saved,loaded", [
    ("llama", torch.float32, torch.bfloat16),
    ("llama", torch.bfloat16, torch.float32),
    ("flux", torch.float32, torch.float16),
    ("flux", torch.float16, torch.bfloat16),
])
def test_dtype_at_load_is_model_to_dtype(tmp_path, name, saved, loaded):
    """For a model that declares no fp32 modules to keep (Wan, T5:
    test_dtype_at_load_keeps_fp32_modules_as_from_pretrained)."""
    arch = ARCHS[name]
    pytest.importorskip(arch.package)
    torch.manual_seed(0)
    ref = arch.build().eval().to(saved)
    ref.save_pretrained(tmp_path)
    want = arch.build().eval()  # the resident model the checkpoint makes, cast the ordinary way
    want.load_state_dict(ref.state_dict())
    want = want.to(loaded)
    with torch.device("meta"):
        model = arch.build().eval()  # built in fp32, whatever was saved
    before = registered(model)

    if saved != torch.float32:  # without dtype=, another dtype is an error that says what to pass
        with pytest.raises(ValueError, match=rf"is {saved}\[.* but the model expects torch.float32\[.*pass "
                                             rf"dtype=torch.float32 to load_offloaded.*or dtype={saved}"):
            layerwise.load_offloaded(model, checkpoint(tmp_path), arch.groups, device="cpu")
        assert untouched(model, before)

    layerwise.load_offloaded(model, checkpoint(tmp_path), arch.groups, device="cpu", dtype=loaded)
    assert all(p.dtype == loaded for p in model.parameters())
    assert_bitwise(state(model), state(want))
    for seed in (1, 2):
        args, kwargs = arch.inputs(seed)
        with torch.no_grad():
            a = arch.output(model(*args, **_cast_inputs(kwargs, loaded)))
            b = arch.output(want(*args, **_cast_inputs(kwargs, loaded)))
        assert a.dtype == loaded and torch.equal(a, b)
    if name == "llama":
        assert all(torch.equal(x, y) for x, y in zip(generate(model), generate(want)))


class Scalars(nn.Module):
    """Layers and non-layer parts with 0-dim and empty parameters, an integer buffer,
    a transposed weight and a non-persistent buffer computed in __init__."""

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.lin = nn.Linear(d, d)
            self.gain = nn.Parameter(torch.randn(()))  # 0-dim, 4 bytes
            self.half_gain = nn.Parameter(torch.randn((), dtype=torch.float16))
            self.none = nn.Parameter(torch.randn(0, 3))  # no elements
            self.w_t = nn.Parameter(torch.randn(d, d).t())
            self.register_buffer("steps", torch.arange(d, dtype=torch.int64))
            self.register_buffer("count", torch.tensor(7, dtype=torch.int32))  # 0-dim integer

        def forward(self, x):
            y = self.lin(x) @ self.w_t * self.gain + self.half_gain.float() + self.none.sum()
            return y + self.steps.to(y.dtype) / 100 + self.count

    def __init__(self, d=16, n=4):
        super().__init__()
        self.blocks = nn.ModuleList(self.Block(d) for _ in range(n))
        self.temperature = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
        self.register_buffer("freqs", 1.0 / 10000 ** (torch.arange(d) / d), persistent=False)
        self.register_buffer("offset", torch.tensor(3.0))  # 0-dim, persistent

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x * self.temperature.to(x.dtype) + self.freqs.to(x.dtype) + self.offset


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float64])
def test_scalars_empty_tensors_and_integers(tmp_path, dtype):
    torch.manual_seed(0)
    ref = Scalars().eval()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "s.safetensors"))
    model = layerwise.empty_model(Scalars).eval()
    assert all(p.is_meta for p in model.parameters()) and not model.freqs.is_meta
    layerwise.load_offloaded(model, tmp_path / "s.safetensors", "blocks", device="cpu", dtype=dtype)
    want = ref if dtype is None else ref.to(dtype)
    assert model.blocks[0].steps.dtype == torch.int64 and model.blocks[0].count.dtype == torch.int32
    assert_bitwise(state(model), state(want))
    x = torch.randn(3, 16, dtype=dtype or torch.float32)
    with torch.no_grad():
        assert torch.equal(model(x), want(x))


# ------------------------------------------------ buffers no checkpoint holds
class Rotary(nn.Module):
    """A RoPE table computed in __init__ and never saved, with no config to rebuild it from."""

    def __init__(self, d, theta):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, d, 2).float() / d), persistent=False)


class WithRotary(nn.Module):
    def __init__(self, d=16, theta=500.0):
        super().__init__()
        self.rope = Rotary(d, theta)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x) * torch.cat([self.rope.inv_freq, self.rope.inv_freq])
        return x


def test_unrecoverable_meta_buffer_names_it_and_the_recipe_works(tmp_path):
    torch.manual_seed(0)
    ref = WithRotary().eval()
    save_file(ref.state_dict(), str(tmp_path / "r.safetensors"))
    with torch.device("meta"):
        model = WithRotary()
    before = registered(model)
    with pytest.raises(ValueError) as e:
        layerwise.load_offloaded(model, tmp_path / "r.safetensors", "blocks", device="cpu")
    msg = str(e.value)
    assert "buffer 'rope.inv_freq' is on the meta device and not in the checkpoint" in msg
    assert "neither Rotary nor a module above it has a config" in msg
    assert untouched(model, before)
    # The error names the recipe that works: layerwise.empty_model(WithRotary, ...)
    recipe = re.search(r"`model = (layerwise\.empty_model\(WithRotary), \.\.\.\)`", msg)
    assert recipe
    model = eval(recipe.group(1) + ")", {"layerwise": layerwise, "WithRotary": WithRotary})
    layerwise.load_offloaded(model, tmp_path / "r.safetensors", "blocks", device="cpu")
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_empty_model_keeps_ties_and_buffers():
    from transformers import LlamaForCausalLM

    model = layerwise.empty_model(LlamaForCausalLM, llama_config(True))
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # a plain tie in __init__ of a parameter registered twice before it moved
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            w = nn.Parameter(torch.randn(4, 4))
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.a.weight = w
            self.b.weight = w

    s = layerwise.empty_model(Shared)
    assert s.a.weight is s.b.weight and s.a.weight.is_meta
    assert nn.Module.register_parameter.__qualname__ == "Module.register_parameter"  # put back


def test_bad_dtype_is_refused(tmp_path):
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        layerwise.load_offloaded(nn.Linear(2, 2), tmp_path / "x.safetensors", "x", dtype=torch.int8)


# ----------------------------------------------------------- README recipes
def _readme_recipes(disk=False):
    # (the recipes the README showed live in docs/: the loading recipes and the disk tier's)
    text = (README.parent / "docs" / ("disk-tier.md" if disk else "loading.md")).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return [b for b in blocks if "load_offloaded(" in b and "from_config" in b and ("host_budget" in b) == disk
            and "quantize_(" not in b]  # (the quantized recipe: tests/formats/test_quantized.py runs it)


def _from_pretrained(path, transformers_model: bool):
    """What the library itself loads from `path` in bf16: the reference the recipes must equal."""
    if transformers_model:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(path, torch_dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("sharded", [True, False])
def test_readme_recipes_run_as_written(tmp_path, sharded):
    """The loading recipes of docs/loading.md, run as written (device "cuda" -> "cpu"), on
    the folder save_pretrained wrote in bf16, sharded (an index JSON) or a single
    file: bitwise equal to from_pretrained(path, dtype=torch.bfloat16) itself."""
    recipes = _readme_recipes()
    assert len(recipes) == 2, "README: expected the transformers and the diffusers loading recipe"
    for code in recipes:
        llm = "from transformers" in code
        if llm:
            ref = resident_llama(True).to(torch.bfloat16)
            ref.save_pretrained(tmp_path / "llm", **({"max_shard_size": "20KB"} if sharded else {}))
            path, out = str(tmp_path / "llm"), "model"
        else:
            arch = ARCHS["flux"]
            pytest.importorskip(arch.package)
            torch.manual_seed(0)
            ref = arch.build().eval().to(torch.bfloat16)
            ref.save_pretrained(tmp_path / "flux", **({"max_shard_size": "200KB"} if sharded else {}))
            path, out = str(tmp_path / "flux"), "transformer"
        want = _from_pretrained(path, llm)
        scope = {"path": path}
        exec(code.replace('"cuda"', '"cpu"'), scope)
        model = scope[out]
        assert_bitwise(state(model), state(want))
        if llm:
            assert all(torch.equal(x, y) for x, y in zip(generate(model), generate(want)))
        else:
            args, kwargs = arch.inputs(1)
            with torch.no_grad():
                a = arch.output(model(*args, **_cast_inputs(kwargs, torch.bfloat16)))
                b = arch.output(want(*args, **_cast_inputs(kwargs, torch.bfloat16)))
            assert torch.equal(a, b)


def test_readme_disk_tier_recipe_runs_as_written(tmp_path):
    """The disk tier's recipe (docs/disk-tier.md), as written (device "cuda" -> "cpu", the
    budget a quarter of the model's bytes, or the least that works if more), against
    from_pretrained(path, dtype=torch.bfloat16)."""
    (code,) = _readme_recipes(disk=True)
    transformers = pytest.importorskip("transformers")
    config = llama_config(True)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 128, 512, 12  # layers dominate
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16).save_pretrained(tmp_path / "llm")
    ref = _from_pretrained(str(tmp_path / "llm"), True)
    model_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    budget = model_bytes // 4
    while True:
        scope = {"path": str(tmp_path / "llm")}
        try:
            exec(code.replace('"cuda"', '"cpu"').replace("budget = 16 << 30", f"budget = {budget}"), scope)
            break
        except ValueError as err:
            assert "too small" in str(err)
            budget += model_bytes // 16
    model = scope["model"]
    (m,) = layerwise.contract.managers_of(model)
    assert sum(s.kind == "disk" for s in m.sources) >= m.num_layers // 2
    assert all(torch.equal(x, y) for x, y in zip(generate(model), generate(ref)))
    assert_bitwise(state(model), state(ref))
    assert m.stats()["last_step"]["bytes_read"] > 0


@pytest.mark.parametrize("name", ["llama"])
def test_dtype_at_load_warns_where_from_pretrained_keeps_fp32(tmp_path, caplog, name):
    """dtype= is model.to(dtype) for a model with no fp32 modules to keep: where
    from_pretrained(dtype=) keeps a buffer the model computes in fp32 (Llama's inv_freq),
    a WARNING names it. (Wan's _keep_in_fp32_modules stay fp32: no warning,
    test_dtype_at_load_keeps_fp32_modules_as_from_pretrained.)"""
    arch = ARCHS[name]
    pytest.importorskip(arch.package)
    torch.manual_seed(0)
    arch.build().eval().save_pretrained(tmp_path)
    with torch.device("meta"):
        model = arch.build().eval()
    with caplog.at_level(logging.WARNING, logger="layerwise"):
        layerwise.load_offloaded(model, checkpoint(tmp_path), arch.groups, device="cpu", dtype=torch.bfloat16)
    text = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "from_pretrained" in text, text
    assert "inv_freq" in text, text
    layerwise.remove_layerwise_offload(model)
    caplog.clear()
    with torch.device("meta"):
        model = arch.build().eval()
    with caplog.at_level(logging.WARNING, logger="layerwise"):  # fp32 to fp32: nothing to warn about
        layerwise.load_offloaded(model, checkpoint(tmp_path), arch.groups, device="cpu", dtype=torch.float32)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING and "from_pretrained" in r.getMessage()]


def test_wan_cast_whole_to_bf16_is_refused_against_a_from_pretrained_checkpoint(tmp_path):
    """The README's note: Wan under from_pretrained(torch_dtype=bf16) keeps its
    _keep_in_fp32_modules in fp32; a model cast whole to bf16 is refused, naming the tensor."""
    arch = ARCHS["wan"]
    pytest.importorskip(arch.package)
    torch.manual_seed(0)
    arch.build().eval().save_pretrained(tmp_path / "fp32")
    type(arch.build()).from_pretrained(tmp_path / "fp32", torch_dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    with torch.device("meta"):
        model = arch.build().eval().to(torch.bfloat16)
    before = registered(model)
    with pytest.raises(ValueError, match=r"is torch.float32.* but the model expects torch.bfloat16"):
        layerwise.load_offloaded(model, checkpoint(tmp_path / "bf16"), arch.groups, device="cpu")
    assert untouched(model, before)


# -------------------------------- dtype= keeps what from_pretrained keeps in fp32
def _t5(kind):
    import transformers

    cls, cfg = {"t5": (transformers.T5EncoderModel, transformers.T5Config),
                "umt5": (transformers.UMT5EncoderModel, transformers.UMT5Config)}[kind]
    return cls, cfg(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=4, num_heads=4,
                    feed_forward_proj="gated-gelu")


def _keep_case(name):
    """(resident model, build on meta from the saved folder, from_pretrained(folder, dtype), groups, forward)."""
    if name == "wan":
        arch = ARCHS["wan"]
        pytest.importorskip(arch.package)
        cls = type(arch.build())

        def forward(model, dtype):
            args, kwargs = arch.inputs(1)
            with torch.no_grad():
                return arch.output(model(*args, **_cast_inputs(kwargs, dtype)))

        return (arch.build, lambda path: cls.from_config(cls.load_config(path)),
                lambda path, dtype: cls.from_pretrained(path, torch_dtype=dtype), arch.groups, forward)
    pytest.importorskip("transformers")
    cls, cfg = _t5(name)
    ids = torch.tensor([[5, 17, 9, 3, 42, 7], [6, 8, 11, 60, 33, 1]])

    def forward(model, dtype):
        with torch.no_grad():
            return model(input_ids=ids).last_hidden_state

    return (lambda: cls(cfg), lambda path: cls(cfg), lambda path, dtype: cls.from_pretrained(path, dtype=dtype),
            ["encoder.block"], forward)


@pytest.mark.parametrize("name,dtype,kept", [
    ("wan", torch.bfloat16, True), ("wan", torch.float16, True),  # diffusers: any dtype
    ("t5", torch.float16, True), ("umt5", torch.float16, True),   # transformers: _keep_in_fp32_modules in fp16 only
    ("t5", torch.bfloat16, False),                                # (_strict ones in bf16 too)
])
@pytest.mark.parametrize("build", ["meta", "meta_cast", "init_empty_weights_cast"])
def test_dtype_at_load_keeps_fp32_modules_as_from_pretrained(tmp_path, caplog, name, dtype, kept, build):
    """The recipe for a model that declares _keep_in_fp32_modules: build it without weights
    (in the dtype it was declared in, or already cast), load_offloaded(..., dtype=): every
    parameter and buffer in the dtype from_pretrained(path, dtype) gives it, and the
    same bits out, with no WARNING (there is no difference left to warn about)."""
    make, on_meta, from_pretrained, groups, forward = _keep_case(name)
    torch.manual_seed(0)
    make().eval().save_pretrained(tmp_path)
    want = from_pretrained(tmp_path, dtype).eval()
    fp32 = sorted(n for n, p in want.named_parameters() if p.dtype == torch.float32)
    assert bool(fp32) == kept, fp32  # the case really has modules kept in fp32 (or none)
    if build == "init_empty_weights_cast":  # buffers computed for real, then cast down with the rest
        accelerate = pytest.importorskip("accelerate")
        with accelerate.init_empty_weights():
            model = on_meta(tmp_path).eval().to(dtype)
    else:
        with torch.device("meta"):
            model = on_meta(tmp_path).eval()
        if build == "meta_cast":
            model = model.to(dtype)
    with caplog.at_level(logging.WARNING, logger="layerwise"):
        layerwise.load_offloaded(model, checkpoint(tmp_path), groups, device="cpu", dtype=dtype)
    assert not [r for r in caplog.records if r.name == "layerwise" and r.levelno >= logging.WARNING], caplog.text
    assert {n: p.dtype for n, p in model.named_parameters()} == {n: p.dtype for n, p in want.named_parameters()}
    assert_bitwise(state(model), state(want))
    for _ in range(2):
        a, b = forward(model, dtype), forward(want, dtype)
        assert a.dtype == b.dtype and torch.equal(raw(a), raw(b))
    layerwise.remove_layerwise_offload(model)
    assert_bitwise(state(model), state(want))


def test_wan_checkpoint_saved_by_from_pretrained_loads_into_a_bf16_model_with_dtype(tmp_path):
    """The checkpoint a bf16 Wan pipeline saves (fp32 _keep_in_fp32_modules, bf16 elsewhere),
    into a model cast whole to bf16: refused without dtype= (naming the tensor and dtype=),
    then with the dtype= it names, equal to from_pretrained."""
    arch = ARCHS["wan"]
    pytest.importorskip(arch.package)
    cls = type(arch.build())
    torch.manual_seed(0)
    arch.build().eval().save_pretrained(tmp_path / "fp32")
    cls.from_pretrained(tmp_path / "fp32", torch_dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    want = cls.from_pretrained(tmp_path / "bf16", torch_dtype=torch.bfloat16).eval()
    with torch.device("meta"):
        model = cls.from_config(cls.load_config(tmp_path / "bf16")).eval().to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"is torch.float32.* but the model expects torch.bfloat16.*"
                                         r"pass dtype=torch.bfloat16 to load_offloaded"):
        layerwise.load_offloaded(model, checkpoint(tmp_path / "bf16"), arch.groups, device="cpu")
    layerwise.load_offloaded(model, checkpoint(tmp_path / "bf16"), arch.groups, device="cpu", dtype=torch.bfloat16)
    assert_bitwise(state(model), state(want))
    for seed in (1, 2):
        assert torch.equal(run_bf16(arch, model, seed), run_bf16(arch, want, seed))


def test_strict_fp32_patterns_match_as_transformers_matches_them(tmp_path, caplog):
    """transformers' _keep_in_fp32_modules_strict (kept in bf16 too) are patterns, `*` any
    text, searched anywhere in the name (not diffusers' dot-separated parts): "Dense*.wo"
    keeps DenseReluDense.wo.weight. dtype= keeps exactly what from_pretrained keeps."""
    transformers = pytest.importorskip("transformers")

    class StrictT5(transformers.T5EncoderModel):
        _keep_in_fp32_modules_strict = ("Dense*.wo",)

    _, cfg = _t5("t5")
    torch.manual_seed(0)
    StrictT5(cfg).eval().save_pretrained(tmp_path)
    want = StrictT5.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    with torch.device("meta"):
        model = StrictT5(cfg).eval()
    with caplog.at_level(logging.WARNING, logger="layerwise"):
        layerwise.load_offloaded(model, checkpoint(tmp_path), ["encoder.block"], device="cpu", dtype=torch.bfloat16)
    assert not [r for r in caplog.records if r.name == "layerwise" and r.levelno >= logging.WARNING], caplog.text
    kept = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert kept == {f"encoder.block.{i}.layer.1.DenseReluDense.wo.weight" for i in range(4)}
    assert {n: p.dtype for n, p in model.named_parameters()} == {n: p.dtype for n, p in want.named_parameters()}
    assert_bitwise(state(model), state(want))
    ids = torch.tensor([[5, 17, 9, 3, 42, 7]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).last_hidden_state, want(input_ids=ids).last_hidden_state)


# ------------------------------------------------- found by attacking the loader
class _Cfg:
    dim = 8


class _Rope(nn.Module):
    def __init__(self, config, scaled=True):
        super().__init__()
        self.config, self.scaled = config, scaled
        inv = 1.0 / (10000 ** (torch.arange(0, config.dim, 2).float() / config.dim))
        self.register_buffer("inv", inv / 4 if scaled else inv, persistent=False)


class _RopeModel(nn.Module):
    def __init__(self, scaled_unscaled=False):
        super().__init__()
        cfg = _Cfg()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.rope = _Rope(cfg, scaled=not scaled_unscaled)

    def forward(self, x):
        for b in self.blocks:
            x = b(x) * self.rope.inv.repeat(2)
        return x


def test_a_buffer_owner_built_with_other_arguments_is_not_guessed(tmp_path):
    # Rebuilding `_Rope(config)` would give the scaled table where the model holds the
    # unscaled one (same shape): a silent wrong value. It must be an error instead.
    torch.manual_seed(0)
    src = _RopeModel(scaled_unscaled=True)
    save_file(src.state_dict(), str(tmp_path / "m.safetensors"))
    with torch.device("meta"):
        model = _RopeModel(scaled_unscaled=True)
    with pytest.raises(ValueError, match=r"rope\.inv.*built with other arguments.*empty_model"):
        layerwise.load_offloaded(model, tmp_path / "m.safetensors", ["blocks"], device="cpu")
    assert not managers_of(model)
    model = layerwise.empty_model(_RopeModel, scaled_unscaled=True)  # the recipe the error names works
    layerwise.load_offloaded(model, tmp_path / "m.safetensors", ["blocks"], device="cpu")
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), src(x))


def test_a_non_persistent_buffer_in_a_checkpoint_is_not_loaded(tmp_path):
    torch.manual_seed(0)
    src = _RopeModel()
    sd = dict(src.state_dict())
    sd["rope.inv"] = torch.zeros_like(src.rope.inv)  # an old checkpoint that stored a computed table
    save_file(sd, str(tmp_path / "m.safetensors"))
    with pytest.raises(KeyError, match=r"unexpected 1 tensor\(s\): rope\.inv"):
        layerwise.load_offloaded(layerwise.empty_model(_RopeModel), tmp_path / "m.safetensors", ["blocks"],
                                 device="cpu")
    model = layerwise.empty_model(_RopeModel)
    layerwise.load_offloaded(model, tmp_path / "m.safetensors", ["blocks"], device="cpu", strict=False)
    assert torch.equal(model.rope.inv, src.rope.inv)  # computed, as torch's load_state_dict leaves it
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), src(x))


def test_empty_model_in_one_thread_leaves_other_threads_modules_alone():
    import threading

    inside, release = threading.Event(), threading.Event()
    original = nn.Module.register_parameter

    def slow_factory():
        m = nn.Linear(4, 4)
        inside.set()
        release.wait(10)
        return m

    out = {}
    t = threading.Thread(target=lambda: out.setdefault("m", layerwise.empty_model(slow_factory)))
    t.start()
    assert inside.wait(10)
    try:
        other = nn.Linear(4, 4)  # built meanwhile on the main thread
    finally:
        release.set()
        t.join(10)
    assert not other.weight.is_meta and not other.bias.is_meta
    assert out["m"].weight.is_meta
    assert nn.Module.register_parameter is original  # given back once no thread builds an empty model
    assert not nn.Linear(2, 2).weight.is_meta
