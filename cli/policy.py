"""`adaspec policy set|show`: push a policy table to every replica (or one), or show the
policy in force on each."""

from __future__ import annotations

import argparse
import json

from adaspec.policy import SpecPolicy
from cli.arguments import add_model, add_url
from serve_app import admin_client


def add_parser(sub: argparse._SubParsersAction) -> None:
    policy = sub.add_parser("policy", help="show or set the speculation policy").add_subparsers(
        dest="policy_command", required=True)
    p = policy.add_parser("set", help="push a policy table to every replica")
    add_url(p)
    p.add_argument("--table", required=True, help='e.g. "1-2:chain4,3-8:chain2,9+:off" or "off"')
    p.add_argument("--version", type=int, default=None, help="policy version (default: now in ms)")
    p.add_argument("--replica", default=None, help="one replica only, by id (`adaspec status` lists them)")
    add_model(p)
    p.set_defaults(func=run)
    p = policy.add_parser("show", help="the policy in force on every replica")
    add_url(p)
    add_model(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return {"set": _set, "show": _show}[args.policy_command](args)


def _set(args: argparse.Namespace) -> int:
    SpecPolicy.parse(args.table)  # fail here, naming the problem, before any request
    acks = admin_client.set_policy(args.url, args.table, token=args.token, version=args.version,
                                   replica_id=args.replica, model=args.model)
    if args.json:
        print(json.dumps([a.model_dump(mode="json") for a in acks], indent=2))
    else:
        for a in acks:
            extra = f" ({a.message})" if a.message else ""
            print(f"replica {a.replica_id}: {a.status}; in force v{a.version_in_force}: {a.policy_in_force}{extra}")
    return 0 if all(a.status in ("applied", "not_this_replica") for a in acks) else 1


def _show(args: argparse.Namespace) -> int:
    reports = admin_client.status(args.url, token=args.token, model=args.model)
    rows = {r.replica_id: {"model": r.model_id, "version": r.policy.version, "policy": str(r.policy)}
            for r in reports}
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for rid, row in rows.items():
            print(f"replica {rid} of {row['model']}: v{row['version']} {row['policy']}")
    return 0
