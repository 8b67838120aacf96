"""Choosing a strategy: the search space, the ILP (PuLP) and the brute-force oracle."""

from amsp_planner.solver.solve import SolveResult, solve
from amsp_planner.solver.space import SearchSpace

__all__ = ["SearchSpace", "SolveResult", "solve"]
