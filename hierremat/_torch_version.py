"""The torch releases hierremat supports, checked when it is imported (from torch's package metadata: the
planning core does not import torch)."""

from __future__ import annotations

import importlib.metadata
import re

#: The oldest supported and the first unsupported (major, minor) release. pyproject.toml declares the same range;
#: ``make test`` tests the pinned release, ``make test-compat`` the oldest and the newest.
SUPPORTED_TORCH = ((2, 11), (2, 16))


def supported_range() -> str:
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_TORCH
    return f"torch>={low_major}.{low_minor},<{high_major}.{high_minor}"


def check_torch_version() -> None:
    """Raise ImportError naming the supported range where the installed torch is outside it (no torch: the
    torch-free planning core works without it)."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        return
    release = (int(found.group(1)), int(found.group(2)))
    low, high = SUPPORTED_TORCH
    if not low <= release < high:
        raise ImportError(f"hierremat supports {supported_range()}; this environment has torch {version}: "
                          f"pip install '{supported_range()}'")
