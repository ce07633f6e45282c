"""The discovery file: engines add their entry once healthy, the router follows it (on mtime). One typed entry
(PodInfo), its JSON form and checks, the one writer (`publish`) and the one reader (`read_discovery`).

File: a JSON list, one entry per engine server (pod):

    [{"name": "decode-0", "role": "decode", "url": "http://10.0.0.5:8200", "dp_size": 1,
      "kv_events_endpoint": "tcp://*:9200", "kv_events_replay_endpoint": "tcp://*:9300",
      "side_channel_host": "10.0.0.5", "side_channel_port": 10200, "engine_id": "decode-0", "node": "gpu001"}]

`kv_events_endpoint` is rank 0's endpoint as the engine was configured (rank r publishes on port + r). A `*` host means
the engine binds and the router connects to the pod's host; an explicit host is the address the router connects to,
unless the entry says `"kv_events_bind": true` (vLLM given an explicit host connects, so the router must bind there).
`engine_id` is the NixlConnector engine id (vLLM appends `_dp<rank>` when a server runs several DP ranks); without it
the router learns a pod's id from its own prefill responses, and cannot ask a pod for a P2P pull before that.
`kv_events_endpoints`, `kv_events_replay_endpoints` and `side_channel_ports` list every DP rank's own, as bound, when
they are not rank 0's + rank (an engine on `port: auto`, or one whose layout port was taken and moved to a free one);
every port in an entry is one the engine had bound before the entry was written.
`node`, `rank_hosts`, `replica` and `dp_rank` are for people reading the file; routing does not use them.

Writers on several nodes share the file on a shared filesystem: each holds an exclusive flock on one side file
(`.discovery.json.lock`), writes the whole list to a temp file, fsyncs and renames it over the old one, so a reader
sees the old list or the new one, never half of either. An entry of the same name (an engine restarted on a requeued
job) is replaced; other entries are kept.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from llmd.errors import UserError
from llmd.spec.layout import EngineEndpoint

FILE_NAME = "discovery.json"
ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class PodInfo:
    """One engine server (all its DP ranks), as the spec or a discovery file describes it."""

    name: str
    role: str
    url: str
    dp_size: int = 1
    kv_events_endpoint: str | None = None  # rank 0's, as the engine was configured
    kv_events_replay_endpoint: str | None = None  # rank 0's replay ROUTER; None: ask the pod (/kv_event_sources)
    kv_events_bind: bool = False
    side_channel_host: str | None = None
    side_channel_port: int | None = None  # rank 0's; rank r answers on port + r
    engine_id: str | None = None  # the server's NixlConnector engine id (rank 0's base)
    # Per DP rank, as bound: set when an engine's ports are not the base + rank (`port: auto`, or a taken port moved).
    kv_events_endpoints: tuple[str, ...] = ()
    kv_events_replay_endpoints: tuple[str, ...] = ()
    side_channel_ports: tuple[int, ...] = ()
    # For people reading the file: where the server and each of its DP ranks run.
    node: str | None = None
    rank_hosts: tuple[str, ...] = ()
    replica: int | None = None
    dp_rank: int | None = None

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def serves_decode(self) -> bool:
        return self.role != "prefill"

    def events_address(self, rank: int) -> tuple[str, bool] | None:
        """(ZMQ address, bind?) of rank `rank`'s KV event stream, as the router's SUB socket must use it."""
        if rank < len(self.kv_events_endpoints):
            return rank_address(self.kv_events_endpoints[rank], 0, self.host, self.kv_events_bind)
        return rank_address(self.kv_events_endpoint, rank, self.host, self.kv_events_bind)

    def replay_address(self, rank: int) -> str | None:
        if rank < len(self.kv_events_replay_endpoints):
            got = rank_address(self.kv_events_replay_endpoints[rank], 0, self.host, False)
        else:
            got = rank_address(self.kv_events_replay_endpoint, rank, self.host, False)
        return got[0] if got else None

    def engine_id_of(self, rank: int) -> str | None:
        if self.engine_id is None:
            return None
        return self.engine_id if self.dp_size == 1 else f"{self.engine_id}_dp{rank}"

    def side_channel_of(self, rank: int) -> tuple[str, int] | None:
        if rank < len(self.side_channel_ports):
            return (self.side_channel_host or self.host, self.side_channel_ports[rank])
        if self.side_channel_port is None:
            return None
        return (self.side_channel_host or self.host, self.side_channel_port + rank)

    def to_json(self) -> dict[str, Any]:
        """The file's form: every routing field, and the optional ones only when set (so old readers see no news)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _OPTIONAL and value == f.default:
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


