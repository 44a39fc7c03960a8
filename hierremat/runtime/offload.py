"""The second tier a model or chain offloads to, from the ``offload=`` and ``offload_limit=`` arguments.

``offload=True`` gives host memory on CUDA (hierremat.runtime.second_tier.HostMemoryTier: a pinned pool)
and a temporary directory on CPU (DiskTier: the process's RAM is freed); a directory path gives a disk
tier there on either. ``offload_limit`` (bytes or "8GiB") caps what the tier holds at once; by default
half of the host's available memory (host memory tier) or of the directory's free space (disk tier).

:func:`second_tier` makes the tier when planning starts, so that a directory that cannot be written or a
limit larger than its free space is an error before training (OffloadError), and measures its bandwidths
(cached: hierremat.runtime.tier_bandwidth). A host pool is made small for that measurement and grown to
what the plans hold when they are bound to a model (pinning can fail there, before the first step).
On a CUDA device a disk tier copies each value to the host synchronously before writing it: only the
write and the read-ahead overlap the compute. Calls with the
same arguments share one tier per planner session (hierremat.session: a model's shapes, the chains of
``checkpoint_sequential``); its files and directory go when the session closes, at the latest when the
process exits. A plan's tier peak is checked against the limit by
the planner (hierremat.planning.chain_plan), which then plans without offloading where it is over.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import torch

from ..budget import format_bytes, parse_budget
from ..errors import OffloadError
from ..plans.costs import TierBandwidth
from ..plans.transfers import TransferPlan
from ..session import current_session
from ..store.cache import OptionsCache
from .second_tier import POOL_ALIGNMENT, DiskTier, HostMemoryTier, SecondTier
from .tier_bandwidth import cached_bandwidth

log = logging.getLogger(__name__)


def check_offload(offload, offload_limit) -> None:
    """Raise naming the argument where ``offload`` or ``offload_limit`` is not one hierremat takes."""
    if not isinstance(offload, (bool, str, os.PathLike)):
        raise TypeError(f"offload must be False, True or a directory path, got {type(offload).__name__}")
    if isinstance(offload, (str, os.PathLike)) and not os.fspath(offload):
        raise ValueError("offload='' names no directory: give a directory path, or offload=True for the default")
    if offload_limit is not None:
        if offload is False:
            raise ValueError("offload_limit is given but offload=False: pass offload=True (or a directory) too")
        parse_budget(offload_limit, name="offload_limit")


def available_host_bytes() -> int:
    """Bytes of host memory available to new allocations (MemAvailable in /proc/meminfo; free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Offloading:
    """A second tier for plans: its kind, limit and measured bandwidths, and the tier object runs use.

    ``tier_for(transfers)`` gives the tier a step of a plan (its hierremat.plans.transfers.TransferPlan) runs
    with: the disk tier itself, or a host memory tier whose pool holds that plan's values (replaced by a larger
    one when a later plan needs more, never above the limit: one pool, reused across steps).
    """

    def __init__(self, offload, offload_limit, device: torch.device, cache: OptionsCache | None):
        self.device = torch.device(device)
        disk = not isinstance(offload, bool) or self.device.type != "cuda"
        if disk:
            directory = tempfile.gettempdir() if offload is True else os.fspath(offload)
            limit = _limit(offload_limit, lambda: shutil.disk_usage(_existing_parent(directory)).free // 2)
            self._tier: SecondTier = DiskTier(limit, directory, self.device)
        else:
            limit = _limit(offload_limit, lambda: available_host_bytes() // 2)
            self._tier = HostMemoryTier(min(limit, 2 * POOL_ALIGNMENT + 2**26), self.device)
        self.limit_bytes = limit
        self.bandwidth: TierBandwidth = cached_bandwidth(self._tier, self.device, cache)
        log.info("second tier: %s", self.describe())

    @property
    def kind(self) -> str:
        return self._tier.kind

    def describe(self) -> str:
        where = f" in {self._tier.directory}" if isinstance(self._tier, DiskTier) else f" for {self.device}"
        b = self.bandwidth
        return (f"{self.kind}{where}, limit {format_bytes(self.limit_bytes)}, "
                f"{b.offload_bytes_per_second / 1e6:.0f} MB/s out, {b.fetch_bytes_per_second / 1e6:.0f} MB/s back")

    def needed_bytes(self, transfers: TransferPlan, kept_values: int = 0) -> int:
        """What a plan's values take in the tier at once: their bytes, in a host pool each slot aligned;
        ``kept_values``: at most how many storages its kept values' offloads send (one slot each)."""
        if isinstance(self._tier, HostMemoryTier):
            return transfers.tier_peak_bytes + POOL_ALIGNMENT * (len(transfers.offloaded) + kept_values)
        return transfers.tier_peak_bytes

    def check(self, transfers: TransferPlan, kept_values: int = 0) -> None:
        """Raise OffloadError, before a plan runs, where it would hold more than ``offload_limit`` at once."""
        needed = self.needed_bytes(transfers, kept_values)
        if needed > self.limit_bytes:
            raise OffloadError(
                f"the plan holds {format_bytes(needed)} in the {self.kind} tier at once, over offload_limit="
                f"{format_bytes(self.limit_bytes)}: raise offload_limit, or plan again with this limit"
            )

    def close(self) -> None:
        """Close the tier (its files and pool go; hierremat.runtime.second_tier)."""
        self._tier.close()

    def tier_for(self, transfers: TransferPlan, kept_values: int = 0) -> SecondTier:
        """The tier a step of a plan runs with (asked at each step: a runner never keeps a pool that a later,
        larger plan replaced). A host pool too small for the plan, or for it beside what steps still running
        hold, is replaced by a larger one (the old one lives on while a step holds it)."""
        if isinstance(self._tier, HostMemoryTier):
            needed = self.needed_bytes(transfers, kept_values)
            if self._tier.held_bytes + needed > self._tier.limit_bytes:
                pool = min(max(self._tier.held_bytes + needed, 2 * self._tier.limit_bytes), self.limit_bytes)
                self._tier = HostMemoryTier(max(pool, needed), self.device)
        return self._tier


def _limit(offload_limit, default) -> int:
    return parse_budget(offload_limit, name="offload_limit") if offload_limit is not None else max(1, int(default()))


def _existing_parent(directory: str) -> str:
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def offload_key(offload, offload_limit) -> tuple:
    """``offload`` and ``offload_limit`` as they key a tier or a plan: a directory as its absolute path, the
    limit in bytes (so '8GiB' and its byte count, or two spellings of one directory, are one tier)."""
    where = os.path.abspath(os.fspath(offload)) if not isinstance(offload, bool) else offload
    return where, None if offload_limit is None else parse_budget(offload_limit, name="offload_limit")


def second_tier(offload, offload_limit, device: torch.device | str, cache: OptionsCache | None) -> Offloading | None:
    """The Offloading for these arguments on ``device`` (None for ``offload=False``), made on first use and
    shared by later calls with the same arguments in the planner session, closed with it (module docstring)."""
    check_offload(offload, offload_limit)
    if offload is False:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = ("second tier", *offload_key(offload, offload_limit), str(device))
    return current_session().opened(key, lambda: Offloading(offload, offload_limit, device, cache))
