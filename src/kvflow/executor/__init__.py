"""Executor: runs any plan with compute and I/O overlapped, records the timeline. Verifies nothing."""

from kvflow.executor.executor import Execution, Executor, Job
from kvflow.executor.timeline import Event, Timings, plot_timeline

__all__ = ["Execution", "Executor", "Job", "Event", "Timings", "plot_timeline"]
