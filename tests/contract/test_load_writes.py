"""load_state_dict into layers whose truth is not a plain host block (encoded:
compress="lossless"; spilled: host_budget + spill_dir; both) rewrites each layer
once per load, however many modules hold its parameters: a per-expert MoE layer
(a ModuleList of E expert MLPs) has 2E + 1 of them. The values a load gives the
streamed layers take effect at its end, so an exception or a Ctrl-C in the
middle of a load leaves every streamed layer as it was; errors torch reports
itself (a size mismatch, a missing key) keep torch's meaning: the rest is
loaded, then torch raises, as for the resident model."""
import gc
import os
import re
import signal
import weakref

import pytest
import torch
from torch import nn

import layerwise

E = 8  # experts per layer
L = 8  # layers


class MLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1 = nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)))


class Experts(nn.Module):
    """One module per expert (Mixtral-style), taking the routing."""

    def __init__(self, d, h, n):
        super().__init__()
        self.num_experts = n
        self.experts = nn.ModuleList(MLP(d, h) for _ in range(n))

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for k in range(top_k_index.shape[-1]):
            for e in range(self.num_experts):
                sel = top_k_index[:, k] == e
                out[sel] += top_k_weights[sel, k, None] * self.experts[e](x[sel])
        return out


class Block(nn.Module):
    def __init__(self, d, h, n):
        super().__init__()
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = Experts(d, h, n)

    def forward(self, x):
        w, idx = torch.topk(self.gate(x).softmax(-1), 2, dim=-1)
        return x + self.experts(x, idx, w.to(x.dtype))


class Net(nn.Module):
    def __init__(self, layers=L, d=64, h=64, n=E):
        super().__init__()
        self.layers = nn.ModuleList(Block(d, h, n) for _ in range(layers))

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return x


def make(seed=0):
    torch.manual_seed(seed)
    return Net().to(torch.bfloat16).eval()


def inputs(n=3):
    return [torch.randn(4, 64, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16) for s in range(n)]


def run(model, xs):
    with torch.no_grad():
        return [model(x) for x in xs]


def _least_host_budget(model, **kw) -> int:
    """The smallest host_budget configure takes for `model` (every streamed layer on disk),
    from its own refusal: the figure it names."""
    with pytest.raises(ValueError, match="too small") as info:
        layerwise.configure_layerwise_offload(model, "layers", device="cpu", host_budget=1, **kw)
    return int(re.search(r"\((\d+) bytes", str(info.value)).group(1))


TIERS = ["lossless", "spill", "lossless+spill"]


def offload(tier, model, tmp_path, routed=False):
    kw = {"debug_copy_delay_us": 200}
    if routed:
        kw["experts"] = "routed"
    if "lossless" in tier:
        kw["compress"] = "lossless"
    if "spill" in tier:
        kw["spill_dir"] = str(tmp_path)
        kw["host_budget"] = _least_host_budget(model, **kw)
    (m,) = layerwise.configure_layerwise_offload(model, "layers", device="cpu", **kw)
    want = {"lossless": ["CodecSource", "ArenaSource"], "spill": ["DiskSource"],
            "lossless+spill": ["CodecSource", "DiskSource"]}[tier]
    assert all(chain(src) == (["ExpertSource"] if routed else []) + want for src in m.sources)
    return m


def chain(src) -> list:
    """The class names of a layer's source and the sources it wraps, outermost first."""
    out = []
    while src is not None:
        out.append(type(src).__name__)
        src = getattr(src, "inner", None)
    return out


