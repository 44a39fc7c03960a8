"""Chain dynamic program (Rotor, extended to per-stage options). Never imports torch."""

from .solve import ChainSolution, load_kernel, min_peak_schedule, solve_chain

__all__ = ["ChainSolution", "load_kernel", "min_peak_schedule", "solve_chain"]
