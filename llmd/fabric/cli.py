"""`llmd fabric preflight|plan`: check a cluster's links with NIXL, or show what each node of a pool would run.

`llmd fabric preflight` runs one task per node like the engine bootstrap (`srun --ntasks-per-node=1 llmd fabric
preflight --run-dir DIR`, or `mpiexec -n N`); `llmd fabric plan` is pure and runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from llmd.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    fabric = subparsers.add_parser(
        "fabric", help="check the links between nodes; show the per-node engine plan", description=__doc__
    )
    fsub = fabric.add_subparsers(dest="fabric_command", metavar="ACTION")
    fsub.required = True
    p = fsub.add_parser(
        "preflight",
        help="measure NIXL bandwidth between every ordered pair of nodes (one task per node) into HDF5",
        description="Measure NIXL (UCX) WRITE bandwidth between every ordered pair of tasks, one pair at a time; "
        "rank 0 writes the matrix to RUN_DIR/fabric-<label>.h5 and prints it. Exit 3 if a link is below --min-gbps.",
    )
    p.add_argument("--run-dir", required=True, help="folder on storage every node can read")
    p.add_argument("--label", default="preflight", help="names the HDF5 group and file (default: preflight)")
    p.add_argument("--mib", type=int, default=64, help="MiB per transfer (default 64)")
    p.add_argument("--iterations", type=int, default=5, help="timed transfers per link (default 5)")
    p.add_argument("--min-gbps", type=float, default=0.0, help="fail below this many GB/s (default 0: never)")
    p.set_defaults(func=run_preflight_cli)
    q = fsub.add_parser(
        "plan",
        help="print what each node of a pool runs (replica, DP ranks, ports, command line) as JSON",
        description="Print the per-node plan `python -m llmd.fabric` would follow, for nodes named on the command "
        "line (default: node0, node1, ... as many as the pool has).",
    )
    q.add_argument("--spec", required=True, help="deployment spec YAML")
    q.add_argument("--role", required=True, choices=("prefill", "decode"))
    q.add_argument("--nodes", help="comma-separated node names (or a Slurm hostlist if scontrol is installed)")
    q.add_argument("--launch-mode", choices=("head-headless", "per-rank"), default="head-headless")
    q.set_defaults(func=run_plan_cli)


def _check_label(label: str) -> str:
    if not label or not all(c.isalnum() or c in "-_" for c in label):
        raise UserError(f"--label {label!r}: use letters, digits, '-' and '_'")
    return label


def run_preflight_cli(args: argparse.Namespace) -> int:
    from llmd.fabric.bootstrap import FabricError
    from llmd.fabric.comm import open_comm
    from llmd.fabric.nodes import local_node_name

    label = _check_label(args.label)
    if args.mib < 1 or args.iterations < 1:
        raise UserError("--mib and --iterations must be >= 1")
    try:
        from llmd.fabric.preflight import run_preflight, slow_links
    except ImportError as exc:
        raise UserError(f"the preflight needs nixl ({exc}); pip install 'llmd[fabric]'") from exc
    from llmd.fabric.record import write_matrix

    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    comm = open_comm(run_dir, label)
    result = run_preflight(comm, args.mib << 20, args.iterations, label, local_node_name(dict(os.environ)))
    problems = list(result.errors)
    if args.min_gbps > 0:
        problems += slow_links(result.gbps, args.min_gbps, result.hostnames, label)
    if comm.rank == 0:
        path = write_matrix(run_dir, result, min_gbps=args.min_gbps)
        print(f"{result.size} ranks, {args.mib} MiB x {args.iterations}, GB/s (row: from, column: to); {path}")
        for i, row in enumerate(result.gbps):
            cells = " ".join("      -" if math.isnan(v) or i == j else f"{v:7.2f}" for j, v in enumerate(row))
            print(f"  {i:3d} {result.hostnames[i][:20]:20s} {cells}")
        if problems:
            raise FabricError("fabric preflight failed:\n  " + "\n  ".join(problems))
    elif problems:
        raise FabricError(f"fabric preflight failed: {problems[0]}")
    return 0


def run_plan_cli(args: argparse.Namespace) -> int:
    from llmd.fabric.bootstrap import load_spec_checked, plan_doc
    from llmd.fabric.nodes import expand_hostlist
    from llmd.fabric.plan import plan_nodes

    spec = load_spec_checked(args.spec)
    pool = spec.prefill if args.role == "prefill" else spec.decode
    if args.nodes:
        nodes = args.nodes.split(",") if "[" not in args.nodes else expand_hostlist(args.nodes)
        if nodes is None:
            raise UserError(f"--nodes {args.nodes!r} is a Slurm hostlist but scontrol is not installed; list names")
    else:
        nodes = [f"node{k}" for k in range(pool.nodes)]
    plans = plan_nodes(spec, args.role, nodes, spec_path=str(Path(args.spec).resolve()), mode=args.launch_mode)
    json.dump({"role": args.role, "nodes": plan_doc(plans)}, sys.stdout, indent=1)
    print()
    return 0
