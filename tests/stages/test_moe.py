"""Routed experts (layerwise/planning/experts.py, layerwise/stages/experts.py):
tiny Mixtral, Qwen3-MoE, OLMoE and DeepSeek-V3 (shared experts, a dense first
layer) from small configs on the CPU backend, with random copy delays: outputs
bitwise the resident model's; bytes per decode step against the ideal (the
non-expert bytes + the experts used); the state contract; refusals. And what
routed experts compose with: load_offloaded and offload_pipeline,
compress="lossless" (each expert's rows encoded on their own), the disk tier
(spill files and the checkpoint: experts' rows read on demand), both, per-expert
ModuleList experts (plain, torchao, quanto), SIGINTs."""
import copy
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import layerwise
from layerwise.runtime import expert_hooks

from helpers.moe import ARCHS, _bf16, _host_budget, _ids, _make, _mixtral


def _run(model, ids, new=5):
    with torch.no_grad():
        logits = model(ids).logits
        gen = model.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)
    return logits, gen


def _configure(model, **kw):
    kw.setdefault("debug_copy_delay_us", 300)
    return layerwise.configure_layerwise_offload(model, "model.layers", device="cpu", experts="routed", **kw)


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("cache", [None, "auto"])
def test_routed_is_bitwise_the_resident_model(arch, depth, cache):
    ref = _make(arch)
    model = copy.deepcopy(ref)
    ids = _ids(batch=2)
    want = _run(ref, ids)
    (m,) = _configure(model, prefetch_depth=depth, expert_cache=cache)
    assert m.experts is not None and len(m.experts.layers) == (5 if arch == "deepseek" else 6)
    got = _run(model, ids)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    st = m.stats(sync=True)["experts"]
    assert st["misses"] > 0 and st["experts_used"] == st["hits"] + st["misses"]
    if cache is not None:
        assert st["cache_hits"] > 0 and st["cache_bytes"] > 0
    layerwise.remove_layerwise_offload(model)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


@pytest.mark.parametrize("arch", ["mixtral", "deepseek"])
def test_speculative_prefetch_costs_bytes_never_correctness(arch):
    ref = _make(arch)
    model = copy.deepcopy(ref)
    ids = _ids(batch=1)
    want = _run(ref, ids, new=8)
    (m,) = _configure(model, prefetch_depth=2, expert_prefetch=True)
    got = _run(model, ids, new=8)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    st = m.stats(sync=True)["experts"]
    assert st["speculative_bytes"] > 0
    assert st["speculative_used_bytes"] + st["speculative_wasted_bytes"] == st["speculative_bytes"]


def test_bf16_experts_bitwise():
    torch.manual_seed(0)
    ref = _mixtral(torch.bfloat16)
    model = copy.deepcopy(ref)
    ids = _ids(batch=3)
    want = _run(ref, ids)
    _configure(model, expert_cache=1 << 20)
    got = _run(model, ids)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_resident_layers_and_set_residency():
    ref = _make("qwen3")
    model = copy.deepcopy(ref)
    ids = _ids(batch=2)
    want = _run(ref, ids)
    (m,) = _configure(model, resident_layers=1, expert_cache="auto")
    assert torch.equal(_run(model, ids)[1], want[1])
    m.set_residency([2, 3], prefetch_depth=2)
    got = _run(model, ids)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


# ---------------------------------------------------------------------- bytes
def _step_bytes(model, m, ids, steps):
    """(ours, ideal) per decode step: bytes_copied of the step, and the non-expert
    bytes of the streamed layers plus the experts its forwards used."""
    used = [set()]
    handles = []
    for i, mods in m.experts.layers.items():
        for k, xm in enumerate(mods):
            def rec(mod, args, kwargs, i=i, xm=xm):
                used[-1].update((i, xm.name, x) for x in expert_hooks.chosen_experts(xm.routed(args, kwargs),
                                                                                     xm.num_experts))
            handles.append(xm.module.register_forward_pre_hook(rec, with_kwargs=True))
    unit = {(i, xm.name): xm.unit_bytes for i, mods in m.experts.layers.items() for xm in mods}
    expert_ids = {id(e) for mods in m.experts.layers.values() for xm in mods for e in xm.entries}
    streamed = set(m.ring.streamed)
    base = sum(e.numel * e.dtype.itemsize for lp in m.plan.layers if lp.index in streamed
               for e in lp.params if id(e) not in expert_ids)
    out = []
    past = None
    with torch.no_grad():
        o = model(ids, use_cache=True)
        past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            used.append(set())
            o = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
            ours = m.stats(sync=True)["last_step"]["bytes_copied"]
            ideal = base + sum(unit[(i, name)] for i, name, _ in used[-1])
            out.append((ours, ideal))
    for h in handles:
        h.remove()
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_decode_bytes_at_most_1_1x_the_ideal(arch):
    model = _make(arch)
    (m,) = _configure(model, debug_copy_delay_us=None)
    rows = _step_bytes(model, m, _ids(batch=1), steps=6)
    for ours, ideal in rows:
        assert ours <= 1.1 * ideal, rows
    full = sum(lp.nbytes for lp in m.plan.layers)
    assert rows[-1][0] < 0.8 * full  # (and far below the whole layers)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3"])
