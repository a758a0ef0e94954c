"""File formats layerwise reads and writes (safetensors checkpoints)."""
