"""Small models for the manager tests: several block lists, mixed dtypes,
non-contiguous and tied parameters, buffers."""
import torch
from torch import nn


class Block(nn.Module):
    """bf16 linears (one stored transposed, strides checked in forward), an fp32 norm, a buffer."""

    def __init__(self, d, dtype=torch.bfloat16, transposed=True):
        super().__init__()
        self.norm = nn.LayerNorm(d)  # fp32
        self.up = nn.Linear(d, 2 * d, dtype=dtype)
        w = torch.randn(d, 2 * d, dtype=dtype) / d**0.5
        # A weight kept as the transpose of a contiguous tensor: strides (1, 2d).
        self.down_t = nn.Parameter(w.t() if transposed else w.t().contiguous())
        self.transposed = transposed
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        if self.transposed:
            assert self.down_t.stride() == (1, self.down_t.shape[0]), self.down_t.stride()
        h = self.norm(x).to(self.up.weight.dtype)
        h = torch.relu(self.up(h)) @ self.down_t
        return x + h.float() * self.scale


class TwoGroupModel(nn.Module):
    """A DiT-like component: embed, two block lists, head."""

    def __init__(self, d=32, n_a=5, n_b=3):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.transformer_blocks = nn.ModuleList([Block(d) for _ in range(n_a)])
        self.single_transformer_blocks = nn.ModuleList([Block(d, transposed=False) for _ in range(n_b)])
        self.head = nn.Linear(d, d)

    def forward(self, x, order_a=None, order_b=None):
        x = self.embed(x)
        for i in order_a if order_a is not None else range(len(self.transformer_blocks)):
            x = self.transformer_blocks[i](x)
        for i in order_b if order_b is not None else range(len(self.single_transformer_blocks)):
            x = self.single_transformer_blocks[i](x)
        return self.head(x)


class SizedComponent(nn.Module):
    """small_blocks, large_blocks and a non_layer module; records every model.to call."""

    def __init__(self, d_small=16, d_large=64):
        super().__init__()
        self.small_blocks = nn.ModuleList([nn.Linear(d_small, d_small) for _ in range(2)])
        self.large_blocks = nn.ModuleList([nn.Linear(d_large, d_large) for _ in range(3)])
        self.non_layer = nn.Linear(d_large, d_small)
        self.up = nn.Linear(d_small, d_large)
        self.to_calls = []

    def to(self, *args, **kwargs):
        # At each call: the bytes of parameters that are not (1,) placeholders,
        # i.e. what a GPU would receive, and the shapes of every layer parameter.
        moved = sum(p.numel() * p.element_size() for p in self.parameters() if p.shape != (1,))
        layer_shapes = [tuple(p.shape) for n, p in self.named_parameters() if "_blocks." in n]
        self.to_calls.append({"bytes": moved, "layer_shapes": layer_shapes})
        return super().to(*args, **kwargs)

    def non_layer_bytes(self):
        return sum(p.numel() * p.element_size() for n, p in self.named_parameters() if "_blocks." not in n)

    def forward(self, x):
        for b in self.small_blocks:
            x = b(x)
        x = self.up(x)
        for b in self.large_blocks:
            x = b(x)
        return self.non_layer(x)


class TiedModel(nn.Module):
    """Layers 0 and 2 share one linear; layer 1's norm weight is tied to a non-layer norm."""

    def __init__(self, d=16):
        super().__init__()
        shared = nn.Linear(d, d)
        self.final_norm = nn.LayerNorm(d)
        self.blocks = nn.ModuleList([nn.Sequential(shared, nn.GELU()), nn.LayerNorm(d), nn.Sequential(shared),
                                     nn.Linear(d, d)])
        self.blocks[1].weight = self.final_norm.weight

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.final_norm(x)


class NestedNames(nn.Module):
    """A nested list with the same attribute name as the top-level group."""

    def __init__(self, d=8):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.blocks = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self.blocks = nn.ModuleList([nn.Linear(d, d) for _ in range(3)])

    def forward(self, x):
        for b in self.encoder.blocks:
            x = b(x)
        for b in self.blocks:
            x = b(x)
        return x