def rank_address(endpoint: str | None, rank: int, host: str, bind: bool) -> tuple[str, bool] | None:
    """(address, bind?) of rank `rank`'s socket for a rank 0 `endpoint`; a bound-everywhere host becomes `host`."""
    if not endpoint:
        return None
    if not endpoint.startswith("tcp://"):
        return endpoint, bind  # ipc:// and friends: used as given (one rank per endpoint)
    base, _, port = endpoint.rpartition(":")
    addr_host = base[len("tcp://") :]
    if addr_host in ("*", "0.0.0.0", "::", "[::]"):
        # The engine binds every interface: reach it at the pod's own host.
        return f"tcp://{host}:{int(port) + rank}", False
    return f"tcp://{addr_host}:{int(port) + rank}", bind


def entry_for(
    ep: EngineEndpoint, address: str | None = None, *, node: str | None = None, rank_hosts: Sequence[str] = ()
) -> PodInfo:
    """The entry of the engine serving `ep`'s layout ports at `address` (default: ep.host); it binds its KV event
    and replay sockets on every interface, so the router connects to `address`."""
    address = address or ep.host
    return PodInfo(
        name=ep.name,
        role=ep.role,
        url=f"http://{address}:{ep.http_port}",
        dp_size=ep.dp_size,
        kv_events_endpoint=ep.kv_events_endpoint(bind=True),
        kv_events_replay_endpoint=ep.replay_endpoint(bind=True),
        side_channel_host=address,
        side_channel_port=ep.side_channel_port,
        engine_id=ep.engine_id,
        node=node,
        rank_hosts=tuple(rank_hosts),
    )


def with_bound_ports(entry: PodInfo, bound: dict[str, Any]) -> PodInfo:
    """`entry` (the layout's ports) with the ports its engine really bound, as a simulated engine's --ports-file
    reports them: the HTTP port in the URL, rank 0's endpoints in the base fields, and every rank's in the lists."""
    host = urlsplit(entry.url).hostname
    events = tuple(bound.get("kv_events_endpoints") or ())
    replays = tuple(bound.get("kv_events_replay_endpoints") or ())
    sides = tuple(int(p) for p in bound.get("side_channel_ports") or ())
    return replace(
        entry,
        url=f"http://{host}:{int(bound['http_port'])}",
        kv_events_endpoint=events[0] if events else entry.kv_events_endpoint,
        kv_events_replay_endpoint=replays[0] if replays else entry.kv_events_replay_endpoint,
        side_channel_port=sides[0] if sides else entry.side_channel_port,
        # Only a server of several ranks needs the lists (one rank: the base fields say it all, for old readers too).
        kv_events_endpoints=events if len(events) > 1 else (),
        kv_events_replay_endpoints=replays if len(replays) > 1 else (),
        side_channel_ports=sides if len(sides) > 1 else (),
    )


# ---- JSON -> PodInfo -------------------------------------------------------------------------------------------------

