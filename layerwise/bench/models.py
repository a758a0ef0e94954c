"""The synthetic models the suites run: a DiT-like block stack (stream), a
component with several block lists of different sizes (startup) and a stack
of blocks that do nothing but own parameters (hooks)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def build(cls, *args, dtype: torch.dtype, generate_on: torch.device, seed: int = 0, **kwargs) -> nn.Module:
    """cls(*args, **kwargs) on the host with random weights of `dtype`.

    The module is built on the meta device (nn.Linear's own init of gigabytes
    on the host takes many seconds), given uninitialised host memory, and filled
    with N(0, 1/fan_in) weights drawn on `generate_on` (a GPU draws gigabytes in
    milliseconds) and copied back: biases near 0, norm weights near 1.
    """
    with torch.device("meta"):
        model = cls(*args, **kwargs)
    model = model.to(dtype).to_empty(device="cpu")
    gen = torch.Generator(device=generate_on).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            x = torch.randn(p.shape, generator=gen, device=generate_on, dtype=torch.float32)
            if p.dim() > 1:
                x.mul_(p.shape[-1] ** -0.5)
            else:
                x.mul_(0.02).add_(1.0 if "norm" in name else 0.0)
            p.copy_(x)
    return model


# ----------------------------------------------------------------- stream
class MLPBlock(nn.Module):
    """A DiT-style block without attention: pre-LayerNorm, 4x GELU MLP, residual.

    Per block: 8 h^2 weights and 16 T h^2 FLOPs for T tokens, so compute per
    transferred byte grows linearly with the token count.
    """

    def __init__(self, hidden: int, mlp_ratio: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, mlp_ratio * hidden)
        self.fc2 = nn.Linear(mlp_ratio * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))


class DiTStack(nn.Module):
    """Input projection, `layers` MLPBlocks in `blocks`, final norm and head."""

    def __init__(self, hidden: int, layers: int):
        super().__init__()
        self.proj_in = nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList([MLPBlock(hidden) for _ in range(layers)])
        self.norm_out = nn.LayerNorm(hidden)
        self.proj_out = nn.Linear(hidden, hidden)

    def forward(self, x):
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return self.proj_out(self.norm_out(x))


# ---------------------------------------------------------------- startup
GROUPS = ("small_blocks", "large_blocks", "extra_blocks")


class MultiGroupModel(nn.Module):
    """Non-layer modules (embed, norm, head) plus one block list per entry of
    `groups`: name -> (number of blocks, width). Never run forward; only configured."""

    def __init__(self, width: int, groups: dict[str, tuple[int, int]]):
        super().__init__()
        self.embed = nn.Linear(width, width)
        for name, (n, w) in groups.items():
            setattr(self, name, nn.ModuleList([nn.Sequential(nn.Linear(w, w), nn.LayerNorm(w)) for _ in range(n)]))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, width)
        self.group_names = list(groups)

    def group_bytes(self) -> dict[str, int]:
        return {g: sum(p.numel() * p.element_size() for p in getattr(self, g).parameters()) for g in self.group_names}

    def largest_layer_bytes(self) -> int:
        return max(sum(p.numel() * p.element_size() for p in block.parameters())
                   for g in self.group_names for block in getattr(self, g))

    def non_layer_parameters(self) -> list:
        layer = {id(p) for g in self.group_names for p in getattr(self, g).parameters()}
        return [p for p in self.parameters() if id(p) not in layer]

    def non_layer_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.non_layer_parameters())


# ------------------------------------------------------------------ hooks
class ParamHolder(nn.Module):
    """A block with `num_params` small parameters whose forward returns its input:
    running it costs only the module call and whatever hooks are installed."""

    def __init__(self, num_params: int, numel: int):
        super().__init__()
        self.params = nn.ParameterList([nn.Parameter(torch.randn(numel)) for _ in range(num_params)])

    def forward(self, x):
        return x


class HolderStack(nn.Module):
    def __init__(self, layers: int, num_params: int, numel: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList([ParamHolder(num_params, numel) for _ in range(layers)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class WideLight(nn.Module):
    """Many bytes, little compute: a wide weight applied to one token."""

    def __init__(self, hidden: int, wide: int):
        super().__init__()
        self.w = nn.Linear(hidden, wide)

    def forward(self, x):
        return x + self.w(x[:1]).mean() * 0


class NarrowHeavy(nn.Module):
    """Few bytes, much compute: a hidden x hidden weight applied `reps` times to every token."""

    def __init__(self, hidden: int, reps: int):
        super().__init__()
        self.w = nn.Linear(hidden, hidden)
        self.reps = reps

    def forward(self, x):
        for _ in range(self.reps):
            x = torch.tanh(self.w(x))
        return x


class MixedStack(nn.Module):
    """A block list whose layers differ in size and compute, in an irregular order
    (`kinds`: "B" a WideLight, "H" a NarrowHeavy): the layers whose transfer is least
    hidden are the big light ones, not the first ones (layerwise.tune's case)."""

    def __init__(self, kinds: str, hidden: int, wide: int, reps: int):
        super().__init__()
        self.proj_in = nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList(WideLight(hidden, wide) if k == "B" else NarrowHeavy(hidden, reps) for k in kinds)

    def forward(self, x):
        x = self.proj_in(x)
        for b in self.blocks:
            x = b(x)
        return x
