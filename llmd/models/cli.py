"""`llmd model make-tiny DIR`: the tiny random-weight model folder for tests, demos and vLLM's CPU build."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmd.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="make or inspect model folders")
    msub = model.add_subparsers(dest="model_command", metavar="ACTION")
    msub.required = True
    tiny = msub.add_parser(
        "make-tiny", help="write a tiny random-weight Llama (or Qwen3-MoE) model with a local tokenizer (offline)"
    )
    tiny.add_argument("dir", type=Path, help="folder to create (must be empty or absent)")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    tiny.add_argument("--no-weights", action="store_true", help="tokenizer and config only (enough for sim engines)")
    tiny.add_argument("--moe", action="store_true", help="a tiny Qwen3-MoE (8 experts, top-2) instead of a dense Llama")
    tiny.add_argument("--force", action="store_true", help="overwrite an existing model folder")
    tiny.set_defaults(func=_make_tiny)


def _make_tiny(args: argparse.Namespace) -> int:
    from llmd.models.tiny import make_tiny

    out: Path = args.dir
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a folder; pick another path")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise UserError(f"{out} is not empty; pass --force to overwrite the model in it, or pick an empty folder")
    make_tiny(out, seed=args.seed, weights=not args.no_weights, moe=args.moe)
    print(f"wrote tiny {'MoE ' if args.moe else ''}model to {out}")
    return 0
