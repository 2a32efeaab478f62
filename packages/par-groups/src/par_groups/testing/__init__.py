"""Multi-rank test harness: run a function on N CPU ranks over gloo, workers reused across tests."""

from .harness import Harness, RankFailure, RankPool

__all__ = ["Harness", "RankFailure", "RankPool"]
