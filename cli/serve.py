"""`adaspec serve [CONFIG]`: check a Serve config (cli/serve_config.py), then replace this
process with `serve run CONFIG`, in the environment Ray should start in (serve_app/ray_env.py:
its workers at the node's normal priority)."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="check a Serve config and run it with `serve run`")
    p.add_argument("config", nargs="?", default="configs/app.yaml", help="Ray Serve config file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cli.serve_config import check_serve_config

    from serve_app.ray_env import with_ray_env

    check_serve_config(args.config)  # fail fast, naming the field; `serve run` would retry
    serve = os.path.join(os.path.dirname(sys.executable), "serve")
    os.execve(serve, [serve, "run", args.config], with_ray_env(os.environ))
