"""Triton kernels of the ``layerwise`` package (installed as ``layerwise.triton_kernels``).

Modules here must not import the bare name ``triton_kernels`` (a package that
Triton ships uses it); use relative imports only.
"""
