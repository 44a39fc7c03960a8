"""Everything that touches tensors at run time: execution, measurement, profiling."""

from .executor import ChainRunner
from .memory import CudaPeakMeter, LiveTensorTracker, measure_peak, memory_meter
from .profile import ChainProfile, profile_chain

__all__ = [
    "ChainProfile",
    "ChainRunner",
    "CudaPeakMeter",
    "LiveTensorTracker",
    "measure_peak",
    "memory_meter",
    "profile_chain",
]
