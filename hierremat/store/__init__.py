"""The on-disk store: block-option menus and stage costs as checksummed JSON files, keyed by
signature, device, dtype and versions (cache); never imports torch, never pickles."""
