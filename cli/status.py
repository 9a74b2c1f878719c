"""`adaspec status`: per replica the policy, batch sizes, acceptance and step time, and the
controller's view (rate, chosen policy, predicted vs measured step time); `--watch S`
refreshes every S seconds."""

from __future__ import annotations

import argparse
import json
import time

from cli.arguments import add_model, add_url
from serve_app import admin_client


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="per-replica policy, acceptance and step time")
    add_url(p)
    p.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="refresh every SECONDS")
    add_model(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    while True:
        reports = admin_client.status(args.url, token=args.token, model=args.model)
        view = admin_client.controller_view(args.url, token=args.token, model=args.model)
        if args.json:
            print(json.dumps({"replicas": [r.model_dump(mode="json") for r in reports],
                              "controller": view.model_dump(mode="json") if view else None}, indent=2))
        else:
            if args.watch:
                print("\033[2J\033[H" + time.strftime("%H:%M:%S"), end="\n")
            print(admin_client.format_status(reports))
            print(admin_client.format_controller(view))
        if not args.watch:
            return 0
        time.sleep(args.watch)
