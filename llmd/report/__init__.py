"""Reports on a run's metrics HDF5: the summary numbers (`summary`), PNG figures (`figures`) and the llm-d Benchmark
Report v0.2 export (`export`, `llmd export`)."""

from llmd.report.summary import RunSummary, hit_share_per_turn, summarize, summary_table

__all__ = ["RunSummary", "hit_share_per_turn", "summarize", "summary_table"]
