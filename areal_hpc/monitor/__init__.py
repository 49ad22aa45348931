"""What users look at: per-step statistics, the progress line, the end-of-run summary, episodes' transcripts.

stats        stats.jsonl (one JSON line per step) and the original's step log line
progress     progress.json (the master's side) and the progress line (the launcher's and `status`'s side)
summary      did the policy learn? the summary table of `make demo`
writers      the statistics copied to TensorBoard and W&B
transcripts  the transcripts of a sample of each step's episodes (logs/episodes/), written and read
episodes     `areal-hpc episodes`: those transcripts printed for a reader, or as JSON lines
trace        `areal-hpc trace`: the run's timeline (control/timeline.py) as a Perfetto trace and a step table
plots        PNGs of a run's curves (`areal-hpc plot`; loaded when named: matplotlib is slow to import)
"""

from areal_hpc.monitor.episodes import show_episodes
from areal_hpc.monitor.progress import Progress, progress_line, write_progress
from areal_hpc.monitor.stats import StatsLog, format_secs, read_stats, step_line
from areal_hpc.monitor.summary import format_table, learning_summary
from areal_hpc.monitor.trace import read_timeline, step_rows, steps_of, write_trace
from areal_hpc.monitor.transcripts import TranscriptLog, read_transcripts, transcript_steps
from areal_hpc.monitor.writers import open_writers

__all__ = [
    "Progress",
    "StatsLog",
    "TranscriptLog",
    "format_secs",
    "format_table",
    "learning_summary",
    "open_writers",
    "progress_line",
    "read_stats",
    "read_timeline",
    "read_transcripts",
    "show_episodes",
    "step_line",
    "step_rows",
    "steps_of",
    "transcript_steps",
    "write_progress",
    "write_trace",
]


def __getattr__(name: str):
    if name in ("FIGURES", "plot_run"):
        from areal_hpc.monitor import plots

        return getattr(plots, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
