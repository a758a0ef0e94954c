"""layerwise: stream a model's repeated blocks from (pinned) host memory to the
accelerator, one block ahead of the compute that needs it."""
from layerwise._native import CopyEngine, Event, HostArena, build_info
from layerwise.configure import configure_layerwise_offload, remove_layerwise_offload
from layerwise.empty import empty_model
from layerwise.lifecycle import is_offloaded, managers_of
from layerwise.loading import load_offloaded
from layerwise.options import OffloadOptions
from layerwise.pipelines import offload_pipeline, remove_pipeline_offload, report, report_pipeline
from layerwise.planning.detect import detect_layer_groups
from layerwise.runtime.group import LayerwiseOffloadManager
from layerwise.scatter import build_scatter_table, scatter_segment
from layerwise.together import run_together
from layerwise.tune import TunePlan, tune

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
    "run_together",
    "scatter_segment",
    "tune",
]
__version__ = "0.1.0"
