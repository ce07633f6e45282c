"""llmd: the llm-d way of serving LLMs for agentic workloads, native to Slurm."""

__version__ = "0.1.0"

# Before anything imports the engine core: whether its compiled build or its Python source runs (llmd/compiled.py).
from llmd import compiled as _compiled  # noqa: F401