def test_decode_bytes_below_the_ideal_with_a_warm_cache(arch):
    model = _make(arch)
    (m,) = _configure(model, debug_copy_delay_us=None, expert_cache=m_bytes(model))
    rows = _step_bytes(model, m, _ids(batch=1), steps=12)
    warm = rows[6:]
    assert all(ours <= 1.1 * ideal for ours, ideal in rows)
    assert all(ours < ideal for ours, ideal in warm), rows
    assert m.stats()["experts"]["cache_hits"] > 0


def m_bytes(model):
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


# ------------------------------------------------------------- state contract
def test_state_dict_gives_true_bytes_of_experts_never_fetched():
    ref = _make("mixtral")
    model = copy.deepcopy(ref)
    _configure(model, expert_cache="auto")
    _run(model, _ids(batch=1), new=2)
    sd, want = model.state_dict(), ref.state_dict()
    assert sd.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(sd[k], v), k


@pytest.mark.parametrize("cache", [None, 1 << 22])
def test_load_state_dict_into_one_expert(cache):
    ref = _make("mixtral")
    model = copy.deepcopy(ref)
    ids = _ids(batch=2)
    _configure(model, expert_cache=cache)
    _run(model, ids)  # warm: the cache holds experts of every layer
    key = "model.layers.1.mlp.experts.gate_up_proj"
    with torch.no_grad():
        for e in range(8):  # every expert of layer 1 changes, so the routing meets a changed one
            ref.model.layers[1].mlp.experts.gate_up_proj[e].mul_(1.5)
    model.load_state_dict({key: ref.state_dict()[key]}, strict=False)
    want, got = _run(ref, ids), _run(model, ids)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert torch.equal(model.state_dict()[key], ref.state_dict()[key])


def test_editing_a_routed_layer_in_place_keeps_every_expert():

    ref = _make("olmoe")
    model = copy.deepcopy(ref)
    (m,) = _configure(model)
    ids = _ids(batch=1)
    _edit_layer_2_in_place(ref, model, m, ids)
    assert torch.equal(_run(model, ids)[1], _run(ref, ids)[1])


def _edit_layer_2_in_place(ref, model, m, ids):
    """Run, then double layer 2's down_proj in place (contract.editing) in both models:
    the state dicts agree after."""
    from layerwise import contract

    _run(model, ids, new=2)
    with contract.editing(m, 2):
        model.model.layers[2].mlp.experts.down_proj.data.mul_(2)
    with torch.no_grad():
        ref.model.layers[2].mlp.experts.down_proj.mul_(2)
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


SIGINT_SCRIPT = textwrap.dedent(r"""
    import copy, os, random, signal, statistics, sys, time
    import torch
    sys.path.insert(0, {tests!r})
    torch.set_num_threads(1)
    import layerwise
    from helpers.moe import _make, _ids
    target, cap = int(sys.argv[1]), float(sys.argv[2])
    rng = random.Random(7)
    pid = os.getpid()
    signal.signal(signal.SIGALRM, lambda *a: os.kill(pid, signal.SIGINT))
    ref = _make("mixtral")
    model = copy.deepcopy(ref)
    layerwise.configure_layerwise_offload(model, "model.layers", device="cpu", experts="routed",
                                          expert_cache=1 << 20, expert_prefetch=True, debug_copy_delay_us=300)
    xs = [_ids(batch=2, seed=s) for s in range(4)]
    with torch.no_grad():
        want = [ref(x).logits for x in xs]
    durations = []
    for x in xs:
        t0 = time.perf_counter()
        with torch.no_grad():
            model(x)
        durations.append(time.perf_counter() - t0)
    # One that lands for sure: a real SIGINT sent from inside layer 2's MoE block, as its
    # experts' rows are fetched (the random ones below land where the machine's pace puts them).
    layer = model.model.layers[2].mlp
    once = layer.register_forward_pre_hook(lambda mod, args: os.kill(pid, signal.SIGINT))
    try:
        with torch.no_grad():
            model(xs[0])
        raise SystemExit("the SIGINT sent inside a forward did not interrupt it")
    except KeyboardInterrupt:
        pass
    finally:
        once.remove()
    with torch.no_grad():
        landed_bitwise = torch.equal(model(xs[1]).logits, want[1])
    interrupted, bad, k = 1, 0 if landed_bitwise else 1, 0
    deadline = time.monotonic() + cap
    while interrupted < target and time.monotonic() < deadline:
        finished = False
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, max(rng.uniform(0, 1.2 * statistics.median(durations)), 1e-6))
                with torch.no_grad():
                    model(xs[k % 4])
                finished = True
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except KeyboardInterrupt:
            interrupted += not finished
        with torch.no_grad():
            if not torch.equal(model(xs[(k + 1) % 4]).logits, want[(k + 1) % 4]):
                bad += 1
                print("WRONG", k, flush=True)
        k += 1
    print("RESULT", interrupted, bad, k, flush=True)
""")


def test_real_sigints_during_a_routed_forward(tmp_path):
    _sigints(tmp_path, SIGINT_SCRIPT.format(tests=os.path.dirname(os.path.dirname(__file__))), 30, 180)


