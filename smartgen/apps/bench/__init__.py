"""`smartgen bench`: every scheme over real prefill and decode processes, side by side, in a stated regime."""

from smartgen.apps.bench.config import DEFAULT_SCHEMES, BenchConfig, Point
from smartgen.apps.bench.runner import BenchResult, run_bench

__all__ = ["BenchConfig", "Point", "BenchResult", "DEFAULT_SCHEMES", "run_bench"]
