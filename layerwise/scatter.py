"""Dispatch of the segment scatter: the Triton kernel on CUDA tensors (and on CPU
tensors under TRITON_INTERPRET=1), the pure-torch reference elsewhere. Triton
is imported on first use, never at `import layerwise`."""
from __future__ import annotations


def build_scatter_table(segment, offsets, dsts, **kwargs):
    """Validate once (at plan time) and build the device descriptor table."""
    from layerwise.triton_kernels import scatter as _s

    return _s.build_scatter_table(segment, offsets, dsts, **kwargs)


def scatter_segment(segment, offsets, dsts, table=None, backend: str = "auto") -> str:
    """Write `segment` into every destination view in one launch; returns the
    path that ran: "triton" or "ref"."""
    from layerwise.triton_kernels import scatter as _s

    return _s.scatter(segment, offsets, dsts, table=table, backend=backend)
