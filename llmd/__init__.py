"""llmd: the llm-d way of serving LLMs for agentic workloads, native to Slurm."""

__version__ = "0.1.0"
