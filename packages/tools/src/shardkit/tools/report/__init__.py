"""Showing it: reports of what the trackers recorded.

:func:`summarize` prints terminal tables; :func:`write_report` writes a folder with the
summary, the merged JSON, a Perfetto trace and PNG plots; ``json_io`` keeps one file per rank
while a run goes on. The ``shardkit-profile`` command (``cli``, with its ``_autoprofile``
start-up hook) profiles every rank of an unchanged training command and reports on it.
"""

from shardkit.tools.report.folder import write_report
from shardkit.tools.report.json_io import (
    load_merged_report,
    load_rank_reports,
    write_rank_report,
)
from shardkit.tools.report.text import summarize

__all__ = [
    "load_merged_report",
    "load_rank_reports",
    "summarize",
    "write_rank_report",
    "write_report",
]
