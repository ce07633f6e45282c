"""KV cache event publisher of one simulated DP rank, wire-compatible with vLLM's ZmqEventPublisher.

What carries over from vllm/distributed/kv_events.py: a PUB socket at the configured endpoint with its port offset by
the DP rank; `*`, `::`, ipc:// and inproc:// endpoints bind, any other (an explicit host) connects, so the subscriber
binds; frames `[topic, seq (8-byte big-endian), payload]` with seq counting from 0 per publisher; an optional ROUTER
replay socket (also offset by the rank, always bound) that answers `[b"", start_seq]` with every buffered batch from
that seq on, then the end marker `(b"", -1 as 8 signed bytes, b"")`.

What differs: a `*` endpoint binds `bind_host`, not every interface (vLLM's ZMQ bind of `*` listens on all of them):
the server passes its HTTP host, so the KV sockets listen where its API does; `bind_host="*"` is vLLM's behaviour.
The endpoint reported (`endpoint`, `replay_endpoint`) keeps the `*`: "bound; reach it at the pod's host".

vLLM publishes from a thread fed by a queue. Here `publish` runs on the engine loop and sends with
NOBLOCK (a PUB socket drops at its high-water mark rather than block), and replay is an asyncio task on the same loop,
so the replay buffer is only ever touched by one thread and needs no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import zmq
import zmq.asyncio

from llmd.kv.events import REPLAY_END_SEQ, encode_batch

log = logging.getLogger(__name__)


def offset_endpoint_port(endpoint: str | None, dp_rank: int) -> str | None:
    """vLLM's per-rank endpoint: tcp port + rank (port 0 left to the OS), inproc gets a `_dpN` suffix."""
    if not endpoint or dp_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{dp_rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        if not base or int(port) == 0:
            return endpoint
        return f"{base}:{int(port) + dp_rank}"
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")


def bind_address(endpoint: str, bind_host: str) -> str:
    """The address a `*` tcp endpoint really binds: `bind_host` (an IP, or a name resolved to one: ZMQ binds
    interfaces and addresses, not host names); any other endpoint as given."""
    if bind_host == "*" or not endpoint.startswith("tcp://*:"):
        return endpoint
    host = bind_host
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        ip = ipaddress.ip_address(socket.gethostbyname(host))
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    return f"tcp://{host}:{endpoint.rpartition(':')[2]}"


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM binds wildcard and ipc/inproc endpoints and connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """PUB + replay ROUTER for one DP rank. Create and use it on the event loop that drives the engine."""

    def __init__(
        self,
        endpoint: str,
        dp_rank: int = 0,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        form: str = "map",
        bind_host: str = "*",
    ) -> None:
        self.dp_rank = dp_rank
        self.topic = topic
        self._topic_b = topic.encode("utf-8")
        self._form = form
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.published = 0
        self.dropped = 0
        self.skip_next = 0  # fault injection: batches not sent (still replayable), as a PUB at its high-water mark
        ep = offset_endpoint_port(endpoint, dp_rank)
        assert ep is not None
        # PUB sends are non-blocking, so a plain socket does; the replay ROUTER is awaited on the loop.
        self._pub = zmq.Context.instance().socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if is_bind_endpoint(ep):
            _bind(self._pub, bind_address(ep, bind_host))
            self.endpoint = _bound(self._pub, ep)
        else:
            self._pub.connect(ep)
            self.endpoint = ep
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        self._replay_task: asyncio.Task[None] | None = None
        rep = offset_endpoint_port(replay_endpoint, dp_rank)
        if rep is not None:
            # An asyncio view of the same process-wide context: one set of I/O threads for every publisher.
            self._replay = zmq.asyncio.Context.shadow(zmq.Context.instance()).socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            _bind(self._replay, bind_address(rep, bind_host))
            self.replay_endpoint = _bound(self._replay, rep)
            self._replay_task = asyncio.get_running_loop().create_task(
                self._serve_replay(), name=f"kv-replay-{dp_rank}"
            )

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Iterable[Any], ts: float | None = None) -> int | None:
        """Send one batch (one engine step's events); returns its seq, or None for an empty batch (vLLM skips those)."""
        events = list(events)
        if not events:
            return None
        payload = encode_batch(events, time.time() if ts is None else ts, self.dp_rank, form=self._form)  # type: ignore[arg-type]
        return self.publish_payload(payload)

    def publish_payload(self, payload: bytes) -> int:
        seq = self._seq
        self._seq += 1
        if self.skip_next > 0:
            # A subscriber sees the next batch's seq jump past this one: a gap it can fill by replay.
            self.skip_next -= 1
            self.dropped += 1
            self._buffer.append((seq, payload))
            return seq
        try:
            self._pub.send_multipart((self._topic_b, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            self.published += 1
        except zmq.Again:
            # Only a connecting PUB with no peer yet can refuse; the batch stays replayable like any other.
            self.dropped += 1
        self._buffer.append((seq, payload))
        return seq

    async def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        while True:
            try:
                frames = await sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ContextTerminated):
                return
            except zmq.ZMQError as exc:  # closed under us
                log.debug("replay socket closed: %s", exc)
                return
            if len(frames) != 3:
                log.warning("invalid KV event replay request with %d frames", len(frames))
                continue
            client, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        await sock.send_multipart((client, b"", self._topic_b, seq.to_bytes(8, "big"), payload))
                await sock.send_multipart((client, b"", b"", REPLAY_END_SEQ, b""))
            except zmq.ZMQError as exc:
                log.debug("replay to a departed client failed: %s", exc)

    async def aclose(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        self.close()

    def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            self._replay_task = None
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None


def _bind(sock: zmq.Socket, address: str) -> None:
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(address)


def _bound(sock: zmq.Socket, endpoint: str) -> str:
    # With port 0 the OS picks one: report what was really bound, with the host the caller asked for.
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        last = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return f"{endpoint.rpartition(':')[0]}:{last.rpartition(':')[2]}"
    return endpoint
