"""Compile-time tensor + context parallelism for unmodified PyTorch models."""

from .gcpause import paused_gc

with paused_gc():  # importing torch and Dynamo: ~0.5 s of collections that find no garbage
    from .api import from_pretrained, hybrid_parallel, parallel
    from .checkpoints import save_pretrained
    from .choose import choose_mesh
    from .explain import explain
    from .logs import set_verbosity
    from .mesh import init_mesh
    from .pipelining import pipeline
    from .sharded import parallelize

__all__ = ["choose_mesh", "explain", "from_pretrained", "hybrid_parallel", "init_mesh", "parallel", "parallelize",
           "pipeline", "save_pretrained", "set_verbosity"]
