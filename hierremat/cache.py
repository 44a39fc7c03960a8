"""Command line for the block-option cache (a thin wrapper over :class:`OptionsCache`).

    python -m hierremat.cache [--dir DIR] list [--json]   # table of entries (or JSON), their size and the cap
    python -m hierremat.cache [--dir DIR] clear           # delete every entry
    python -m hierremat.cache [--dir DIR] export OUT      # all valid entries -> one JSON bundle
    python -m hierremat.cache [--dir DIR] import IN       # add a bundle's valid entries

The directory defaults to ``$HIERREMAT_CACHE_DIR``, else ``~/.cache/hierremat``.
Exit status: 0 on success, 1 on an error (message on stderr). Never imports torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from .budget import format_bytes
from .store.cache import MAX_BYTES_ENV_VAR, OptionsCache

_COLUMNS = ("digest", "signature", "device", "dtype", "cost model", "formulation", "size", "last used", "status")


def _row(e: dict) -> tuple[str, ...]:
    written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["created"]))
    if not e["valid"]:
        return (e["digest"][:12], "?", "", "", "", "", format_bytes(e["size"]), written, f"INVALID: {e['problem']}")
    sig = e["signature"] if len(e["signature"]) <= 20 else e["signature"][:19] + "…"
    device = f"{e['device_type']}:{e['device_name']}" if e["device_name"] else e["device_type"]
    return (e["digest"][:12], sig, device, e["dtype"], e["cost_model_version"],
            e["formulation_version"], format_bytes(e["size"]), written, "ok")


def _list(cache: OptionsCache, as_json: bool) -> None:
    entries = sorted(cache.entries(), key=lambda e: e["created"])  # least recently used (next evicted) first
    if as_json:
        print(json.dumps(entries, indent=1))
        return
    print(f"cache directory: {cache.directory} (least recently used first)")
    if not entries:
        print("no entries")
        return
    rows = [_COLUMNS] + [_row(e) for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    total = sum(e["size"] for e in entries)
    bad = sum(not e["valid"] for e in entries)
    print(f"{len(entries)} entries, {format_bytes(total)} of a {format_bytes(cache.max_bytes)} cap (least recently used "
          f"removed beyond it; ${MAX_BYTES_ENV_VAR} sets it)" + (f", {bad} invalid" if bad else ""))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", default=argparse.SUPPRESS,
                        help="cache directory (default: $HIERREMAT_CACHE_DIR or ~/.cache/hierremat)")
    parser = argparse.ArgumentParser(prog="python -m hierremat.cache", parents=[common],
                                     description="Inspect and move hierremat's block-option cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", parents=[common], help="show the entries")
    p.add_argument("--json", action="store_true", help="print the entries as JSON")
    sub.add_parser("clear", parents=[common], help="delete every entry")
    sub.add_parser("export", parents=[common], help="write all valid entries to a JSON bundle").add_argument("out")
    sub.add_parser("import", parents=[common], help="add the valid entries of a bundle").add_argument("input")
    args = parser.parse_args(argv)

    cache = OptionsCache(getattr(args, "dir", None))
    try:
        if args.command == "list":
            _list(cache, args.json)
        elif args.command == "clear":
            print(f"removed {cache.clear()} entries from {cache.directory}")
        elif args.command == "export":
            print(f"exported {cache.export(args.out)} entries from {cache.directory} to {args.out}")
        else:
            print(f"imported {cache.import_(args.input)} entries from {args.input} into {cache.directory}")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
