"""Metrics: one HDF5 schema for every producer (client, router, engines, simulator), a streaming SWMR writer,
a reader and a merge. See schema.py for the layout and the column list."""

from llmd.metrics.merge import merge_runs
from llmd.metrics.reader import open_metrics, read_meta, read_requests, read_requests_array, read_timeseries
from llmd.metrics.schema import (
    PD_PATHS,
    REQUEST_COLUMNS,
    REQUEST_DTYPE,
    SCHEMA_VERSION,
    TIMESERIES_COLUMNS,
    TIMESERIES_DTYPE,
    column_docs,
    empty_rows,
    to_rows,
)
from llmd.metrics.writer import MetricsWriter

__all__ = [
    "PD_PATHS",
    "REQUEST_COLUMNS",
    "REQUEST_DTYPE",
    "SCHEMA_VERSION",
    "TIMESERIES_COLUMNS",
    "TIMESERIES_DTYPE",
    "MetricsWriter",
    "column_docs",
    "empty_rows",
    "merge_runs",
    "open_metrics",
    "read_meta",
    "read_requests",
    "read_requests_array",
    "read_timeseries",
    "to_rows",
]
