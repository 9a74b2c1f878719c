"""`adaspec controller show|pause|resume`: the adaptive controller's view, or pause / resume
its policy pushes."""

from __future__ import annotations

import argparse
import json

from cli.arguments import add_url
from serve_app import admin_client


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("controller", help="show, pause or resume the adaptive controller")
    p.add_argument("action", choices=["show", "pause", "resume"],
                   help="show the controller's view, or pause / resume its policy pushes")
    add_url(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "show":
        view = admin_client.controller_view(args.url, token=args.token)
    else:
        view = admin_client.controller_action(args.url, args.action, token=args.token)
    if args.json:
        print(json.dumps(view.model_dump(mode="json") if view else None, indent=2))
    else:
        print(admin_client.format_controller(view))
    return 0
