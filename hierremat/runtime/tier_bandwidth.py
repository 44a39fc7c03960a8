"""How fast values move to and from a second tier: measured on the machine, cached like the
stage costs (hierremat.runtime.stage_cost_cache: the same option cache, the same ``cache=False``).

A value of ``nbytes`` is offloaded to the tier and waited for (hierremat.runtime.second_tier:
``wait_offloaded``), then fetched back: the median seconds of each, over a few rounds after a warm-up,
give the bytes per second each way (plans.costs.TierBandwidth). A disk tier is measured durable (each
write synced and dropped from the page cache, so the read comes from the disk): the disk's speed, which
a run that offloads more than the page cache holds gets, not the cache's. The disk tier's entry is keyed
by the mount point and type of the file system its directory is on, the host memory tier's by the device.
"""

from __future__ import annotations

import logging
import os
import statistics
import time

import torch

from ..plans.costs import TierBandwidth
from ..store.cache import CacheKey, OptionsCache
from .second_tier import DiskTier, SecondTier
from .stage_cost_cache import STAGE_COST_VERSION, device_name

log = logging.getLogger(__name__)

#: Bytes of the value timed (large enough that a copy's fixed costs are a small share).
MEASURED_BYTES = 32 * 2**20


def measure_bandwidth(tier: SecondTier, device: torch.device | str, nbytes: int = MEASURED_BYTES,
                      rounds: int = 3) -> TierBandwidth:
    """The tier's bandwidths each way, timed with a value of ``nbytes`` on ``device`` (module docstring)."""
    device = torch.device(device)
    if nbytes <= 0:
        raise ValueError(f"measure_bandwidth: nbytes={nbytes}, a positive size is needed")
    value = torch.ones(nbytes, dtype=torch.uint8, device=device)
    out, back = [], []
    durable = getattr(tier, "durable", None)
    if durable is not None:
        tier.durable = True
    try:
        for r in range(rounds + 1):  # (the first round warms up: files made, the pool allocated)
            _sync(device)
            started = time.perf_counter()
            tier.offload(("bandwidth", r), value)
            tier.wait_offloaded(("bandwidth", r))
            _sync(device)  # (on CUDA the wait is the compute stream's: the host waits for it here)
            offloaded = time.perf_counter()
            fetched = tier.fetch(("bandwidth", r))
            _sync(device)
            done = time.perf_counter()
            if r:
                out.append(offloaded - started)
                back.append(done - offloaded)
            del fetched
    finally:
        if durable is not None:
            tier.durable = durable
    return TierBandwidth(tier.kind, nbytes / statistics.median(out), nbytes / statistics.median(back))


def cached_bandwidth(tier: SecondTier, device: torch.device | str, cache: OptionsCache | None) -> TierBandwidth:
    """The tier's bandwidths from the cache, else measured (and cached)."""
    device = torch.device(device)
    key = CacheKey(
        signature=f"tier-bandwidth:{tier.kind}:{_place(tier)}",
        device_type=device.type,
        device_name=device_name(device),
        dtype="bytes",
        cost_model_version=f"{STAGE_COST_VERSION}/torch-{torch.__version__}",
        formulation_version="tier-bandwidth",
    )
    enabled = cache is not None and cache.enabled
    payload = cache.get(key) if enabled else None
    if payload is not None:
        try:
            return TierBandwidth.from_dict(payload)
        except (KeyError, TypeError, ValueError) as err:
            log.warning("cached %s bandwidth is unreadable (%s); measuring again", tier.kind, err)
    bandwidth = measure_bandwidth(tier, device, max(1, min(MEASURED_BYTES, tier.limit_bytes // 2)))
    log.info("%s tier: %.0f MB/s out, %.0f MB/s back", tier.kind, bandwidth.offload_bytes_per_second / 1e6,
             bandwidth.fetch_bytes_per_second / 1e6)
    if enabled:
        cache.put(key, bandwidth.to_dict())
    return bandwidth


def _place(tier: SecondTier) -> str:
    """Where the tier's values go: the file system of a disk tier's directory, else the tier's device."""
    if isinstance(tier, DiskTier):
        mount, kind = tier.file_system
        return f"{kind}:{mount}" if mount else f"dev{os.stat(tier.directory).st_dev}"
    return str(getattr(tier, "device", ""))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
