"""The `llmd` command line: one entry point, one subcommand per area (spec, demo, bench, engine, launch, ...).

Each area registers its own subparser through a `register(subparsers)` function, so adding a command is one import
here and a small module next to the code it drives. This is the one module under llmd/ that may import the control
plane (launchers/, sweeps/): the command line is the outermost edge, and the jobs launchers submit start the runtime
through it (`python -m llmd.cli router ...`), so it must stay here rather than move out of the package.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from llmd import __version__
from llmd.errors import UserError

Registrar = Callable[[argparse._SubParsersAction], None]


def _registrars() -> list[Registrar]:
    # Imported lazily so `llmd --help` stays fast and a missing optional dependency breaks only its own command.
    # The control plane's commands are imported here only, never by the runtime (tests/test_layering.py); so is
    # analysis/, which reads what runs leave on disk.
    from analysis import cli as analyze_cli
    from launchers import cli as launch_cli
    from llmd import demo
    from llmd.engines.sim import cli as sim_cli
    from llmd.fabric import cli as fabric_cli
    from llmd.models import cli as model_cli
    from llmd.report import cli as report_cli
    from llmd.router import cli as router_cli
    from llmd.sim import cli as simulate_cli
    from llmd.spec import cli as spec_cli
    from llmd.workload import bench_cli
    from sweeps import cli as sweep_cli

    return [
        spec_cli.register,
        model_cli.register,
        sim_cli.register,
        router_cli.register,
        demo.register,
        simulate_cli.register,
        bench_cli.register,
        report_cli.register,
        analyze_cli.register,
        launch_cli.register,
        sweep_cli.register,
        fabric_cli.register,
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmd", description="Serve LLMs for agentic workloads on Slurm, the llm-d way."
    )
    parser.add_argument("--version", action="version", version=f"llmd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for register in _registrars():
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        # A user mistake gets one clear message, never a traceback.
        print(f"llmd: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("llmd: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
