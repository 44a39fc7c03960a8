"""Per-block integer programs: a block's menu of options (hierremat.plans.block_options); never imports torch.

The model is documented in ``formulation``; solving in ``solve``; the option menu and
the op-list simulator in ``options``.
"""

from .formulation import CompactGraph, Decisions, compact
from .options import OptionSimulation, simulate_option, solve_menu
from .solve import BlockIlp, IlpResult, solve_block, solve_count

__all__ = [
    "BlockIlp",
    "CompactGraph",
    "Decisions",
    "IlpResult",
    "OptionSimulation",
    "compact",
    "simulate_option",
    "solve_block",
    "solve_count",
    "solve_menu",
]
