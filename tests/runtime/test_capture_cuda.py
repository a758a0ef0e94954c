"""CUDA graphs of a streamed step, on a GPU (scripts/gpu_check.sh runs these first in
its `capture` stage; without a GPU they skip: tests/runtime/test_capture.py checks the
schedule on the CPU). A captured step replays its copies and waits: 20 replays equal
the eager streamed step bitwise with the compute stream slowed (so that a copy that
waited on the wrong event would overwrite a slot in use), a load_state_dict between
replays is what the next replay computes with, what cannot be captured is refused
naming it, and torch.compile(mode="reduce-overhead") records CUDA graphs of a
streamed model (no cudagraph skips) that equal the same-boundaries twin's."""
import copy

import pytest
import torch

import layerwise

from helpers import archs
from helpers.devices import cuda_usable
from helpers.models import TwoGroupModel

pytestmark = pytest.mark.skipif(not cuda_usable(), reason="needs a GPU (CUDA graph capture)")

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


class Slowed(torch.nn.Module):
    """The model with a spin on the compute stream before every block (captured too)."""

    def __init__(self, model, cycles=200_000):
        super().__init__()
        self.model, self.cycles = model, cycles
        for b in list(model.transformer_blocks) + list(model.single_transformer_blocks):
            b.register_forward_pre_hook(lambda m, a: torch.cuda._sleep(self.cycles))

    def forward(self, x):
        return self.model(x)


def _pair(seed=0, **kw):
    torch.manual_seed(seed)
    resident = TwoGroupModel(d=64, n_a=6, n_b=4).cuda()
    model = copy.deepcopy(resident).cpu()
    return resident, model, layerwise.configure_layerwise_offload(model, GROUPS, device="cuda", pin_memory=True, **kw)


@pytest.mark.parametrize("depth,resident", [(1, 0), (2, 0), (1, 2)])
def test_cuda_graph_of_a_streamed_step_replays_20_times_bitwise(depth, resident):
    ref_model, model, managers = _pair(prefetch_depth=depth, resident_layers=resident)
    x = torch.randn(8, 64, device="cuda")
    slowed = Slowed(model)
    with torch.no_grad():
        ref = Slowed(ref_model)(x).clone()
        eager = slowed(x).clone()
        assert torch.equal(eager, ref)
        static_x = x.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            slowed(static_x)  # warm-up on a side stream, as torch.cuda.graph asks
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_out = slowed(static_x)
        for k in range(20):
            for m in managers:
                for t in m.ring.slots:
                    t.data.fill_(255)  # what a replay finds in the slots is never what it computes on
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_out, ref), k
        assert torch.equal(slowed(x), ref)  # eager after replays: exact


def test_cuda_graph_replay_sees_a_load_state_dict_between_replays():
    _, model, managers = _pair(prefetch_depth=1)
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        model(x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = model(x)
        torch.manual_seed(7)
        new = TwoGroupModel(d=64, n_a=6, n_b=4).cuda()
        model.load_state_dict(new.state_dict())
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, new(x))


def test_cuda_graph_capture_of_an_encoded_group_is_refused_naming_the_decode():
    torch.manual_seed(0)
    model = TwoGroupModel(d=64, n_a=6, n_b=4)
    layerwise.configure_layerwise_offload(model, GROUPS, device="cuda", compress="lossless")
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        model(x)
        g = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="decode"):
            with torch.cuda.graph(g):
                model(x)
        torch.cuda.synchronize()
        model(x)  # eager afterwards


@pytest.mark.parametrize("name", ["llama", "flux"])
def test_reduce_overhead_compile_of_a_streamed_model_records_cuda_graphs_cuda(name):
    from torch._dynamo.utils import counters

    arch = archs.ARCHS[name]
    model = archs.build(arch)
    twin = copy.deepcopy(model)
    layerwise.configure_layerwise_offload(twin, arch.groups, device="cuda", resident_layers=64)
    layerwise.configure_layerwise_offload(model, arch.groups, device="cuda", prefetch_depth=1, pin_memory=True)
    torch._dynamo.reset()
    counters.clear()
    ref = archs.run(arch, torch.compile(twin, mode="reduce-overhead", fullgraph=True), 11, device="cuda")
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up, record, replays
        out = archs.run(arch, compiled, 11, device="cuda")
        assert torch.equal(out, ref)
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])


def test_a_graph_captured_before_set_residency_still_replays_exactly():
    ref_model, model, managers = _pair(prefetch_depth=1)
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        ref = ref_model(x)
        model(x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = model(x)
        managers[0].set_residency(3)
        torch.cuda.empty_cache()
        junk = torch.full((1 << 20,), 7.0, device="cuda")  # reuse of freed memory would show
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
        assert torch.equal(model(x), ref)
        del junk
