"""llmd.discovery: the typed entry and its JSON round trip, the one writer under concurrent processes, the one reader's
error policy (missing or empty: no engines yet; anything else wrong: a UserError naming the file), and the router
keeping its pods through a torn write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmd.discovery import PodInfo, entry_for, parse_discovery, publish, read_discovery
from llmd.errors import UserError
from llmd.spec import parse_spec
from llmd.spec.layout import engine_endpoints

ROOT = Path(__file__).resolve().parent.parent

_WRITER = """
import sys
from llmd.discovery import PodInfo, publish
path, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for k in range(n):
    publish(path, [PodInfo(f"{who}-{k}", "both", "http://127.0.0.1:1")])
"""


def test_concurrent_appends_keep_every_entry(tmp_path: Path) -> None:
    path = tmp_path / "discovery.json"
    publish(path, [PodInfo("keep", "both", "http://h:1")])
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), f"w{k}", "15"], cwd=ROOT) for k in range(4)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    names = [e.name for e in read_discovery(path)]
    assert sorted(names) == sorted(["keep"] + [f"w{k}-{i}" for k in range(4) for i in range(15)])
    # Same name again: replaced, not duplicated; the router reads the result.
    publish(path, [PodInfo("keep", "both", "http://h:2")])
    pods = {p.name: p for p in parse_discovery(json.loads(path.read_text()))}
    assert len(pods) == 61 and pods["keep"].url == "http://h:2"
    assert not list(tmp_path.glob(".*.tmp"))


def test_publish_refuses_a_broken_file_and_leaves_it(tmp_path: Path) -> None:
    path = tmp_path / "discovery.json"
    path.write_text("[{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        publish(path, [PodInfo("a", "both", "http://h:1")])
    assert path.read_text() == "[{not json"


def test_missing_or_empty_file_is_no_engines_yet(tmp_path: Path) -> None:
    path = tmp_path / "discovery.json"
    assert read_discovery(path) == []
    path.write_text(" \n")
    assert read_discovery(path) == []


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("[{not json", r"is not valid JSON .*; fix or move it, then restart"),
        ('{"name": "a"}', "expected a JSON list of engine entries, got dict"),
        ('[{"name": "a"}]', r"entry 0: missing 'url'"),
        ('[{"name": "a", "url": "http://h:1", "side_channel_port": "9"}]', r"entry 0: 'side_channel_port' has the"),
        ('[{"name": "a", "url": "http://h:1", "rank_hosts": [1]}]', r"entry 0: 'rank_hosts' must be a list"),
    ],
)
def test_a_bad_file_names_the_file_and_what_is_wrong(tmp_path: Path, text: str, what: str) -> None:
    path = tmp_path / "discovery.json"
    path.write_text(text)
    with pytest.raises(UserError, match=f"discovery file {path}.*{what}"):
        read_discovery(path)


def test_entry_round_trips_through_the_file(tmp_path: Path) -> None:
    full = PodInfo(
        "prefill-1-dp8", "prefill", "http://10.0.0.3:8101", dp_size=1,
        kv_events_endpoint="tcp://*:9109", kv_events_replay_endpoint="tcp://*:9309", kv_events_bind=True,
        side_channel_host="10.0.0.3", side_channel_port=10124, engine_id="prefill-1_dp8",
        node="gpu003", rank_hosts=("10.0.0.3", "10.0.0.4"), replica=1, dp_rank=8,
    )  # fmt: skip
    bare = PodInfo("d", "decode", "http://h:1")
    path = tmp_path / "discovery.json"
    assert publish(path, [full, bare]) == [full, bare]
    assert read_discovery(path) == [full, bare]
    # Optional fields only when set: a bare entry reads as the router's format always was.
    assert json.loads(path.read_text())[1] == {
        "name": "d", "role": "decode", "url": "http://h:1", "dp_size": 1, "kv_events_endpoint": None,
        "kv_events_replay_endpoint": None, "side_channel_host": None, "side_channel_port": None, "engine_id": None,
    }  # fmt: skip
    # A field a newer writer adds is ignored, not refused.
    assert parse_discovery([{**bare.to_json(), "gpu": "h100"}]) == [bare]


def test_layout_entry_binds_events_and_names_the_node() -> None:
    spec = parse_spec({"decode": {"nodes": 2, "replicas": 2, "port": 31200}})
    ep = engine_endpoints(spec)[-1]
    entry = entry_for(ep, "10.0.0.2", node="n2", rank_hosts=["10.0.0.2"])
    assert entry.url == "http://10.0.0.2:31201" and entry.name == "decode-1" and entry.engine_id == "decode-1"
    assert entry.events_address(0) == ("tcp://10.0.0.2:32201", False)
    assert entry.side_channel_of(0) == ("10.0.0.2", 33201) and entry.replay_address(0) == "tcp://10.0.0.2:34201"
    assert entry.node == "n2" and entry.rank_hosts == ("10.0.0.2",)
    assert entry_for(ep).url == ep.url  # by default at the endpoint's own host


def test_router_keeps_its_pods_through_a_torn_or_truncated_write(tmp_path: Path) -> None:
    from llmd.router.endpoints import EndpointRegistry

    path = tmp_path / "discovery.json"
    stamps = iter(range(1, 10))

    def write(text: str) -> None:
        path.write_text(text)
        os.utime(path, ns=(0, next(stamps) * 10**9))  # a new mtime each time, however fast the writes follow

    write(json.dumps([PodInfo("a", "both", "http://h:1").to_json()]))
    registry = EndpointRegistry(discovery=path)
    assert registry.reload_discovery() and set(registry.pods) == {"a"}
    for torn in ("", "[{"):
        write(torn)
        assert not registry.reload_discovery() and set(registry.pods) == {"a"}
    assert registry.discovery_errors == 2
    write(json.dumps([PodInfo("b", "both", "http://h:2").to_json()]))
    assert registry.reload_discovery() and set(registry.pods) == {"b"}
