"""Per-block integer programs (block options) and their on-disk cache; never imports torch."""
