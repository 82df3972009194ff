"""CUDA-graph planning for decode (verify) steps."""

from mtpkit.graphs.plan import CapturePlan, build_capture_plan, default_graph_sizes

__all__ = ["CapturePlan", "build_capture_plan", "default_graph_sizes"]