def _sigints(tmp_path, text: str, target: int, cap: float) -> None:
    """Run the SIGINT script `text`: `target` interrupts inside forwards, no wrong output."""
    script = tmp_path / "sigint.py"
    script.write_text(text)
    proc = subprocess.run([sys.executable, str(script), str(target), str(cap)], capture_output=True, text=True,
                          timeout=cap + 240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    interrupted, bad, attempts = map(int, [ln for ln in proc.stdout.splitlines()
                                           if ln.startswith("RESULT")][-1].split()[1:])
    assert bad == 0, proc.stdout[-3000:]
    # (the first lands for sure; how many of the random ones land, up to `target` within `cap`
    # seconds, is the machine's pace: it decides nothing)
    assert interrupted >= 1, f"no interrupt landed inside a forward in {attempts} attempts"


# ------------------------------------------------------------------ refusals
class ListExperts(nn.Module):
    """Takes the routing, but its experts are a ModuleList: not placeable (streamed whole)."""

    def __init__(self, d=16, n=4):
        super().__init__()
        self.num_experts = n
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(n)])

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for k in range(top_k_index.shape[-1]):
            for e in range(self.num_experts):
                sel = top_k_index[:, k] == e
                out[sel] += top_k_weights[sel, k, None] * self.experts[e](x[sel])
        return out


class MixedExperts(ListExperts):
    """A ModuleList of experts and a parameter of its own: not placeable (streamed whole)."""

    def __init__(self, d=16, n=4):
        super().__init__(d, n)
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x, top_k_index, top_k_weights):
        return super().forward(x, top_k_index, top_k_weights) * self.scale


class ToyMoE(nn.Module):
    def __init__(self, d=16, n=4, experts=ListExperts):
        super().__init__()
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = experts(d, n)

    def forward(self, x):
        w, idx = torch.topk(self.gate(x).softmax(-1), 2, dim=-1)
        return x + self.experts(x, idx, w)


class ToyModel(nn.Module):
    def __init__(self, experts=ListExperts, layers=3, d=16):
        super().__init__()
        self.layers = nn.ModuleList([ToyMoE(d, experts=experts) for _ in range(layers)])

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return x


def test_an_expert_module_that_cannot_be_placed_streams_whole(caplog):
    torch.manual_seed(0)
    ref = ToyModel(MixedExperts).eval()
    model = copy.deepcopy(ref)
    x = torch.randn(5, 16)
    with caplog.at_level(logging.WARNING, logger="layerwise"):
        (m,) = layerwise.configure_layerwise_offload(model, "layers", device="cpu", experts="routed")
    assert "streams whole" in caplog.text and "submodule" in caplog.text
    assert m.experts is None
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_naming_an_expert_module_that_cannot_be_placed_is_refused():
    model = ToyModel(MixedExperts)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="cannot be routed.*submodule"):
        layerwise.configure_layerwise_offload(model, "layers", device="cpu", experts="routed",
                                              expert_modules=["experts"])
    with pytest.raises(ValueError, match="no routing argument"):
        layerwise.configure_layerwise_offload(model, "layers", device="cpu", experts="routed",
                                              expert_modules=["gate"])
    with pytest.raises(ValueError, match="no layer of"):
        layerwise.configure_layerwise_offload(model, "layers", device="cpu", experts="routed",
                                              expert_modules=["mlp.experts"])
    assert not layerwise.configure.managers_of(model)
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())


def test_expert_modules_override_and_predicate():
    ref = _make("mixtral")
    ids = _ids(batch=1)
    want = _run(ref, ids)
    for spec in (["mlp.experts"], lambda name, mod: name.endswith(".experts")):
        model = copy.deepcopy(ref)
        (m,) = _configure(model, expert_modules=spec)
        assert len(m.experts.layers) == 6
        assert torch.equal(_run(model, ids)[1], want[1])


@pytest.mark.parametrize("kw,match", [
    (dict(experts="some"), "experts must be 'all' or|experts must be"),
    (dict(experts="all", expert_cache=1 << 20), "experts='routed' too"),
    (dict(experts="routed", expert_cache=-1), "expert_cache must be"),
    (dict(experts="routed", expert_prefetch="yes"), "expert_prefetch must be"),
    (dict(experts="routed", expert_modules=[3]), "expert_modules must be"),
])
def test_bad_expert_options_are_refused(kw, match):
    model = _make("mixtral")
    with pytest.raises((ValueError, TypeError), match=match):
        layerwise.configure_layerwise_offload(model, "model.layers", device="cpu", **kw)
    assert not layerwise.configure.managers_of(model)


def test_a_cache_smaller_than_one_expert_is_refused():
    model = _make("mixtral")
    with pytest.raises(ValueError, match="holds no expert"):
        _configure(model, expert_cache=1024)
    assert not layerwise.configure.managers_of(model)


def test_an_expert_module_called_outside_its_layer_is_refused():
    model = _make("mixtral")
    _configure(model)
    ex = model.model.layers[1].mlp.experts
    with pytest.raises(RuntimeError, match="outside the forward of its layer"):
        ex(torch.randn(2, 64), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))


# ------------------------------------------------------------- front doors
def _meta(arch):
    """The arch's model built on meta (for load_offloaded), same config as _make."""
    ref = _make(arch)
    with torch.device("meta"):
        empty = type(ref)(ref.config).eval()
    return ref, empty


def _save(ref, path):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    return path


def _assert_routed_like(ref, model, m, ids):
    want, got = _run(ref, ids), _run(model, ids)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    rows = _step_bytes(model, m, _ids(batch=1, seed=3), steps=4)
    for ours, ideal in rows:
        assert ours <= 1.1 * ideal, rows
    assert rows[-1][0] < 0.8 * sum(lp.nbytes for lp in m.plan.layers)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3"])
