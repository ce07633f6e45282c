"""A spec's engines as real vLLM servers on this machine: one child process per launch, CPU settings, PodInfo out.

`VllmDeployment(spec, workdir)` takes the very launches a cluster would run (`llmd.engines.vllm.vllm_launches`),
resolves their address placeholders to 127.0.0.1 and adapts them to vLLM's CPU build (platform notes):
`--enforce-eager` (start-up ~40 s instead of ~115 s of torch.compile), a small `--gpu-memory-utilization` (host memory
on CPU; the default 0.9 fails), HF_HUB_OFFLINE=1 and a block size that is a multiple of 32 (CPU attention). Every
server starts at once (start-up is mostly imports, which overlap), is waited for on /health with the log's tail on
failure, and then gets one ordinary warm-up request: a CPU decode server whose first request arrives through a NIXL
KV transfer crashes (`Illegal instruction` in cpu_attention_with_kv_cache), after one plain request it never does.
`stop()` ends every process group, whatever state start-up reached.

Ports: the spec's layout on 127.0.0.1. Each server binds first: a port that is taken when it starts (or every port
with `port: auto`) is given to vLLM as 0 and read back once it is up (llmd.engines.vllm_server), and its PodInfo
carries the ports really bound; a server that exits with EADDRINUSE (a port taken between the check and its bind) is
started again with every port moved, up to START_RETRIES times. The ports vLLM cannot bind as 0 are settled for every
launch together before any starts (`settle_ports`), so no two get the same free one: a DP replica's RPC port, shared by
all its processes (rank 0 binds it, the others dial it; if rank 0 exits with EADDRINUSE and that port is taken, the
whole replica starts again on a free one), and each process's NIXL side-channel base (a head's pod lists the port of
every rank, its headless processes' too).
`with_free_ports(spec)` moves each pool to a base port whose whole band (HTTP, KV events, NIXL side channel, replay,
per-rank HTTP, DP RPC) is free, for runs that share the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from llmd.discovery import PodInfo, with_bound_ports
from llmd.engines.vllm import (
    NODE_ADDRESS,
    SIDE_CHANNEL_ENV,
    EngineLaunch,
    LaunchMode,
    dp_rpc_port_of,
    head_placeholder,
    vllm_launches,
    with_dp_rpc_port,
)
from llmd.engines.vllm_server import (
    EngineStartError,
    address_in_use,
    choose_probed_ports,
    free_run,
    log_tail,
    move_taken_ports,
    port_free,
    rank_side_channel_ports,
    required_kv_sources,
    stop_process_group,
    wait_bound_http,
    wait_healthy,
)
from llmd.errors import UserError
from llmd.spec.layout import (
    DP_RPC_OFFSET,
    KV_EVENTS_OFFSET,
    RANK_HTTP_OFFSET,
    REPLAY_OFFSET,
    SIDE_CHANNEL_OFFSET,
    EngineEndpoint,
    engine_endpoints,
)
from llmd.spec.model import DeploymentSpec

LOCALHOST = "127.0.0.1"
CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention kernels take block sizes in multiples of 32
CPU_MEMORY_FRACTION = 0.25  # of host memory per server; several servers share this machine
# On CPU the fraction above is only checked against free memory at start-up; what the KV cache takes is this (unless
# --num-gpu-blocks-override sets fewer blocks): without it each server would fill ~0.25 of the host with KV cache.
CPU_KV_CACHE_BYTES = 256 << 20
WARMUP_TIMEOUT_S = 120.0
START_RETRIES = 2  # restarts of a server that exited with EADDRINUSE


@dataclass
class EngineProcess:
    """One started vLLM process and where it answers."""

    launch: EngineLaunch
    proc: subprocess.Popen
    log: Path
    pod: PodInfo | None  # None: a headless node (no HTTP of its own); the ports really bound once started
    argv: list[str] = field(default_factory=list)  # as started (ports moved off taken ones)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.pod.name if self.pod else f"{self.launch.role}-{self.launch.replica}-node{self.launch.node_index}"


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def cpu_argv(launch: EngineLaunch, memory_fraction: float = CPU_MEMORY_FRACTION) -> list[str]:
    """The launch's argv for this machine: placeholders resolved, HTTP on 127.0.0.1, CPU settings."""
    argv = [_resolve(a, launch) for a in launch.argv]
    if "--host" in argv:
        argv = _set_flag(argv, "--host", LOCALHOST)
    argv = _set_flag(argv, "--gpu-memory-utilization", repr(memory_fraction))
    if "--kv-cache-memory-bytes" not in argv:
        argv += ["--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
    for flag in ("--enforce-eager", "--enable-prompt-tokens-details"):
        if flag not in argv:
            argv.append(flag)
    return argv


def cpu_env(launch: EngineLaunch, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The process environment: ours, without a PYTHONHASHSEED the spec did not ask for (it would change vLLM's
    NONE_HASH and so every block hash), plus the launch's (placeholders resolved) and offline mode."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["HF_HUB_OFFLINE"] = "1"
    # Every server of a local deployment is on this machine: NIXL's UCX transports stay on loopback (left to itself,
    # UCX listens on the machine's network address for peers that will never come from there).
    env.setdefault("UCX_NET_DEVICES", "lo")
    env.update({k: _resolve(v, launch) for k, v in launch.env.items()})
    env.update(extra or {})
    return env


def core_binds(n_servers: int, cores: list[int] | None = None) -> list[str]:
    """VLLM_CPU_OMP_THREADS_BIND for each of n single-rank servers: the machine's cores split between them, one core
    each (shared round-robin) when there are more servers than cores. vLLM's default binds every server's OpenMP
    threads to all cores, and on a loaded machine their barriers then spin against each other: prompt throughput fell
    from thousands of tokens/s to ~60 with three servers on two busy cores."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if n_servers >= len(cores):
        return [str(cores[i % len(cores)]) for i in range(n_servers)]
    per = len(cores) // n_servers
    return [",".join(map(str, cores[i * per : (i + 1) * per])) for i in range(n_servers)]


def _resolve(text: str, launch: EngineLaunch) -> str:
    return text.replace(head_placeholder(launch.role, launch.replica), LOCALHOST).replace(NODE_ADDRESS, LOCALHOST)


def check_cpu_spec(spec: DeploymentSpec) -> None:
    """What vLLM's CPU build cannot run, said before minutes of start-up are spent."""
    if spec.model.block_size % CPU_BLOCK_MULTIPLE:
        raise UserError(
            f"model.block_size {spec.model.block_size} does not run on vLLM's CPU build; use a multiple of "
            f"{CPU_BLOCK_MULTIPLE} (e.g. {CPU_BLOCK_MULTIPLE})"
        )
    model = Path(spec.model.path)
    if not (model / "config.json").exists() or not any(model.glob("*.safetensors")):
        raise UserError(
            f"{model} has no config.json and weights for vLLM to load; make a tiny model with "
            f"`llmd model make-tiny {model}` (without --no-weights)"
        )


def pods_of(spec: DeploymentSpec, launches: Iterable[EngineLaunch], mode: LaunchMode) -> list[PodInfo | None]:
    """The router's PodInfo for each launch (None for headless nodes), in launch order."""
    eps: dict[tuple[str, int], EngineEndpoint] = {(e.role, e.replica): e for e in engine_endpoints(spec, LOCALHOST)}
    out: list[PodInfo | None] = []
    for launch in launches:
        if launch.http_port is None:
            out.append(None)
            continue
        ep = eps[(launch.role, launch.replica)]
        per_rank = mode == "per-rank" and ep.dp_size > 1
        # Per-rank: each server is one DP rank, a pod of its own. Head mode: the head's API server fronts every rank
        # of the replica (headless nodes' too) and the router picks one with X-data-parallel-rank.
        dp, first = (1, launch.ranks[0]) if per_rank else (ep.dp_size, 0)
        nixl = spec.disaggregated
        out.append(
            PodInfo(
                name=f"{ep.name}-rank{first}" if per_rank else ep.name,
                role=launch.role,
                url=f"http://{LOCALHOST}:{launch.http_port}",
                dp_size=dp,
                kv_events_endpoint=None,  # bound on a free port: known once the server says (required_kv_sources)
                kv_events_replay_endpoint=f"tcp://{LOCALHOST}:{ep.replay_port + first}",
                side_channel_host=LOCALHOST if nixl else None,
                side_channel_port=ep.side_channel_port + first if nixl else None,
                # vLLM suffixes `_dp<rank>` itself for ranks > 0; a per-rank server is addressed as its own pod.
                engine_id=(f"{ep.engine_id}_dp{first}" if per_rank and first else ep.engine_id) if nixl else None,
            )
        )
    return out


def settle_ports(launches: Iterable[EngineLaunch]) -> list[EngineLaunch]:
    """The launches with their probed ports chosen together on this machine
    (llmd.engines.vllm_server.choose_probed_ports): one DP RPC port per replica and each launch's NIXL side-channel
    base, the layout's where free here, else (and for 0, `port: auto`, which vLLM refuses for both) a free one that no
    other launch got. A probe, so racy: see `VllmDeployment._move_dp_rpc_port` for a start that loses."""
    launches = list(launches)
    rpc_port, side_base = choose_probed_ports(
        LOCALHOST, [((x.role, x.replica), x.argv, x.env, x.ranks, True) for x in launches]
    )
    out = []
    for i, launch in enumerate(launches):
        port = rpc_port.get((launch.role, launch.replica))
        argv = with_dp_rpc_port(launch.argv, port) if port is not None else launch.argv
        base = side_base[i]
        env = launch.env if base is None else {**launch.env, SIDE_CHANNEL_ENV: str(base)}
        out.append(replace(launch, argv=argv, env=env))
    return out


def _ports_of(spec: DeploymentSpec, role: str) -> list[int]:
    """Every port the layout and the launches give one pool."""
    pool = spec.pools[role]
    ports: list[int] = []
    for r in range(pool.replicas):
        ports.append(pool.port + r)
        ports.append(pool.port + DP_RPC_OFFSET + r)
        for k in range(pool.dp_size):
            i = r * pool.dp_size + k
            ports += [pool.port + off + i for off in (KV_EVENTS_OFFSET, SIDE_CHANNEL_OFFSET, REPLAY_OFFSET)]
            ports.append(pool.port + RANK_HTTP_OFFSET + i)
    return ports


def with_free_ports(spec: DeploymentSpec, *, low: int = 20_000, high: int = 59_000, seed: int | None = None) -> Any:
    """The spec with each pool's base port moved to one whose whole band of ports is free now (racy, as any port
    probe is; the bands are spread at random so concurrent runs rarely meet)."""
    rng = random.Random(seed)
    taken: set[int] = set()
    update: dict[str, Any] = {}
    for role, pool in spec.pools.items():
        for _ in range(200):
            base = rng.randrange(low, high - DP_RPC_OFFSET - pool.ranks)
            trial = spec.model_copy(update={role: pool.model_copy(update={"port": base})})
            ports = _ports_of(trial, role)
            if not taken.intersection(ports) and all(port_free(LOCALHOST, p) for p in ports):
                taken.update(ports)
                update[role] = trial.pools[role]
                break
        else:
            raise UserError(f"found no free band of ports for the {role} pool between {low} and {high}")
    return spec.model_copy(update=update)


class VllmDeployment:
    """Start, wait for, warm up and stop a spec's vLLM servers on this machine. A context manager."""

    def __init__(
        self,
        spec: DeploymentSpec,
        workdir: str | os.PathLike[str],
        *,
        mode: LaunchMode = "per-rank",
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        memory_fraction: float = CPU_MEMORY_FRACTION,
        timeout_s: float | None = None,
        warmup: bool = True,
        run_id: str | None = None,
    ) -> None:
        """`run_id` (llmd.runid): each server is started vouching for it, and is waited for only as that run's."""
        check_cpu_spec(spec)
        if python == sys.executable and not vllm_installed():
            raise UserError("vLLM is not installed here; run `make install-full` (or pip install -e '.[vllm]')")
        self.spec = spec
        self.workdir = Path(workdir)
        self.mode = mode
        self.python = python
        self.env = dict(env or {})
        self.memory_fraction = memory_fraction
        self.timeout_s = timeout_s if timeout_s is not None else spec.engine.startup_timeout_s
        self.warmup = warmup
        self.run_id = run_id
        self.processes: list[EngineProcess] = []
        # stop() may run while start() is still launching (Ctrl-C during start-up): no process starts after it.
        self._lock = threading.Lock()
        self._stopping = False

    @property
    def pods(self) -> list[PodInfo]:
        return [p.pod for p in self.processes if p.pod is not None]

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.pods]

    def __len__(self) -> int:
        return len(self.pods)

    def __enter__(self) -> VllmDeployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # From an event loop (llmd demo): start-up and stop are blocking waits, so they run in a thread. A cancelled
    # start (Ctrl-C) still stops whatever it started: the thread finishes, then stop() runs.
    async def __aenter__(self) -> VllmDeployment:
        task = asyncio.ensure_future(asyncio.to_thread(self.start))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            # Stop first: the start-up thread then fails fast (its servers are gone) instead of waiting them out.
            await asyncio.to_thread(self.stop)
            with contextlib.suppress(BaseException):
                await task
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    def start(self) -> list[PodInfo]:
        """Every server started concurrently, healthy and warmed up; their PodInfo with the ports they bound. Stops
        them all on failure."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        launches = settle_ports(vllm_launches(self.spec, python=self.python, mode=self.mode, run_id=self.run_id))
        binds = core_binds(len(launches))
        try:
            for i, (launch, pod) in enumerate(zip(launches, pods_of(self.spec, launches, self.mode), strict=True)):
                name = pod.name if pod else f"{launch.role}-{launch.replica}-node{launch.node_index}"
                argv, env = move_taken_ports(
                    cpu_argv(launch, self.memory_fraction),
                    cpu_env(launch, self._bind(launch, binds[i])),
                    LOCALHOST,
                    launch.ranks,
                )
                log = self.workdir / f"{name}.log"
                with self._lock:
                    self.processes.append(EngineProcess(launch, self._spawn(argv, env, log), log, pod, argv, env))
            deadline = time.monotonic() + self.timeout_s
            for i in range(len(self.processes)):
                if self.processes[i].pod is not None:
                    self._wait_up(i, deadline)
            if self.warmup:
                for p in self.processes:
                    if p.pod is not None:
                        self._warm_up(p)
        except BaseException:
            self.stop()
            raise
        return self.pods

    def _spawn(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """One server process, unless stop() has begun; called with the lock held, so stop() sees every one."""
        if self._stopping:
            raise UserError("the vLLM deployment was stopped during start-up")
        with open(log, "wb") as fh:
            return subprocess.Popen(
                argv,
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: vLLM's engine-core and worker children stop with it
            )

    def _wait_up(self, i: int, deadline: float) -> None:
        """Wait until server `i` answers as this run's, learn the ports it bound; restart it with every port moved
        if it exits with EADDRINUSE (START_RETRIES times)."""
        p = self.processes[i]
        assert p.pod is not None
        for attempt in range(START_RETRIES + 1):
            # All processes count: a headless node or a peer dying fails the start as much as this one.
            others = [q.proc for q in self.processes if q is not p]
            left = max(1.0, deadline - time.monotonic())
            name = f"vLLM {p.name}"
            try:
                if p.argv[p.argv.index("--port") + 1] == "0":
                    port = wait_bound_http(p.proc, LOCALHOST, left, name=name, run_id=self.run_id, others=others)
                else:
                    port = int(p.argv[p.argv.index("--port") + 1])
                    wait_healthy(
                        f"http://{LOCALHOST}:{port}/health", [p.proc, *others], left, name=name, run_id=self.run_id
                    )
            except EngineStartError as exc:
                if p.proc.poll() is not None and address_in_use(p.log) and attempt < START_RETRIES:
                    print(f"{name}: a port it was given was taken by the time it bound; starting it again on free ones")
                    p.argv, p.env = move_taken_ports(p.argv, p.env, LOCALHOST, p.launch.ranks, every=True)
                    _reap_group(p.proc.pid)  # its engine core may outlive the API server
                    peers = self._move_dp_rpc_port(p)
                    with self._lock:
                        for q in (p, *peers):
                            q.proc = self._spawn(q.argv, q.env, q.log)
                    continue
                # The log's tail as it is now, of the process that died if one did.
                dead = next((q for q in self.processes if q.proc.poll() is not None), p)
                what = str(exc) if dead is p else f"vLLM {dead.name} exited with code {dead.proc.returncode}"
                raise EngineStartError(f"{what}; log {dead.log}:\n{log_tail(dead.log)}") from None
            url = f"http://{LOCALHOST}:{port}"
            bound = {"http_port": port, **required_kv_sources(url, name)}
            if p.pod.side_channel_port is not None:
                # A head's pod fronts every rank of its replica: those its headless processes run listen on theirs.
                ranks = p.launch.ranks if self.mode == "per-rank" else list(range(p.pod.dp_size))
                ports = rank_side_channel_ports(
                    (q.env, q.launch.ranks) for q in self.processes if _replica(q) == _replica(p)
                )
                bound["side_channel_ports"] = [ports[r] for r in ranks]
            p.pod = with_bound_ports(p.pod, bound)
            return

    def _move_dp_rpc_port(self, p: EngineProcess) -> list[EngineProcess]:
        """After `p` exited with EADDRINUSE: if it binds its replica's DP RPC port (it runs rank 0) and another program
        holds that port now, `p` and the replica's other processes, which dial it, get a free one; those others are
        stopped here. Returns them, to be started again with `p`."""
        port = dp_rpc_port_of(p.argv)
        if port is None or 0 not in p.launch.ranks or port_free(LOCALHOST, port):
            return []
        new = free_run(LOCALHOST, 1)
        peers = [q for q in self.processes if q is not p and _replica(q) == _replica(p)]
        print(f"vLLM {p.name}: its DP RPC port {port} is taken; the replica starts again on {new}")
        for q in (p, *peers):
            q.argv = with_dp_rpc_port(q.argv, new)
        for q in peers:
            stop_process_group(q.proc)
            _reap_group(q.proc.pid)
        return peers

    def _bind(self, launch: EngineLaunch, cores: str) -> dict[str, str]:
        """Our extra env, plus a core binding for single-rank servers unless the spec or the caller set one."""
        env = dict(self.env)
        one_rank = len(launch.ranks) == 1 and self.spec.pools[launch.role].tp_size == 1
        if one_rank and "VLLM_CPU_OMP_THREADS_BIND" not in {**launch.env, **env, **os.environ}:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cores
        return env

    def _warm_up(self, p: EngineProcess) -> None:
        """One plain request, shorter than a block (no KV event, nothing cached), before any KV transfer."""
        assert p.pod is not None
        body = {"model": self.spec.model.served_name, "prompt": "warm up", "max_tokens": 1, "temperature": 0}
        req = urllib.request.Request(
            p.pod.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=WARMUP_TIMEOUT_S) as resp:
                resp.read()
        except (OSError, urllib.error.URLError) as exc:
            tail = log_tail(p.log)
            raise UserError(f"vLLM {p.name} failed its warm-up request ({exc}); log {p.log}:\n{tail}") from exc

    def stop(self) -> None:
        """SIGTERM every group at once (vLLM shuts down in parallel), then wait for each, SIGKILL past the grace."""
        with self._lock:
            self._stopping = True
            procs, self.processes = self.processes, []
        for p in procs:
            if p.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGTERM)
        for p in procs:
            stop_process_group(p.proc)
            _reap_group(p.proc.pid)

    def failed(self) -> list[str]:
        """Servers that exited while they should be running, with their log's tail."""
        gone = [p for p in self.processes if p.proc.poll() is not None]
        return [f"{p.name} exited {p.proc.returncode}:\n{log_tail(p.log)}" for p in gone]


def vllm_installed() -> bool:
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")  # finds without importing (a submodule would import vllm: seconds)
    except (ImportError, ValueError):
        return False
    # A regular package, not a namespace package: any folder named vllm on sys.path would pass for the latter.
    return spec is not None and (spec.origin or "").endswith("__init__.py")


def _replica(p: EngineProcess) -> tuple[str, int]:
    return (p.launch.role, p.launch.replica)


def _reap_group(pgid: int, grace_s: float = 5.0) -> None:
    """Whatever of a group outlived its leader (an engine core whose API server exited first) is killed."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# ---- llmd demo --engine vllm -----------------------------------------------------------------------------------------

# The embedded demo deployment on real vLLM CPU servers: one prefill and one decode engine with NIXL between them (the
# P/D path for real), 32-token blocks, 400 blocks each (the sim demo's 800 x 16 tokens). Two servers is what two
# cores start in about a minute and a half.
DEMO_BLOCK_SIZE = 32
DEMO_GPU_BLOCKS = 400
DEMO_MAX_NUM_SEQS = 16


def demo_spec(spec: DeploymentSpec, *, embedded: bool) -> DeploymentSpec:
    """The spec `llmd demo --engine vllm` runs: a spec file's as given (engine.kind vllm), or the embedded one shrunk
    to 1 prefill + 1 decode server; the embedded model gets its weights made on first use."""
    if not embedded:
        return spec.model_copy(update={"engine": spec.engine.model_copy(update={"kind": "vllm"})})
    one = {"nodes": 1, "replicas": 1, "max_num_seqs": DEMO_MAX_NUM_SEQS}
    spec = spec.model_copy(
        update={
            "name": f"{spec.name}-vllm",
            "model": spec.model.model_copy(update={"block_size": DEMO_BLOCK_SIZE}),
            "prefill": spec.prefill.model_copy(update=one),
            "decode": spec.decode.model_copy(update=one),
            "kv": spec.kv.model_copy(update={"gpu_blocks": DEMO_GPU_BLOCKS}),
            "engine": spec.engine.model_copy(update={"kind": "vllm"}),
        }
    )
    model = Path(spec.model.path)
    if not any(model.glob("*.safetensors")):
        from llmd.models.tiny import make_tiny

        print(f"making the tiny model's weights in {model} (first vLLM run only)")
        make_tiny(model, weights=True)
    return with_free_ports(spec)
