"""Measured stage costs and executor speeds, cached beside the block-option menus.

Planning a whole model times every distinct stage (``profile_chain``) and, with block
options, how fast the op-by-op executor runs each block (hierremat.planning.menus). Both depend
only on the stage's structural signature, whether its input needs a gradient, which
outputs get one, and the device (on CPU also torch's thread count), so they are stored
in hierremat's option cache (same directory, same checksummed JSON entries, same
``cache=False`` switch) under keys of their own. A second plan of the same model, in
this process or a later one, then re-times nothing.

Measurements are of the machine as it was when they were taken; clear the cache
(``python -m hierremat.cache clear``) after changing hardware or drivers, or plan with
``cache=False`` to measure afresh.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass

import torch

from ..plans.costs import StageCosts
from ..plans.memory_trace import MemoryTrace
from ..store.cache import CacheKey, OptionsCache

log = logging.getLogger(__name__)

#: Bump when what profile_chain measures, or how, changes (invalidates cached stage costs).
STAGE_COST_VERSION = "stage-13"


@dataclass(frozen=True)
class ExecutorSpeeds:
    """How fast a stage signature's generated code runs, as measured.

    scale: seconds an option's generated forward + backward takes per second of its
        node-time sum (the ILP's cost model).
    forward_seconds: seconds of the signature's generated forward without grad.
    """

    scale: float
    forward_seconds: float


def device_name(device: torch.device) -> str:
    """The device's model name (CUDA), or the processor and torch's intra-op thread count (CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine() or 'cpu'}, {torch.get_num_threads()} threads"


def _dtype(x: torch.Tensor) -> str:
    return str(x.dtype) if x.is_floating_point() else "int"


class StageCostCache:
    """Stage costs and executor speeds in an OptionsCache (None or disabled: every lookup misses)."""

    def __init__(self, cache: OptionsCache | None):
        self.cache = cache if cache is not None and cache.enabled else None

    def _key(self, what: str, signature: str, x: torch.Tensor, detail: str) -> CacheKey:
        return CacheKey(
            signature=f"{what}:{signature}:{detail}",
            device_type=x.device.type,
            device_name=device_name(x.device),
            dtype=_dtype(x),
            cost_model_version=f"{STAGE_COST_VERSION}/torch-{torch.__version__}",
            formulation_version=what,
        )

    @staticmethod
    def _stage_detail(requires_grad: bool, grad_mask: tuple[bool, ...] | None, last: bool) -> str:
        mask = "default" if grad_mask is None else "".join("1" if m else "0" for m in grad_mask)
        return f"{'grad' if requires_grad else 'nograd'}:{mask}{':last' if last else ''}"

    def get_stage(
        self, signature: str, x: torch.Tensor, requires_grad: bool, grad_mask: tuple[bool, ...] | None,
        last: bool = False,
    ) -> tuple[StageCosts, tuple[bool, ...] | None, MemoryTrace | None] | None:
        """(costs, the output gradient mask they were measured with, their memory trace if recorded) or None.
        ``last``: the costs of the chain's last stage (its output gradients held through the backward)."""
        if self.cache is None:
            return None
        payload = self.cache.get(self._key("stage-costs", signature, x, self._stage_detail(requires_grad, grad_mask,
                                                                                         last)))
        if payload is None:
            return None
        try:
            mask = payload["grad_mask"]
            trace = payload.get("trace")
            return (
                StageCosts.from_dict(payload["costs"]), None if mask is None else tuple(bool(m) for m in mask),
                None if trace is None else MemoryTrace.from_dict(trace),
            )
        except (KeyError, TypeError, ValueError) as err:
            log.warning("cached stage costs for %s are unreadable (%s); measuring again", signature, err)
            return None

    def put_stage(
        self, signature: str, x: torch.Tensor, requires_grad: bool, grad_mask: tuple[bool, ...] | None,
        costs: StageCosts, measured_mask: tuple[bool, ...] | None, trace: MemoryTrace | None = None,
        last: bool = False,
    ) -> None:
        if self.cache is None:
            return
        payload = {"costs": costs.to_dict(), "grad_mask": None if measured_mask is None else list(measured_mask),
                   "trace": None if trace is None else trace.to_dict()}
        detail = self._stage_detail(requires_grad, grad_mask, last)
        self.cache.put(self._key("stage-costs", signature, x, detail), payload)

    def put_menu_built(self, signature: str, x: torch.Tensor, settings: str) -> None:
        """Record that the stage of ``signature`` on ``x`` had its block menu built (solved or re-costed) with this
        cache, for ``settings`` (what else the menu depends on: variants, segmentation, the autocast recipe): a
        later plan finds it there without tracing the stage (:meth:`menu_built`)."""
        if self.cache is not None and not self.menu_built(signature, x, settings):
            self.cache.put(self._key("menu-built", signature, x, settings), {"built": True})

    def menu_built(self, signature: str, x: torch.Tensor, settings: str) -> bool:
        """Whether :meth:`put_menu_built` recorded the stage's block menu for ``settings`` (False without a cache)."""
        return self.cache is not None and self.cache.get(self._key("menu-built", signature, x, settings)) is not None

    def get_speeds(self, signature: str, x: torch.Tensor) -> ExecutorSpeeds | None:
        """The generated code's measured speeds for a signature, if measured before."""
        if self.cache is None:
            return None
        payload = self.cache.get(self._key("executor-speeds", signature, x, "-"))
        try:
            return None if payload is None else ExecutorSpeeds(float(payload["scale"]), float(payload["forward_seconds"]))
        except (KeyError, TypeError, ValueError):
            return None

    def put_speeds(self, signature: str, x: torch.Tensor, speeds: ExecutorSpeeds) -> None:
        if self.cache is not None:
            self.cache.put(
                self._key("executor-speeds", signature, x, "-"),
                {"scale": float(speeds.scale), "forward_seconds": float(speeds.forward_seconds)},
            )
