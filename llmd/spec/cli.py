"""`llmd spec check FILE...` and `llmd spec show [FILE]`: validate deployment specs and print them resolved."""

from __future__ import annotations

import argparse
import sys

from llmd.spec.checks import SpecError
from llmd.spec.load import dump_spec, load_spec
from llmd.spec.model import DeploymentSpec


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("spec", help="check and show deployment specs", description=__doc__)
    sub = parser.add_subparsers(dest="spec_command", metavar="SUBCOMMAND")
    sub.required = True

    check = sub.add_parser("check", help="validate spec files and list every problem in each")
    check.add_argument("files", nargs="+", metavar="FILE", help="spec YAML files")
    check.set_defaults(func=cmd_check)

    show = sub.add_parser("show", help="print a spec resolved, every default filled in (no FILE: the defaults)")
    show.add_argument("file", nargs="?", metavar="FILE", help="spec YAML file")
    show.set_defaults(func=cmd_show)


def cmd_check(args: argparse.Namespace) -> int:
    failed = False
    for path in args.files:
        try:
            spec = load_spec(path)
        except SpecError as exc:
            failed = True
            print(exc)
        else:
            print(f"{path}: ok ({spec.summary()})")
    return 1 if failed else 0


def cmd_show(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.file) if args.file else DeploymentSpec()
    except SpecError as exc:
        print(exc, file=sys.stderr)
        return 1
    sys.stdout.write(dump_spec(spec))
    return 0
