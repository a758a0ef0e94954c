"""layerwise: stream a model's repeated blocks from (pinned) host memory to the
accelerator, one block ahead of the compute that needs it."""
from ._native import CopyEngine, Event, HostArena, build_info
from .configure import configure_layerwise_offload, remove_layerwise_offload
from .detect import detect_layer_groups
from .empty import empty_model
from .lifecycle import is_offloaded, managers_of
from .loading import load_offloaded
from .manager import LayerwiseOffloadManager
from .options import OffloadOptions
from .pipelines import offload_pipeline, remove_pipeline_offload, report, report_pipeline
from .scatter import build_scatter_table, scatter_segment
from .tune import TunePlan, tune

__all__ = [
    "CopyEngine",
    "Event",
    "HostArena",
    "LayerwiseOffloadManager",
    "OffloadOptions",
    "TunePlan",
    "build_info",
    "build_scatter_table",
    "configure_layerwise_offload",
    "detect_layer_groups",
    "empty_model",
    "is_offloaded",
    "load_offloaded",
    "managers_of",
    "offload_pipeline",
    "remove_layerwise_offload",
    "remove_pipeline_offload",
    "report",
    "report_pipeline",
    "scatter_segment",
    "tune",
]
__version__ = "0.1.0"
