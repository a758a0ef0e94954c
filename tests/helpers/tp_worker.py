"""One rank of the tensor-parallel test (tests/runtime/test_tp.py): a Llama-style MLP
stack sharded colwise/rowwise across 2 gloo ranks, streamed by layerwise."""
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import layerwise


class MLP(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.gate = nn.Linear(d, 3 * d, bias=False)
        self.up = nn.Linear(d, 3 * d, bias=False)
        self.down = nn.Linear(3 * d, d, bias=False)

    def forward(self, x):
        return x + self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def main(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Module()
    model.norm = nn.LayerNorm(32)
    model.layers = nn.ModuleList([MLP() for _ in range(4)])
    plan = {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
    for block in model.layers:
        parallelize_module(block, mesh, plan)
    reference = copy.deepcopy(model)

    def run(m, x):
        x = m.norm(x)
        for block in m.layers:
            x = block(x)
        return x

    to_calls = []
    real_to = model.to
    model.to = lambda *a, **k: (to_calls.append(a), real_to(*a, **k))[1]
    before = {n: p.to_local().clone() for n, p in model.named_parameters() if isinstance(p.data, DTensor)}
    managers = layerwise.configure_layerwise_offload(model, "layers", device="cpu", prefetch_depth=1,
                                                     debug_copy_delay_us=300)
    assert not to_calls, "model.to must be skipped for DTensor weights"
    m = managers[0]
    shard_bytes = sum(p.to_local().numel() * p.to_local().element_size() for n, p in reference.named_parameters()
                      if n.startswith("layers."))
    assert m.plan.managed_bytes == shard_bytes  # local shards only
    assert all(isinstance(p.data, DTensor) for p in model.layers.parameters())
    torch.manual_seed(1)
    xs = [torch.randn(4, 32) for _ in range(3)]
    with torch.no_grad():
        for _ in range(3):
            for x in xs:
                out, ref = run(model, x), run(reference, x)
                assert torch.equal(out, ref), (rank, (out - ref).abs().max())
    assert m.stats()["copies"] >= 9 and m.stats()["sync_loads"] == 0  # 4 layers in 2 slots, streamed
    layerwise.remove_layerwise_offload(model)
    for n, p in model.named_parameters():
        if n in before:
            assert isinstance(p.data, DTensor) and torch.equal(p.to_local(), before[n]), n
    dist.destroy_process_group()
    print(f"rank {rank} ok")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
