"""Executor: runs any plan with compute and I/O overlapped, records the timeline. Verifies nothing but its own
bookkeeping (every grid cell filled exactly once)."""

from kvflow.executor.board import Board
from kvflow.executor.config import ExecutorConfig
from kvflow.executor.executor import Executor
from kvflow.executor.job import Execution, Job
from kvflow.executor.sync import StallError
from kvflow.executor.timeline import Event, Timings, plot_timeline

__all__ = ["Board", "Execution", "Executor", "ExecutorConfig", "Job", "StallError", "Event", "Timings",
           "plot_timeline"]