def test_load_offloaded_routed_from_a_checkpoint(arch, tmp_path):
    ref, model = _meta(arch)
    path = _save(ref, tmp_path / "model.safetensors")
    (m,) = layerwise.load_offloaded(model, path, ["model.layers"], device="cpu", experts="routed",
                                    expert_cache="auto", debug_copy_delay_us=300)
    assert m.experts is not None and len(m.experts.layers) == 6
    _assert_routed_like(ref, model, m, _ids(batch=2))
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k


def test_offload_pipeline_routed_with_a_moe_component():
    class Holder:
        def __init__(self):
            self.lm = _make("mixtral")
            self.name = "not a module"

        def __call__(self, ids):
            return self.lm(ids)

    ref, holder = _make("mixtral"), Holder()
    managers = layerwise.offload_pipeline(holder, device="cpu", experts="routed", expert_cache="auto")
    assert list(managers) == ["lm"]
    (m,) = [m for m in managers["lm"] if m.experts is not None]
    _assert_routed_like(ref, holder.lm, m, _ids(batch=2))
    layerwise.remove_pipeline_offload(holder)
    for k, v in ref.state_dict().items():
        assert torch.equal(holder.lm.state_dict()[k], v), k


# ------------------------------------------------------------ compress="lossless"


def _encoded_ideal(m, used):
    """What one decode step moves at best, encoded: each streamed layer's prefix as
    it travels, plus the encoded rows of each expert used."""
    streamed = set(m.ring.streamed)
    out = sum(m.sources[i].transfer_bytes for i in streamed)
    for i, name, x in used:
        (xm,) = [xm for xm in m.experts.layers[i] if xm.name == name]
        out += sum(m.sources[i].range_bytes(lo, hi) for lo, hi in xm.spans([x]))
    return out


@pytest.mark.parametrize("arch", ["mixtral", "qwen3"])
@pytest.mark.parametrize("cache", [None, "auto"])
def test_compressed_routed_experts_are_bitwise_and_move_encoded_bytes(arch, cache):
    ref = _bf16(arch)
    model = copy.deepcopy(ref)
    ids = _ids(batch=2)
    want = _run(ref, ids)
    (m,) = _configure(model, compress="lossless", expert_cache=cache, expert_prefetch=cache is not None)
    got = _run(model, ids)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    st = m.stats(sync=True)
    assert st["compress"]["layers_raw"] == [] and st["compress"]["ratio"] < 0.8
    # every expert's rows are segments of their own: an expert fetch moves its encoded rows
    for i, mods in m.experts.layers.items():
        for xm in mods:
            for x in range(xm.num_experts):
                enc = sum(m.sources[i].range_bytes(lo, hi) for lo, hi in xm.spans([x]))
                assert 0 < enc < 0.85 * xm.unit_bytes
    if cache is None:  # (a warm cache moves less than the ideal)
        used = [set()]
        hooks = [xm.module.register_forward_pre_hook(
            lambda mod, a, kw, i=i, xm=xm: used[-1].update(
                (i, xm.name, x) for x in expert_hooks.chosen_experts(xm.routed(a, kw), xm.num_experts)),
            with_kwargs=True) for i, mods in m.experts.layers.items() for xm in mods]
        rows = _step_bytes(model, m, _ids(batch=1), steps=4)
        for h in hooks:
            h.remove()
        for (ours, raw_ideal), u in zip(rows, used[-4:]):
            assert ours <= 1.1 * _encoded_ideal(m, u), rows
            assert ours < 0.85 * raw_ideal, rows
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k
    layerwise.remove_layerwise_offload(model)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


@pytest.mark.parametrize("cache", [None, 1 << 22])
def test_compressed_load_state_dict_into_one_expert_re_encodes(cache):
    ref = _bf16("mixtral")
    model = copy.deepcopy(ref)
    ids = _ids(batch=2)
    (m,) = _configure(model, compress="lossless", expert_cache=cache)
    _run(model, ids)
    before = m.sources[1].version()
    key = "model.layers.1.mlp.experts.gate_up_proj"
    with torch.no_grad():
        for e in range(8):
            ref.model.layers[1].mlp.experts.gate_up_proj[e].mul_(1.5)
        ref.model.layers[1].mlp.experts.gate_up_proj[3].mul_(1e4)  # another exponent histogram
    model.load_state_dict({key: ref.state_dict()[key]}, strict=False)
    assert m.sources[1].version() != before  # re-encoded
    assert m.stats()["compress"]["layers_raw"] == []
    want, got = _run(ref, ids), _run(model, ids)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_compressed_routed_host_bytes_are_planned_exactly():
    from layerwise.planning import routes
    from layerwise.planning.layout import BLOCK_ALIGN, round_up

    model = _bf16("mixtral")
    planned = {}
    (m,) = _configure(model, compress="lossless")
    ref = _bf16("mixtral")
    # plan the same group on an unpacked copy: the encoded size from the weights' histograms
    from layerwise.options import OffloadOptions

    opts = OffloadOptions.build(device="cpu", experts="routed", compress="lossless")
    mm = layerwise.LayerwiseOffloadManager(ref, layer_name="model.layers", initialize=False, options=opts)
    for lp in mm.plan.layers:
        planned[lp.index] = routes.encoded_layer_bytes(lp, mm.experts)
    for i, n in planned.items():
        assert n == m.sources[i].stored_bytes, (i, n, m.sources[i].stored_bytes)
    assert [r.host_bytes for r in mm.tier_plan()] == [round_up(n, BLOCK_ALIGN) for n in planned.values()]


