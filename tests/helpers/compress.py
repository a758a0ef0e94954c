"""Models for compress="lossless" (tests/stages/test_compress.py,
tests/runtime/test_cuda_path.py): stacks whose weights have trained-weight
statistics (which the codec shrinks) or uniformly random bits (which it must
store raw), a block whose output depends on every bit of its weights, and
inputs for them."""
import torch
from torch import nn


def weight_like(out_f, in_f, dtype, g):
    """Normal values, per-output-channel scales drawn log-normally, a few large outliers."""
    w = torch.randn(out_f, in_f, generator=g) * torch.exp(torch.randn(out_f, 1, generator=g) * 0.5) * 0.02
    idx = torch.randint(0, w.numel(), (max(1, w.numel() // 2000),), generator=g)
    w.view(-1)[idx] *= 40
    return w.to(dtype)


def random_bits(shape, dtype, g):
    """Every 16-bit pattern equally likely: NaN payloads, infinities, signed zeros, subnormals."""
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int32, generator=g).to(torch.int16).view(dtype)


class Checksum(nn.Module):
    """A block whose output depends on every bit of its weights at its position
    (NaN or not): a wrong or misplaced byte in the slot changes the output."""

    def __init__(self, w: torch.Tensor, norm: torch.Tensor):
        super().__init__()
        self.w = nn.Parameter(w, requires_grad=False)
        self.norm = nn.Parameter(norm, requires_grad=False)  # fp32: a second segment (16 values: stored)

    def forward(self, x):
        bits = self.w.view(torch.int16).to(torch.int64).view(-1)
        pos = torch.arange(1, bits.numel() + 1, dtype=torch.int64)
        fbits = self.norm.view(torch.int32).to(torch.int64)
        return x * 31 + (bits * pos).sum() + (fbits * torch.arange(1, fbits.numel() + 1)).sum()


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class LinearBlock(nn.Module):
    def __init__(self, w, b, norm_w):
        super().__init__()
        self.lin = nn.Linear(w.shape[1], w.shape[0], dtype=w.dtype)
        with torch.no_grad():
            self.lin.weight.copy_(w)
            self.lin.bias.copy_(b)
        self.norm = nn.LayerNorm(w.shape[1])
        with torch.no_grad():
            self.norm.weight.copy_(norm_w)

    def forward(self, x):
        return self.lin(self.norm(x.float()).to(self.lin.weight.dtype))


def linear_stack(dtype, n=8, d=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Stack([LinearBlock(weight_like(d, d, dtype, g), weight_like(1, d, dtype, g)[0],
                              1 + torch.randn(d, generator=g) * 0.1) for _ in range(n)]).eval()


def checksum_stack(kinds, dtype=torch.bfloat16, d=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for kind in kinds:
        w = random_bits((d, d), dtype, g) if kind == "random" else weight_like(d, d, dtype, g)
        blocks.append(Checksum(w, torch.randn(16, generator=g)))
    return Stack(blocks).eval()


def xs_for(d, dtype, n=3):
    g = torch.Generator().manual_seed(5)
    return [torch.randn(2, d, generator=g).to(dtype) for _ in range(n)]
