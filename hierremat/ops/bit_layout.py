"""The layout of a packed mask, shared by every kernel of the packed-mask operators: element i
of a boolean mask (logical, row-major order) is bit ``i % 8`` of byte ``i // 8``."""


def packed_size(numel: int) -> int:
    """Bytes of the packed mask of ``numel`` elements."""
    return (numel + 7) // 8
