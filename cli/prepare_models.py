"""`adaspec prepare-models`: install and convert the embedded models (prepare/models.py);
idempotent, so the installer runs it every time."""

from __future__ import annotations

import argparse
import json
import time

from adaspec.models import BUNDLED_DRAFTS, EMBEDDED_MODELS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare-models", help="install and convert the embedded models")
    p.add_argument("names", nargs="*", help=f"models to prepare (default all: {sorted(EMBEDDED_MODELS) + sorted(BUNDLED_DRAFTS)})")
    p.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prepare.models import prepare_model

    names = args.names or sorted(EMBEDDED_MODELS) + sorted(BUNDLED_DRAFTS)
    results = {}
    for name in names:
        start = time.perf_counter()
        folder = prepare_model(name, force=args.force)
        results[name] = {"folder": str(folder), "seconds": round(time.perf_counter() - start, 1)}
        if not args.json:
            print(f"{name}: {folder} ({results[name]['seconds']} s)")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0
