"""The disk tier's test model and budgets (tests/stages/test_disk_tier.py and the
tests that stream it from files: chain recovery, disk files, residency, removal,
the CUDA path): a stack of `blocks` whose layers are about 256 KiB in bf16, and a
host_budget that leaves room for a given number of layers in memory. The
`disk_dir` fixture (a real file system) is tests/stages/conftest.py's."""
import glob
import os

import torch
from safetensors.torch import save_file
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(torch.nn.functional.gelu(self.fc(x))) + x


class Net(nn.Module):
    def __init__(self, width=256, depth=8, groups=1):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        if groups > 1:
            self.more = nn.ModuleList(Block(width) for _ in range(depth // 2))
        self.head = nn.Linear(width, 8)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        for b in getattr(self, "more", []):
            x = b(x)
        return self.head(x)


def make(dtype=torch.bfloat16, seed=0, **kw):
    torch.manual_seed(seed)
    return Net(**kw).to(dtype)


def layer_bytes(model, name="blocks"):
    return sum(p.numel() * p.element_size() for p in getattr(model, name)[0].parameters())


def budget(model, keep, depth=1, disk_depth=None, device="cpu", groups=("blocks",)):
    """A host_budget that leaves room for about `keep` layers in memory, from the
    planner's accounting (layerwise.planning.host_budget): staging, scratch, and on a CPU
    device the non-layer weights and the rings."""
    lb = layer_bytes(model) + 4096
    n = len(groups)
    slots = disk_depth if disk_depth else max(2, depth + 1)  # staging slots (layerwise.planning.host_budget.staging_slots)
    total = (slots * (lb + 12 * 4096)) * n + lb + keep * lb
    if device == "cpu":
        managed = {id(p) for g in groups for p in getattr(model, g).parameters()}
        total += sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in managed)
        total += (depth + 3) * lb * n
    return int(total)


def spill_files(d):
    return sorted(glob.glob(os.path.join(d, "layerwise-*.spill")))


def inputs(dtype=torch.bfloat16, n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 256, generator=g).to(dtype) for _ in range(n)]


def save_checkpoint(model, path):
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return path


def meta_model(dtype=torch.bfloat16, **kw):
    with torch.device("meta"):
        return Net(**kw).to(dtype)
