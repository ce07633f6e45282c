"""HDF5 -> tables and figures: load one run or a whole sweep (lazily, a live run as far as it got), summarize each
run, draw the figures a paper needs and write a report folder (`llmd analyze`). Reads metrics files only, never
live objects of a running stack."""

from analysis.runs import Run
from analysis.summary import Summary, summarize
from analysis.sweeps import Sweep, load, load_sweep

__all__ = ["Run", "Summary", "Sweep", "load", "load_sweep", "summarize"]
