"""The chain DP's decisions as values: the kernel's integer codes decoded once, at its boundary.

The decision table D (hierremat.dp.kernel, hierremat.dp.reference) holds one integer per subproblem
(v, s, t, m), for K options a stage and L stages: -1 infeasible; k in [0, K) option k of stage s;
K + s' a checkpoint split at s'; K + L + s' that split with x_s offloaded; K + 2L + k option k with
its kept values offloaded; 2K + 2L + k option k with its kept values and x_s offloaded.
:func:`decode_code` is the one place that reads them; the expander (hierremat.dp.solve) sees only
:class:`OptionChoice` and :class:`SplitChoice`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(enum.Enum):
    """What a subproblem (s, t) does first."""

    OPTION = "option"  # F_all(s, k), the rest s+1..t, B(s)
    OFFLOADED_OPTION = "offloaded option"  # the same, the option's kept values in the second tier meanwhile
    OFFLOADED_OPTION_AND_INPUT = "offloaded option and input"  # the same, x_s sent with them
    SPLIT = "split"  # F_ck(s) F_none(s+1..s'-1), the right part s'..t, the left part s..s'-1
    OFFLOADED_SPLIT = "offloaded split"  # the same, x_s in the second tier while the right part runs


_OPTION_ACTIONS = (Action.OPTION, Action.OFFLOADED_OPTION, Action.OFFLOADED_OPTION_AND_INPUT)


@dataclass(frozen=True)
class OptionChoice:
    """Run option ``option`` (an index into the stage's options) of stage s; the rest of the chain, s+1..t, may
    use ``memory_rest`` slots (0 where no memory is tracked: the min-peak schedule)."""

    action: Action
    option: int
    memory_rest: int = 0

    def __post_init__(self):
        if self.action not in _OPTION_ACTIONS:
            raise ValueError(f"an option's action is one of {[a.value for a in _OPTION_ACTIONS]}, not {self.action}")

    @property
    def kept_offloaded(self) -> bool:
        return self.action is not Action.OPTION

    @property
    def with_input(self) -> bool:
        return self.action is Action.OFFLOADED_OPTION_AND_INPUT


@dataclass(frozen=True)
class SplitChoice:
    """Checkpoint x_s and split (s, t) at ``split`` = s'; the right part may use ``memory_right`` slots, the left
    part ``memory_left`` (0 where no memory is tracked)."""

    offloaded: bool
    split: int
    memory_right: int = 0
    memory_left: int = 0


Choice = OptionChoice | SplitChoice


def decode_code(code: int, options: int, length: int) -> tuple[Action, int]:
    """(the action, the option index k or the split s') of a decision code (module docstring), for ``options``
    = K options a stage and ``length`` = L stages. Raises ValueError on -1 (infeasible) or a code out of range."""
    K, L = options, length
    if code < 0 or code >= 3 * K + 2 * L:
        raise ValueError(f"decision code {code} is not one of a chain of {L} stages with {K} options each")
    if code < K:
        return Action.OPTION, code
    if code < K + L:
        return Action.SPLIT, code - K
    if code < K + 2 * L:
        return Action.OFFLOADED_SPLIT, code - K - L
    variant, k = divmod(code - K - 2 * L, K)
    return (Action.OFFLOADED_OPTION, Action.OFFLOADED_OPTION_AND_INPUT)[variant], k
