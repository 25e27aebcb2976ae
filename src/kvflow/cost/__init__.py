"""Cost model: profiled compute time per (chunk, position, layers) and I/O time per byte."""

from kvflow.cost.model import CostModel, default_profile_path, profiles_dir
from kvflow.cost.profiler import profile
from kvflow.cost.saved import cost_profile, saved_profile

__all__ = ["CostModel", "cost_profile", "default_profile_path", "profiles_dir", "profile", "saved_profile"]
