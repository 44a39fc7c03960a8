"""RNG and autocast state capture, so that recomputation replays a stage exactly."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch


def cuda_devices_of(*tensors: torch.Tensor) -> tuple[int, ...]:
    return tuple(sorted({t.device.index or 0 for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda}))


@dataclass
class RngState:
    """CPU generator state and the states of the given CUDA devices."""

    cpu: torch.Tensor
    cuda: dict[int, torch.Tensor]

    @classmethod
    def capture(cls, cuda_devices: tuple[int, ...] = ()) -> "RngState":
        return cls(torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in cuda_devices})

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for d, state in self.cuda.items():
            torch.cuda.set_rng_state(state, d)


#: Bytes of one captured CPU RNG state (Mersenne Twister), used to reserve memory for
#: the states kept for recomputed stages.
CPU_RNG_STATE_BYTES = torch.get_rng_state().numel()


@dataclass(frozen=True)
class AutocastState:
    """Autocast settings of the caller, per device type, re-entered for recomputation."""

    settings: tuple[tuple[str, bool, torch.dtype], ...]
    cache_enabled: bool

    @classmethod
    def capture(cls, device_types: tuple[str, ...]) -> "AutocastState":
        types = tuple(dict.fromkeys(("cpu",) + device_types))
        return cls(
            tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types),
            torch.is_autocast_cache_enabled(),
        )

    @contextmanager
    def applied(self) -> Iterator[None]:
        with ExitStack() as stack:
            for device_type, enabled, dtype in self.settings:
                stack.enter_context(
                    torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=self.cache_enabled)
                )
            yield