_FIELDS: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "role": str,
    "url": str,
    "dp_size": int,
    "kv_events_endpoint": (str, type(None)),
    "kv_events_replay_endpoint": (str, type(None)),
    "kv_events_bind": bool,
    "side_channel_host": (str, type(None)),
    "side_channel_port": (int, type(None)),
    "engine_id": (str, type(None)),
    "kv_events_endpoints": list,
    "kv_events_replay_endpoints": list,
    "side_channel_ports": list,
    "node": (str, type(None)),
    "rank_hosts": list,
    "replica": (int, type(None)),
    "dp_rank": (int, type(None)),
}
_OPTIONAL = (
    "kv_events_bind",
    "kv_events_endpoints",
    "kv_events_replay_endpoints",
    "side_channel_ports",
    "node",
    "rank_hosts",
    "replica",
    "dp_rank",
)
_LISTS: dict[str, type] = {
    "rank_hosts": str,
    "kv_events_endpoints": str,
    "kv_events_replay_endpoints": str,
    "side_channel_ports": int,
}
_REQUIRED = ("name", "url")


def parse_discovery(data: Any, source: str = "discovery file") -> list[PodInfo]:
    """Validate a discovery document; UserError names the entry and field at fault."""
    if not isinstance(data, list):
        raise UserError(f"{source}: expected a JSON list of engine entries, got {type(data).__name__}")
    pods: list[PodInfo] = []
    names: set[str] = set()
    for i, entry in enumerate(data):
        where = f"{source}: entry {i}"
        if not isinstance(entry, dict):
            raise UserError(f"{where}: expected an object like {{'name': ..., 'url': ...}}")
        for key in _REQUIRED:
            if key not in entry:
                raise UserError(f"{where}: missing {key!r}")
        kw: dict[str, Any] = {}
        for key, value in entry.items():
            want = _FIELDS.get(key)
            if want is None:
                continue  # a newer writer's field: readers that do not know it ignore it
            is_bool_for_number = isinstance(value, bool) and want is not bool
            if is_bool_for_number or not isinstance(value, want):
                raise UserError(f"{where}: {key!r} has the wrong type ({type(value).__name__})")
            kw[key] = value
        for key, item in _LISTS.items():
            values = kw.get(key, ())
            if not all(isinstance(v, item) and not isinstance(v, bool) for v in values):
                raise UserError(f"{where}: {key!r} must be a list of {'host names' if item is str else 'ports'}")
            kw[key] = tuple(values)
        kw.setdefault("role", "both")
        if kw["role"] not in ROLES:
            raise UserError(f"{where}: role {kw['role']!r} is not one of {', '.join(ROLES)}")
        if kw.get("dp_size", 1) < 1:
            raise UserError(f"{where}: dp_size must be >= 1")
        url = urlsplit(kw["url"])
        if url.scheme not in ("http", "https") or not url.hostname:
            raise UserError(f"{where}: url {kw['url']!r} is not an http(s) URL like http://10.0.0.5:8200")
        kw["url"] = kw["url"].rstrip("/")
        if kw["name"] in names:
            raise UserError(f"{where}: name {kw['name']!r} appears twice")
        names.add(kw["name"])
        pods.append(PodInfo(**kw))
    return pods


# ---- the file --------------------------------------------------------------------------------------------------------


def read_discovery(path: str | os.PathLike[str]) -> list[PodInfo]:
    """The entries in the file at `path`: [] when it does not exist or is empty (no engine has announced itself yet);
    UserError naming the file and the fix when it cannot be read, is not JSON or holds a bad entry."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise UserError(f"cannot read the discovery file {path}: {exc.strerror or exc}") from exc
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"discovery file {path} is not valid JSON ({exc}); fix or move it, then restart") from exc
    return parse_discovery(data, f"discovery file {path}")


def publish(path: str | os.PathLike[str], entries: Iterable[PodInfo]) -> list[PodInfo]:
    """Add (or replace, by name) `entries` in the discovery file at `path`; returns the list as written. A file that
    does not read (read_discovery's UserError) is left as it is."""
    path = Path(path)
    entries = list(entries)
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            names = {e.name for e in entries}
            merged = [e for e in read_discovery(path) if e.name not in names] + entries
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "w") as out:
                json.dump([e.to_json() for e in merged], out, indent=1)
                out.write("\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
            return merged
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
