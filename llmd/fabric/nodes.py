"""Where this component's nodes are: their order from Slurm (`scontrol show hostnames`) or from the ranks, and the
address each node's engines bind and advertise. Slurm variables are hints, used only when they agree with what the
ranks themselves report.
"""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence

ADDRESS_ENV = "LLMD_NODE_ADDRESS"
_HET_LIST_RE = re.compile(r"^SLURM_JOB_NODELIST_HET_GROUP_(\d+)$")

Expander = Callable[[str], "list[str] | None"]


def _scontrol(args: Sequence[str], timeout_s: float = 20.0) -> str | None:
    try:
        out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def expand_hostlist(hostlist: str) -> list[str] | None:
    """`node[1-3],gpu7` -> names, by `scontrol show hostnames` (Slurm's own parser); None without scontrol."""
    out = _scontrol(["show", "hostnames", hostlist])
    return out.split() if out else None


def local_node_name(env: Mapping[str, str]) -> str:
    # Emulated Slurm nodes share one hostname; SLURMD_NODENAME tells them apart.
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def slurm_node_order(env: Mapping[str, str], expand: Expander = expand_hostlist) -> list[str] | None:
    """This component's nodes in Slurm's order: the step's node list, else the het-job component's list holding this
    node (SLURM_JOB_NODELIST_HET_GROUP_<k>; 22.05 sets no SLURM_HET_GROUP in tasks), else the job's."""
    if env.get("SLURM_STEP_NODELIST"):
        return expand(env["SLURM_STEP_NODELIST"])
    me = env.get("SLURMD_NODENAME")
    groups = sorted((int(m.group(1)), v) for k, v in env.items() if (m := _HET_LIST_RE.match(k)))
    if env.get("SLURM_HET_GROUP", "").isdigit():
        groups = [(g, v) for g, v in groups if g == int(env["SLURM_HET_GROUP"])] or groups
    for _, hostlist in groups:
        names = expand(hostlist)
        if names and (me in names or len(groups) == 1):
            return names
    hostlist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    return expand(hostlist) if hostlist else None


def order_nodes(gathered: Sequence[str], slurm_order: Sequence[str] | None) -> list[int]:
    """node index of each rank: its position in Slurm's list when the ranks are exactly Slurm's nodes, one each;
    else the rank itself (mpiexec, or names that disagree with Slurm's)."""
    if slurm_order is not None and len(set(gathered)) == len(gathered) and sorted(gathered) == sorted(slurm_order):
        return [list(slurm_order).index(name) for name in gathered]
    return list(range(len(gathered)))


def local_address(env: Mapping[str, str], single_host: bool) -> str:
    """The address this node's engines listen on and advertise.

    LLMD_NODE_ADDRESS (or LLMD_ENGINE_HOST) wins; under Slurm the node's NodeAddr (emulated nodes all say
    127.0.0.1); when every rank runs on this one host 127.0.0.1; else the address the hostname resolves to.
    """
    for name in (ADDRESS_ENV, "LLMD_ENGINE_HOST"):  # the second is what launchers' basic starter reads
        if env.get(name):
            return env[name]
    name = env.get("SLURMD_NODENAME")
    if name:
        match = re.search(r"\bNodeAddr=(\S+)", _scontrol(["show", "node", name]) or "")
        if match:
            try:
                return socket.gethostbyname(match.group(1))
            except OSError:
                return match.group(1)
    if single_host:
        return "127.0.0.1"
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