def test_compressed_routed_edit_in_place_and_set_residency():
    ref = _bf16("qwen3")
    model = copy.deepcopy(ref)
    ids = _ids(batch=2)
    (m,) = _configure(model, compress="lossless", expert_cache="auto")
    _edit_layer_2_in_place(ref, model, m, ids)
    m.set_residency([1, 4], prefetch_depth=2)
    want, got = _run(ref, ids), _run(model, ids)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


# ------------------------------------------------------------ the disk tier
def _disk_steps(model, m, steps=4):
    """Per decode step, with the experts used: (bus bytes, disk bytes read, the
    ideal disk bytes: the prefix of each streamed disk layer + the rows of the
    experts used in disk layers), over `steps` steps after a prefill."""
    disk = {i for i, r in enumerate(m.tier_plan()) if r.where in ("spill", "checkpoint")}
    used = [set()]
    hooks = [xm.module.register_forward_pre_hook(
        lambda mod, a, kw, i=i, xm=xm: used[-1].update(
            (i, k, x) for x in expert_hooks.chosen_experts(xm.routed(a, kw), xm.num_experts)),
        with_kwargs=True) for i, mods in m.experts.layers.items() for k, xm in enumerate(mods)]
    prefix = sum(m.plan.layers[i].base_bytes for i in disk)
    ids, out = _ids(batch=1, seed=5), []
    with torch.no_grad():
        o = model(ids, use_cache=True)
        past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            used.append(set())
            r0 = m.stats(sync=True)["disk"]["bytes_read"]
            o = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
            st = m.stats(sync=True)
            rows = sum(m.experts.layers[i][k].unit_bytes for i, k, _ in used[-1] if i in disk)
            out.append((st["last_step"]["bytes_copied"], st["disk"]["bytes_read"] - r0, prefix + rows))
    for h in hooks:
        h.remove()
    return disk, out


def _check_disk(ref, model, m, ids):
    want, got = _run(ref, ids), _run(model, ids)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    disk, rows = _disk_steps(model, m)
    assert disk
    whole = sum(m.plan.layers[i].nbytes for i in disk)
    slack = len(m.chain.disk.slots) * max(m.plan.layers[i].base_bytes for i in disk)  # reads ahead across steps
    assert sum(r for _, r, _ in rows) <= 1.1 * sum(ideal for _, _, ideal in rows) + slack, rows
    assert all(r < 0.8 * whole for _, r, _ in rows[1:]), (rows, whole)  # never the whole layers
    return disk


@pytest.mark.parametrize("cache", [None, "auto"])
def test_routed_experts_in_spill_files_are_read_on_demand(tmp_path, cache):
    ref = _make("mixtral")
    model = copy.deepcopy(ref)
    (m,) = _configure(model, host_budget=_host_budget(ref), spill_dir=str(tmp_path), expert_cache=cache,
                      expert_prefetch=cache is not None)
    disk = _check_disk(ref, model, m, _ids(batch=2))
    assert m.stats()["disk"]["layers"] == len(disk)
    # the host budget counted the staging the on-demand reads keep
    from layerwise.planning import host_budget

    planned = (m.options.disk_staging_slots * host_budget.staging_slot_bytes(m, disk)
               + host_budget.range_staging_bytes(m, disk))
    assert host_budget.range_staging_bytes(m, disk) > 0
    assert m.stats()["disk"]["staging_bytes"] <= planned
    _load_one_expert_on_disk(ref, model, max(disk), "down_proj", 5, -2, tmp_path)


def _load_one_expert_on_disk(ref, model, i, name, x, factor, spill_dir):
    """The state dict is true; a load into expert x of layer i (in a spill file) takes
    effect exactly; removal deletes the spill files."""
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k
    key = f"model.layers.{i}.mlp.experts.{name}"
    with torch.no_grad():
        getattr(ref.model.layers[i].mlp.experts, name)[x].mul_(factor)
    model.load_state_dict({key: ref.state_dict()[key]}, strict=False)
    assert torch.equal(model.state_dict()[key], ref.state_dict()[key])
    ids = _ids(batch=3, seed=9)
    want, got = _run(ref, ids), _run(model, ids)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    layerwise.remove_layerwise_offload(model)
    assert not list(spill_dir.iterdir())


@pytest.mark.parametrize("arch", ["mixtral", "qwen3"])
@pytest.mark.parametrize("spill", [False, True])
def test_load_offloaded_routed_with_a_host_budget(arch, spill, tmp_path):
    ref, model = _meta(arch)
    path = _save(ref, tmp_path / "model.safetensors")
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    (m,) = layerwise.load_offloaded(model, path, ["model.layers"], device="cpu", experts="routed",
                                    host_budget=_host_budget(ref), spill_dir=str(spill_dir) if spill else None,
                                    debug_copy_delay_us=300)
    disk = _check_disk(ref, model, m, _ids(batch=2))
    assert {m.tier_plan()[i].where for i in disk} == {"spill" if spill else "checkpoint"}
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k
    if not spill:  # the checkpoint is read-only: a load into one of its layers is refused, nothing changed
        key = f"model.layers.{max(disk)}.mlp.experts.gate_up_proj"
        with pytest.raises(RuntimeError, match="does not write"):
            model.load_state_dict({key: torch.zeros_like(ref.state_dict()[key])}, strict=False)
        assert torch.equal(model.state_dict()[key], ref.state_dict()[key])


