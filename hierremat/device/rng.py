"""RNG state capture, so that recomputation replays a stage exactly (autocast: hierremat.device.autocast)."""

from __future__ import annotations

from dataclasses import dataclass

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
