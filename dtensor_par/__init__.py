"""Compile-time tensor + context parallelism for unmodified PyTorch models."""

from .api import hybrid_parallel
from .mesh import init_mesh

__all__ = ["hybrid_parallel", "init_mesh"]
