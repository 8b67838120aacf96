"""Input specifications: model, cluster and training job.

The only place that reads spec files (YAML presets, user YAML/JSON, Hugging Face config.json).
"""

from amsp_planner.specs.cluster import ClusterSpec, GpuSpec, MeasuredTable
from amsp_planner.specs.loader import (
    list_presets,
    load_cluster,
    load_model,
    parse_batch,
)
from amsp_planner.specs.model import ModelSpec
from amsp_planner.specs.training import TrainingSpec

__all__ = [
    "ClusterSpec",
    "GpuSpec",
    "MeasuredTable",
    "ModelSpec",
    "TrainingSpec",
    "list_presets",
    "load_cluster",
    "load_model",
    "parse_batch",
]