def test_routed_experts_from_a_checkpoint_that_changed_raise_and_recover(tmp_path):
    ref, model = _meta("mixtral")
    path = _save(ref, tmp_path / "model.safetensors")
    (m,) = layerwise.load_offloaded(model, path, ["model.layers"], device="cpu", experts="routed",
                                    host_budget=_host_budget(ref))
    ids = _ids(batch=2)
    want = _run(ref, ids)
    original = path.read_bytes()
    damaged = bytearray(original)
    for off in range(len(damaged) // 2, len(damaged), 4096):  # the later tensors: layers on disk
        damaged[off] ^= 0xFF
    path.write_bytes(bytes(damaged))
    with pytest.raises(OSError):
        _run(model, ids)
    path.write_bytes(original)
    got = _run(model, ids)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


# ------------------------------------------- per-expert ModuleList experts, quantized
def _on_disk(ref, configure):
    """The manager of `configure(host_budget)` at the smallest of a ladder of budgets
    that is not too small: some layers on disk (a tiny model's staging can outweigh
    its layers: the range between too small and all in memory is narrow)."""
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    for frac in [0.5 + k / 200 for k in range(300)]:
        try:
            (m,) = configure(int(frac * total))
        except ValueError as err:
            assert "too small" in str(err)
            continue
        assert m.stats()["disk"] is not None, f"no budget between too small and every layer in memory ({frac})"
        return m
    pytest.fail("every host budget was too small")


def _toy_steps(model, m, xs):
    """(bus bytes, ideal) per forward: the streamed layers' prefixes + the experts used."""
    used = [set()]
    hooks = [xm.module.register_forward_pre_hook(
        lambda mod, a, kw, i=i, xm=xm: used[-1].update(
            (i, k, x) for x in expert_hooks.chosen_experts(xm.routed(a, kw), xm.num_experts)),
        with_kwargs=True) for i, mods in m.experts.layers.items() for k, xm in enumerate(mods)]
    streamed = set(m.ring.streamed)
    prefix = sum(m.sources[i].transfer_bytes for i in streamed)
    out = []
    with torch.no_grad():
        for x in xs:
            used.append(set())
            model(x)
            ideal = prefix + sum(sum(m.sources[i].range_bytes(lo, hi) for lo, hi in m.experts.layers[i][k].spans([e]))
                                 for i, k, e in used[-1] if i in streamed)
            out.append((m.stats(sync=True)["last_step"]["bytes_copied"], ideal))
    for h in hooks:
        h.remove()
    return out


@pytest.mark.parametrize("kind,kw", [
    (None, {}), (None, dict(compress="lossless", expert_cache="auto")), ("ao-int8", {}), ("quanto-qint8", {}),
    ("quanto-qint8", dict(expert_prefetch=True, expert_cache=1 << 16)), (None, "spill"), ("ao-int8", "spill"),
    (None, "ckpt"),
])
def test_per_expert_module_list_experts_are_routed(kind, kw, tmp_path):
    """A ModuleList with one module per expert (plain, or its Linear layers quantized
    by torchao / quanto: their inner tensors are the expert's bytes): routed, bitwise
    the resident model's, each step moves the prefixes and the experts used."""
    from helpers.quantized import quantize

    n = 16 if kw == "ckpt" else 6  # (from a checkpoint: staging pads every tensor; more layers to spread it)

    def build():
        torch.manual_seed(0)
        model = ToyModel(layers=n, d=64).to(torch.bfloat16).eval()
        return quantize(model, kind) if kind else model

    ref, model = build(), build()  # (quanto's tensors do not deepcopy)
    xs = [torch.randn(1, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(s)) for s in range(5)]
    with torch.no_grad():
        want = [ref(x) for x in xs]
    if kw == "ckpt":  # load_offloaded: the layers on disk stay in the checkpoint, experts read from it
        kw = dict(ckpt=_save(ref, tmp_path / "toy.safetensors"))

        def from_checkpoint(budget):
            nonlocal model
            with torch.device("meta"):
                model = ToyModel(layers=n, d=64).to(torch.bfloat16).eval()
            return layerwise.load_offloaded(model, kw["ckpt"], "layers", device="cpu", experts="routed",
                                            host_budget=budget, debug_copy_delay_us=300)

        m = _on_disk(ref, from_checkpoint)
        assert {r.where for r in m.tier_plan()} >= {"checkpoint"}
    elif kw == "spill":
        kw = dict(spill_dir=str(tmp_path))
        m = _on_disk(ref, lambda budget: layerwise.configure_layerwise_offload(
            model, "layers", device="cpu", experts="routed", debug_copy_delay_us=300, host_budget=budget, **kw))
    else:
        (m,) = layerwise.configure_layerwise_offload(model, "layers", device="cpu", experts="routed",
                                                     debug_copy_delay_us=300, **kw)
    assert m.experts is not None and len(m.experts.layers) == n
    with torch.no_grad():
        assert all(torch.equal(model(x), w) for x, w in zip(xs, want))
    st = m.stats(sync=True)
    assert st["experts"]["misses"] > 0
    assert (st["disk"] is not None and st["disk"]["layers"] > 0) == ("spill_dir" in kw or "ckpt" in kw)
    assert (st["compress"] is not None and st["compress"]["ratio"] < 0.9) == ("compress" in kw)
    rows = _toy_steps(model, m, xs)
    assert all(ours <= 1.1 * ideal for ours, ideal in rows[1:]), rows
    assert rows[-1][0] < 0.8 * sum(lp.nbytes for lp in m.plan.layers)
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k].dequantize() if hasattr(sd[k], "dequantize") else sd[k],
                           v.dequantize() if hasattr(v, "dequantize") else v), k
    layerwise.remove_layerwise_offload(model)
    with torch.no_grad():
        assert all(torch.equal(model(x), w) for x, w in zip(xs, want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compressed_routed_experts_in_spill_files(tmp_path, dtype):
    ref = _bf16("mixtral") if dtype == torch.bfloat16 else _make("mixtral")
    model = copy.deepcopy(ref)
    # (on a CPU device the expert cache is host memory: the budget counts it, a quarter of the experts)
    (m,) = _configure(model, compress="lossless", host_budget=_host_budget(ref, 0.6) + m_bytes(ref) // 4,
                      spill_dir=str(tmp_path), expert_cache="auto")
    ids = _ids(batch=2)
    want, got = _run(ref, ids), _run(model, ids)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    st = m.stats()["compress"]
    assert st["layers"] == 6 and (st["layers_raw"] == [] or dtype != torch.bfloat16)  # (fp32: coded too, v2)
    disk, rows = _disk_steps(model, m)
    assert disk
    whole = sum(m.plan.layers[i].nbytes for i in disk)
    assert all(r < 0.8 * whole for _, r, _ in rows[1:]), rows
    if dtype == torch.bfloat16:  # encoded on disk: fewer bytes read and copied than the raw ideal
        assert all(bus < 0.85 * ideal and r < 0.85 * ideal for bus, r, ideal in rows[1:]), rows
    _load_one_expert_on_disk(ref, model, max(disk), "gate_up_proj", 2, 3, tmp_path)  # (re-encoded there)


def test_compressed_routed_layer_that_travels_raw_from_a_spill_file(tmp_path):
    """A layer whose encoding saves too little travels raw (random bit patterns): its
    prefix is still read ahead alone and its experts read on demand; bitwise (the
    logits' bit patterns, NaNs included)."""
    ref = _bf16("mixtral")
    with torch.no_grad():
        for p in ref.model.layers[5].parameters():
            p.view(torch.int16).copy_(torch.randint(-(1 << 15), 1 << 15, p.shape, dtype=torch.int16,
                                                    generator=torch.Generator().manual_seed(3)))
    model = copy.deepcopy(ref)
    (m,) = _configure(model, compress="lossless", host_budget=_host_budget(ref, 0.6), spill_dir=str(tmp_path))
    assert 5 in m.stats()["compress"]["layers_raw"] and m.tier_plan()[5].where == "spill"
    for seed in range(3):
        ids = _ids(batch=2, seed=seed)
        with torch.no_grad():
            want, got = ref(ids).logits, model(ids).logits
        assert torch.equal(want.view(torch.int16), got.view(torch.int16))
    st = m.stats(sync=True)
    assert st["experts"]["misses"] > 0


def test_real_sigints_during_a_routed_forward_from_encoded_spill_files(tmp_path):
    """As test_real_sigints_during_a_routed_forward, with the layers encoded in spill
    files (on-demand reads of experts' rows interrupted too)."""
    spill = tmp_path / "spill"
    spill.mkdir()
    text = SIGINT_SCRIPT.format(tests=os.path.dirname(os.path.dirname(__file__)))
    text = text.replace("from helpers.moe import _make, _ids", "from helpers.moe import _bf16, _ids, _host_budget")
    text = text.replace('ref = _make("mixtral")', 'ref = _bf16("mixtral")')
    # (on a CPU device its expert cache, 1 MiB, is host memory: the budget counts it)
    text = text.replace("debug_copy_delay_us=300)", f"debug_copy_delay_us=300, compress='lossless', "
                                                     f"host_budget=_host_budget(ref, 0.6) + (1 << 20), "
                                                     f"spill_dir={str(spill)!r})")
    assert "spill_dir" in text and "_bf16" in text
    _sigints(tmp_path, text, 20, 120)
    assert not list(spill.iterdir())  # deleted at exit


def test_offload_pipeline_routed_compressed_on_disk_and_its_report(tmp_path):
    class Holder:
        def __init__(self):
            self.lm = _bf16("mixtral")

        def __call__(self, ids):
            return self.lm(ids)

    ref, holder = _bf16("mixtral"), Holder()
    managers = layerwise.offload_pipeline(holder, device="cpu", experts="routed", compress="lossless",
                                          host_budget=_host_budget(ref, 0.6), spill_dir=str(tmp_path))
    (m,) = [m for m in managers["lm"] if m.experts is not None]
    ids = _ids(batch=2)
    want, got = _run(ref, ids), _run(holder.lm, ids)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    st = m.stats(sync=True)
    assert st["disk"]["layers"] > 0 and st["disk"]["reads_on_demand"] > 0
    assert 0 < st["disk"]["bytes_read_on_demand"] <= st["disk"]["bytes_read"]
    assert st["compress"]["ratio"] < 0.8 and st["experts"]["misses"] > 0
    text = str(layerwise.report(holder.lm))
    assert "routed experts" in text and "read on demand" in text and "compress='lossless'" in text
    layerwise.remove_pipeline_offload(holder)
    assert not list(tmp_path.iterdir())
    for k, v in ref.state_dict().items():
        assert torch.equal(holder.lm.state_dict()[k], v), k


@pytest.mark.parametrize("cache", [None, 1 << 16])
def test_load_state_dict_into_one_module_list_expert(cache):
    torch.manual_seed(0)
    ref = ToyModel(layers=6, d=64).eval()
    model = copy.deepcopy(ref)
    (m,) = layerwise.configure_layerwise_offload(model, "layers", device="cpu", experts="routed",
                                                 expert_cache=cache, debug_copy_delay_us=300)
    xs = [torch.randn(3, 64, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    with torch.no_grad():
        for x in xs:
            model(x)  # warm: the cache holds experts
        for e in range(4):
            ref.layers[2].experts.experts[e].weight.mul_(-1.5)
    keys = [f"layers.2.experts.experts.{e}.weight" for e in range(4)]
    model.load_state_dict({k: ref.state_dict()[k] for k in keys}, strict=False)
    with torch.no_grad():
        assert all(torch.equal(model(x), ref(x)) for x in xs)
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k


# ------------------------------------------------------------------------ CUDA
# The routed-experts paths on the GPU (scripts/gpu_check.sh runs them; they skip
# without one): demand copies of the experts a layer's routing chose, the device
# expert cache, speculative prefetch, and encoded expert rows decoded by the
# Triton decoder, with two copy streams and the compute stream slowed before
# every layer, so that the host runs ahead of the GPU and the expert copies,
# cache fills and slot reuses are ordered by events alone.
def _cuda_usable() -> bool:
    from helpers.devices import cuda_usable

    return cuda_usable()


needs_cuda = pytest.mark.skipif(not _cuda_usable(), reason="needs a GPU and a CUDA build (scripts/gpu_check.sh)")


def _behind_the_host(model, ms=1.0):
    """A GPU sleep of about `ms` before each decoder layer's kernels (pre-hooks
    registered after configure run after layerwise's: after the layer's wait for its
    copy, before its compute and its experts' routing)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles = int(1_000_000 * ms / start.elapsed_time(end))
    return [layer.register_forward_pre_hook(lambda *a: torch.cuda._sleep(cycles)) for layer in model.model.layers]


def _on_cuda(ref, **options):
    """(resident twin on cuda, the streamed model on cuda, its manager)."""
    model = copy.deepcopy(ref)
    (m,) = layerwise.configure_layerwise_offload(model, "model.layers", device="cuda", experts="routed",
                                                 num_copy_streams=2, **options)
    _behind_the_host(model)
    return ref.to("cuda"), model, m


@needs_cuda
@pytest.mark.parametrize("arch", ["mixtral", "deepseek"])
@pytest.mark.parametrize("cache", [None, "auto"])
def test_routed_on_cuda_is_bitwise_with_the_gpu_behind_the_host(arch, cache):
    ref, model, m = _on_cuda(_make(arch), prefetch_depth=2, expert_cache=cache)
    ids = _ids(batch=2).to("cuda")
    want, got = _run(ref, ids), _run(model, ids)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    st = m.stats(sync=True)["experts"]
    assert st["misses"] > 0 and st["experts_used"] == st["hits"] + st["misses"]
    if cache is not None:
        assert st["cache_hits"] > 0 and 0 < st["cache_bytes"] <= torch.cuda.get_device_properties(0).total_memory
    layerwise.remove_layerwise_offload(model)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


@needs_cuda
def test_speculative_prefetch_on_cuda_costs_bytes_never_correctness():
    ref, model, m = _on_cuda(_make("mixtral"), prefetch_depth=2, expert_prefetch=True)
    ids = _ids(batch=1).to("cuda")
    want, got = _run(ref, ids, new=8), _run(model, ids, new=8)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    st = m.stats(sync=True)["experts"]
    assert st["speculative_bytes"] > 0
    assert st["speculative_used_bytes"] + st["speculative_wasted_bytes"] == st["speculative_bytes"]


@needs_cuda
@pytest.mark.parametrize("cache", [None, "auto"])
def test_compressed_routed_experts_on_cuda_decode_their_rows_bitwise(cache):
    """Each expert's rows are a segment of their own: a demand fetch copies its encoded
    rows and the Triton decoder writes them into the slot (the decode lane)."""
    from layerwise.runtime.gpu_checks import check_decode_path

    check_decode_path("cuda")
    ref, model, m = _on_cuda(_bf16("mixtral"), compress="lossless", expert_cache=cache,
                             expert_prefetch=cache is not None)
    ids = _ids(batch=2).to("cuda")
    want, got = _run(ref, ids), _run(model, ids)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    st = m.stats(sync=True)
    assert st["compress"]["layers_raw"] == [] and st["experts"]["misses"] > 0
    layerwise.remove_layerwise_offload(model)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
