"""Memory advisor: for a model and GPU, does the elastic KV reserve or a smaller token budget pay (docs/ADVISOR.md)."""

from kvflow.advisor.advise import Advice, advise, table
from kvflow.advisor.shapes import load_shape
from kvflow.model.shape import ModelShape

__all__ = ["Advice", "advise", "table", "ModelShape", "load_shape"]
