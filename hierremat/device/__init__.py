"""Device state: memory meters (the live-tensor tracker and the CPU allocator meter on CPU,
``max_memory_allocated`` on CUDA), autocast scopes and RNG states. The bottom of the torch side:
it imports nothing else of hierremat."""

from .memory import CpuAllocatorMeter, CudaPeakMeter, LiveTensorTracker, is_abstract, measure_peak, memory_meter

__all__ = ["CpuAllocatorMeter", "CudaPeakMeter", "LiveTensorTracker", "is_abstract", "measure_peak", "memory_meter"]