class Writes:
    """Counts the reads and writes of each layer's source (the layer's true bytes
    decoded / read from its file, and re-encoded / rewritten)."""

    def __init__(self, m, monkeypatch):
        self.reads, self.writes = [0] * len(m.sources), [0] * len(m.sources)
        for i, src in enumerate(m.sources):
            assert src.host is None  # (every layer is encoded or in a file: each write rewrites it)
            monkeypatch.setattr(src, "read", self._count(self.reads, i, src.read))
            monkeypatch.setattr(src, "write", self._count(self.writes, i, src.write))

    @staticmethod
    def _count(counts, i, fn):
        def counted(*args, **kwargs):
            counts[i] += 1
            return fn(*args, **kwargs)

        return counted

    def during(self, fn):
        """(reads, writes) of each layer while fn() runs."""
        self.take()
        fn()
        return self.take()

    def take(self):
        out = self.reads[:], self.writes[:]
        self.reads[:] = [0] * len(self.reads)
        self.writes[:] = [0] * len(self.writes)
        return out


def assert_state_equal(model, want: dict):
    got = model.state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def clone_state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("routed", [False, True])
@pytest.mark.parametrize("tier", TIERS)
def test_a_load_rewrites_each_layer_once(tier, routed, tmp_path, monkeypatch):
    xs = inputs()
    model = make()
    m = offload(tier, model, tmp_path, routed)
    run(model, xs)  # the ring holds the old weights
    writes = Writes(m, monkeypatch)

    # The whole model: each layer read and rewritten once, for its 2E + 1 modules.
    new = clone_state(make(seed=5))
    result = []
    assert writes.during(lambda: result.append(model.load_state_dict(new))) == ([1] * L, [1] * L)
    assert not result[0].missing_keys and not result[0].unexpected_keys
    twin = make()
    twin.load_state_dict(new)
    assert all(torch.equal(a, b) for a, b in zip(run(model, xs), run(twin, xs)))
    assert_state_equal(model, new)

    # Some experts of one layer (strict=False): that layer once, no other.
    part = {k: -v for k, v in new.items() if k.startswith("layers.3.experts.experts.") and int(k.split(".")[4]) % 2}
    assert len(part) == E  # (w1 and w2 of E / 2 experts)
    assert writes.during(lambda: model.load_state_dict(part, strict=False)) == ([0, 0, 0, 1, 0, 0, 0, 0],) * 2
    twin.load_state_dict(part, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(run(model, xs), run(twin, xs)))

    # Into a layer, and into one expert, called on them: once.
    sub = {k[len("layers.5."):]: v * 2 for k, v in new.items() if k.startswith("layers.5.")}
    assert writes.during(lambda: model.layers[5].load_state_dict(sub)) == ([0, 0, 0, 0, 0, 1, 0, 0],) * 2
    twin.layers[5].load_state_dict(sub)
    expert = {"w1.weight": new["layers.6.experts.experts.2.w1.weight"] * 3,
              "w2.weight": new["layers.6.experts.experts.2.w2.weight"] * 3}
    assert writes.during(lambda: model.layers[6].experts.experts[2].load_state_dict(expert)) == \
        ([0, 0, 0, 0, 0, 0, 1, 0],) * 2
    twin.layers[6].experts.experts[2].load_state_dict(expert)
    assert all(torch.equal(a, b) for a, b in zip(run(model, xs), run(twin, xs)))
    assert_state_equal(model, twin.state_dict())
    layerwise.remove_layerwise_offload(model)
    assert all(torch.equal(a, b) for a, b in zip(run(model, xs), run(twin, xs)))
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("how", ["exception", "sigint"])
@pytest.mark.parametrize("tier", TIERS)
def test_an_exception_mid_load_leaves_every_layer_as_it_was(tier, how, tmp_path, monkeypatch):
    """A load that stops in the middle (a module's own load raising, a real Ctrl-C) in
    layer 1's second expert: nothing of the streamed layers changed, layer 0's values
    included; the values it held are let go; the next load takes effect, once per layer."""
    xs = inputs()
    model = make()
    m = offload(tier, model, tmp_path)
    before = clone_state(model)
    want = run(model, xs)
    writes = Writes(m, monkeypatch)

    def stop(module, *args):
        if how == "sigint":
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C: Python raises it right after the call
        else:
            raise RuntimeError("injected: this module's load failed")

    hook = model.layers[1].experts.experts[1].register_load_state_dict_pre_hook(stop)
    new = clone_state(make(seed=5))
    alive = weakref.ref(new["layers.0.gate.weight"])
    with pytest.raises(KeyboardInterrupt if how == "sigint" else RuntimeError):
        writes.during(lambda: model.load_state_dict(new))
    hook.remove()
    assert writes.take() == ([0] * L, [0] * L)
    assert_state_equal(model, before)
    assert all(torch.equal(a, b) for a, b in zip(run(model, xs), want))
    del new
    gc.collect()
    assert alive() is None  # the aborted load's values are not held (dropped by the forward above)

    new = clone_state(make(seed=6))
    assert writes.during(lambda: model.load_state_dict(new)) == ([1] * L, [1] * L)
    assert_state_equal(model, new)
    twin = make(seed=6)
    assert all(torch.equal(a, b) for a, b in zip(run(model, xs), run(twin, xs)))


