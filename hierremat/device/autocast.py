"""The caller's autocast setting: part of every plan, and re-entered around every stage call.

Mixed precision changes what a step computes and holds, so a plan is made for one
autocast setting (per device type: on or off, and the lower-precision dtype):

* **Capture** runs under the setting, so the model's Python code sees the dtypes it sees
  in training (``x.to(query.dtype)``, ``torch.finfo(dtype).min``) and the traced shapes
  and dtypes are those of the autocast run. Plans, stage signatures and cached menus are
  keyed by :meth:`AutocastState.key`; ``RematModule`` re-plans when called under another
  setting.
* **Stages under autograd** (option 0, and every no-grad or recomputing forward) run their
  captured ATen graph under the setting, so autocast casts exactly as in eager mode: the
  same kernels in the same dtypes, hence bitwise the same outputs and gradients.
* **Block options** run a joint graph traced under the setting (AOTAutograd records each
  cast autocast makes as an explicit ``_to_copy`` node, weights included), with autocast
  off: the ILP sees every cast copy as a value to keep or recompute.

The autocast *cache* keeps the low-precision copy of every weight cast in a context until
the outermost context exits: with one context per step that is the end of the forward,
with one context around forward and backward the end of the backward. Neither is a
moment the chain plan can model per stage, so :meth:`AutocastState.stage_scope` clears
the cache after each stage call: a weight's copy then lives exactly as long as the stage
(or autograd, which saves it for the backward) needs it, which profiling measures as part
of the stage's costs, whichever of the two patterns the caller uses. Within one stage
call the cache works as in eager mode (a weight used twice is cast once).

Known difference: a weight that autocast casts in *several* stages (one layer applied in
several places of the chain) is cast once per stage instead of once per context, so its
gradient is accumulated in fp32 across those stages where eager autocast sums the
low-precision gradients first; the two agree to within the low precision's rounding.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

#: Device types whose autocast setting is recorded (others are added when a tensor lives there).
DEVICE_TYPES = ("cpu", "cuda")

_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def _types(device_types: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(DEVICE_TYPES + tuple(device_types)))


@dataclass(frozen=True)
class AutocastState:
    """Autocast settings per device type (type, enabled, lower-precision dtype) and the cache flag."""

    settings: tuple[tuple[str, bool, torch.dtype], ...]
    cache_enabled: bool = True

    @classmethod
    def capture(cls, device_types: tuple[str, ...] = ()) -> "AutocastState":
        """The current thread's settings for DEVICE_TYPES and ``device_types``."""
        return cls(
            tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in _types(device_types)),
            torch.is_autocast_cache_enabled(),
        )

    @classmethod
    def off(cls, device_types: tuple[str, ...] = ()) -> "AutocastState":
        """Autocast disabled on DEVICE_TYPES and ``device_types`` (for graphs whose casts are explicit)."""
        return cls(tuple((t, False, torch.get_autocast_dtype(t)) for t in _types(device_types)))

    @property
    def enabled(self) -> bool:
        return any(on for _, on, _ in self.settings)

    def key(self) -> str:
        """What a plan depends on: the device types autocast is on for and their dtypes ('' if off)."""
        return ",".join(f"{t}:{_SHORT.get(dtype, str(dtype))}" for t, on, dtype in self.settings if on)

    def describe(self) -> str:
        """For summaries: 'off', or e.g. 'bf16 on cpu'."""
        on = [f"{_SHORT.get(dtype, str(dtype))} on {t}" for t, on_, dtype in self.settings if on_]
        return "; ".join(on) if on else "off"

    @contextmanager
    def applied(self) -> Iterator[None]:
        """These settings, whatever the surrounding context says."""
        with ExitStack() as stack:
            for device_type, enabled, dtype in self.settings:
                stack.enter_context(
                    torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=self.cache_enabled)
                )
            yield

    @contextmanager
    def stage_scope(self) -> Iterator[None]:
        """One stage call: these settings, and the autocast cache cleared afterwards (module docstring)."""
        with self.applied():
            try:
                yield
            finally:
                if self.enabled:
                    torch.clear_autocast_cache()
