"""Planner: decides what is recomputed and what is loaded, and in which order. Returns a plain Plan."""

from kvflow.planner.plan import ComputeStep, LoadStep, Plan, Prediction
from kvflow.planner.predict import IOModel, lower_bound, predict
from kvflow.planner.strategies import STRATEGIES, Planner, PlannerConfig, Request

__all__ = ["ComputeStep", "LoadStep", "Plan", "Prediction", "IOModel", "lower_bound", "predict", "STRATEGIES",
           "Planner", "PlannerConfig", "Request"]
