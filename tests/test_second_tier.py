"""The second tier of storage for offloaded values: one interface, a disk tier
(CPU: files, the process's RAM freed) and a host memory tier (a pool reused across steps; pinned,
with side-stream copies, on CUDA), and their bandwidths measured and cached.

Checked on CPU: values come back bitwise (every dtype, shapes without elements, non-contiguous
values), in any order, prefetched or not; the disk tier frees the RAM a value held once written and
its files hold exactly the bytes offloaded; its directory is removed on close, on error and at exit;
a directory that cannot be written or lacks room is refused when the tier is made; a short read or a
failed write raises instead of handing back a partial value; the limit holds.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hierremat.device import LiveTensorTracker
from hierremat.runtime import second_tier, tier_bandwidth
from hierremat.plans.costs import TierBandwidth
from hierremat.runtime.second_tier import DiskTier, HostMemoryTier, OffloadError
from hierremat.store.cache import OptionsCache

MIB = 2**20


def _values():
    generator = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(64, 33, generator=generator),
        "bf16": torch.randn(17, 5, generator=generator).to(torch.bfloat16),
        "int64": torch.randint(-9, 9, (7, 3), generator=generator),
        "bool": torch.rand(13, generator=generator) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(8, 6, generator=generator).t(),
        "channels_last": torch.randn(2, 3, 4, 5, generator=generator).to(memory_format=torch.channels_last),
        "sliced": torch.randn(6, 8, generator=generator)[1:4, ::2],
        "conjugate": torch.randn(5, dtype=torch.complex64, generator=generator).conj(),
    }


def _tiers(tmp_path):
    return [DiskTier(64 * MIB, tmp_path), HostMemoryTier(64 * MIB, "cpu")]


@pytest.mark.parametrize("kind", ["disk", "host"])
def test_values_come_back_bitwise_in_any_order_prefetched_or_not(kind, tmp_path):
    tier = _tiers(tmp_path)[0 if kind == "disk" else 1]
    with tier:
        for step in range(2):  # (the host tier's pool is reused by the second step)
            values = _values()
            for name, value in values.items():
                tier.offload(name, value)
            names = list(values)
            for name in names[::2]:
                tier.prefetch(name)
            for name in reversed(names):
                back = tier.fetch(name)
                assert back.dtype == values[name].dtype and back.shape == values[name].shape
                assert torch.equal(back, values[name]), (step, name)
                if name in ("channels_last", "transposed"):  # a dense layout comes back as it went
                    assert back.stride() == values[name].stride(), name
            assert tier.held_bytes == 0 and not any(name in tier for name in names)
        assert tier.peak_bytes == sum(v.numel() * v.element_size() for v in values.values())
        with pytest.raises(OffloadError, match="only dense tensors"):
            tier.offload("sparse", torch.eye(3).to_sparse())
        assert tier.held_bytes == 0 and "sparse" not in tier


def test_the_disk_tier_frees_the_memory_a_value_held_once_written(tmp_path):
    value = torch.randn(1024, 1024)
    expected = value.clone()
    with DiskTier(64 * MIB, tmp_path) as tier, LiveTensorTracker() as tracker:
        held = value * 1  # a value made while tracked: its memory is counted, then freed
        del value
        live = tracker.live_bytes
        tier.offload("x", held)
        tier.wait_offloaded("x")
        del held
        assert tracker.live_bytes == live - 4 * MIB
        assert tier.file_bytes == 4 * MIB == tier.held_bytes
        tier.prefetch("x")
        back = tier.fetch("x")
        assert torch.equal(back, expected) and tier.file_bytes == 0


def test_the_disk_tier_removes_its_directory_on_close_on_error_and_at_exit(tmp_path):
    tier = DiskTier(MIB, tmp_path)
    tier.offload("x", torch.ones(100))
    tier.wait_offloaded("x")
    directory = tier.directory
    assert directory.parent == tmp_path and tier.file_bytes == 400
    assert list(directory.iterdir()) == []  # (its files are unlinked when opened: a killed process leaves no data)
    tier.close()
    assert not directory.exists()
    with pytest.raises(OffloadError, match="closed"):
        tier.offload("y", torch.ones(1))

    with pytest.raises(RuntimeError, match="the step failed"):
        with DiskTier(MIB, tmp_path) as tier:
            tier.offload("x", torch.ones(100))
            directory = tier.directory
            raise RuntimeError("the step failed")
    assert not directory.exists()

    script = textwrap.dedent(f"""
        import torch
        from hierremat.runtime.second_tier import DiskTier
        tier = DiskTier(2**20, {str(tmp_path)!r})
        tier.offload("x", torch.ones(100))
        tier.wait_offloaded("x")
        print(tier.directory)
    """)  # exits without closing the tier
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    left = run.stdout.strip()
    assert left.startswith(str(tmp_path)) and not os.path.exists(left)
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_cannot_hold_the_tier_is_refused_before_training(tmp_path):
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")
    with pytest.raises(OffloadError, match="offload=.*cannot make a directory"):
        DiskTier(MIB, not_a_directory / "offload")
    with pytest.raises(OffloadError, match="bytes free there, less than offload_limit"):
        DiskTier(2**62, tmp_path)
    assert list(tmp_path.iterdir()) == [not_a_directory]  # nothing left behind
    with pytest.raises(ValueError, match="offload_limit"):
        HostMemoryTier(0, "cpu")


def test_a_short_read_or_a_failed_write_raises_instead_of_handing_back_part_of_a_value(tmp_path, monkeypatch):
    with DiskTier(MIB, tmp_path) as tier:
        tier.offload("x", torch.arange(1000.0))
        tier.wait_offloaded("x")
        os.ftruncate(tier._descriptors["x"], 1000)
        with pytest.raises(OffloadError, match="gave 1000 of 4000 bytes"):
            tier.fetch("x")
        assert tier.held_bytes == 0 and tier.file_bytes == 0

        def no_space(*args):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(second_tier.os, "pwrite", no_space)
        tier.offload("y", torch.arange(10.0))
        with pytest.raises(OffloadError, match="No space left on device"):
            tier.wait_offloaded("y")
        monkeypatch.undo()
        with pytest.raises(OffloadError, match="No space left on device"):
            tier.fetch("y")
        assert tier.held_bytes == 0 and tier.file_bytes == 0


def test_the_limit_holds(tmp_path):
    for tier in _tiers(tmp_path):
        with tier:
            tier.limit_bytes = 1000
            tier.offload("a", torch.ones(200))  # 800 bytes
            with pytest.raises(OffloadError, match="offload_limit"):
                tier.offload("b", torch.ones(100))
            with pytest.raises(KeyError):
                tier.offload("a", torch.ones(1))
            assert torch.equal(tier.fetch("a"), torch.ones(200))


def test_the_host_tier_reuses_one_pool_across_steps_and_within_one():
    quarter = torch.ones(MIB // 16)  # 256 KiB
    with HostMemoryTier(MIB, "cpu") as tier:
        for step in range(3):  # 768 KiB a step in a 1 MiB pool: only if each step starts at its bottom
            tier.offload("a", torch.ones(3, dtype=torch.bfloat16))
            tier.offload("b", quarter)
            assert tier._slots["a"][0] == 0 and tier._slots["b"][0] == 64  # (aligned for any dtype's view)
            tier.offload("c", quarter)
            top = tier._slots["c"]
            tier.fetch("c")  # the top slot: the next offload takes its place
            tier.offload("d", quarter * 2)  # (as large as c, other values)
            assert tier._slots["d"] == top
            tier.offload("e", quarter)
            assert [torch.equal(tier.fetch(k), v) for k, v in (("e", quarter), ("d", quarter * 2), ("b", quarter))] == [True] * 3
            assert torch.equal(tier.fetch("a"), torch.ones(3, dtype=torch.bfloat16))
        tier.offload("a", quarter)
        tier.offload("b", quarter)
        tier.offload("c", quarter)
        tier.fetch("a")  # not the top: its room comes back once the slots above it are fetched
        with pytest.raises(OffloadError, match="no room"):
            tier.offload("d", torch.ones(MIB // 8))  # 512 KiB: within the limit, not above the top slot
        assert "d" not in tier and tier.held_bytes == MIB // 2


def test_bandwidths_are_measured_then_cached(tmp_path, monkeypatch):
    cache = OptionsCache(tmp_path / "cache")
    with DiskTier(64 * MIB, tmp_path / "offload") as tier:
        measured = tier_bandwidth.cached_bandwidth(tier, "cpu", cache)
        assert measured.kind == "disk" and measured.offload_bytes_per_second > 0 and measured.fetch_bytes_per_second > 0
        assert tier.held_bytes == 0 and tier.file_bytes == 0

        def not_again(*args, **kwargs):
            raise AssertionError("measured again")

        monkeypatch.setattr(tier_bandwidth, "measure_bandwidth", not_again)
        assert tier_bandwidth.cached_bandwidth(tier, "cpu", cache) == measured
        assert tier.durable is False  # (measured durable: the disk's speed, not the page cache's)
    with pytest.raises(ValueError, match="positive finite"):
        TierBandwidth("disk", 0.0, 1.0)