@pytest.mark.parametrize("tier", ["lossless", "spill"])
def test_a_load_torch_reports_errors_of_keeps_torch_s_meaning(tier, tmp_path, monkeypatch):
    """A size mismatch in layer 1's second expert, a missing key (strict=True): torch
    loads everything else, then raises; the offloaded model ends exactly where the
    resident one does, each layer rewritten once."""
    xs = inputs()
    model, twin = make(), make()
    m = offload(tier, model, tmp_path)
    writes = Writes(m, monkeypatch)
    new = clone_state(make(seed=5))
    new["layers.1.experts.experts.1.w1.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    del new["layers.4.gate.weight"]
    for target in (model, twin):
        writes.take()
        with pytest.raises(RuntimeError, match=r"(?s)Missing key.*layers\.4\.gate\.weight.*size mismatch for "
                                               r"layers\.1\.experts\.experts\.1\.w1\.weight"):
            target.load_state_dict(new)
        if target is model:
            assert writes.take() == ([1] * L, [1] * L)
    assert_state_equal(model, twin.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(run(model, xs), run(twin, xs)))
    result = model.load_state_dict(new | {"layers.1.experts.experts.1.w1.weight": -twin.layers[1].experts.experts[1]
                                          .w1.weight.detach()}, strict=False)
    assert result.missing_keys == ["layers.4.gate.weight"] and not result.unexpected_keys


@pytest.mark.parametrize("change", ["remove here", "remove elsewhere", "set_residency elsewhere"])
def test_a_removal_or_a_new_placement_during_a_load_keeps_every_value(change, tmp_path):
    """The offload removed half way through a load (by a hook of the load, or on another
    thread: the removal waits for the load), or the layers the load went through made
    resident on another thread: every value takes effect, the model ends as the
    resident one does."""
    import threading

    xs = inputs()
    model, twin = make(), make()
    m = offload("lossless", model, tmp_path)
    new = clone_state(make(seed=5))
    done = []
    threads = []

    def other():
        if change.startswith("remove"):
            layerwise.remove_layerwise_offload(model)
        else:
            m.set_residency([0, 1, 2])
        done.append(change)

    def meanwhile(module, *args):
        if change == "remove here":
            other()
            return
        threads.append(threading.Thread(target=other))
        threads[0].start()
        if change == "set_residency elsewhere":
            threads[0].join()

    hook = model.layers[3].experts.register_load_state_dict_pre_hook(meanwhile)
    model.load_state_dict(new)
    for t in threads:
        t.join()
    hook.remove()
    assert done == [change]
    twin.load_state_dict(new)
    assert_state_equal(model, new)
    assert all(torch.equal(a, b) for a, b in zip(run(model, xs), run(twin, xs)))
    if change.startswith("set_residency"):
        assert m.resident == [0, 1, 2]
        layerwise.remove_layerwise_offload(model)
        assert all(torch.equal(a, b) for a, b in zip(run(model, xs), run(twin, xs)))
