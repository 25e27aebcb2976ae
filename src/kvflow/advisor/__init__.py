"""Memory advisor: for a model and GPU, does the elastic KV reserve or a smaller token budget pay (docs/ADVISOR.md)."""

from kvflow.advisor.advise import Advice, advise, table
from kvflow.advisor.shapes import ModelShape, load_shape

__all__ = ["Advice", "advise", "table", "ModelShape", "load_shape"]
