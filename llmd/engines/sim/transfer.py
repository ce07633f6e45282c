"""The side channel between simulated engines for KV pulls: what NIXL's handshake + READ do between real vLLM engines.

Each DP rank listens on its own TCP port on the side-channel host (vLLM: VLLM_NIXL_SIDE_CHANNEL_PORT + dp_rank), the
port its prefill responses advertise as `remote_port`. A puller (a decode engine executing a PullTask) connects,
names the blocks it wants, gets their size back, "transfers" by sleeping the latency model's KV transfer time (scaled
by time_scale), and then notifies the owner, which frees its lease (vLLM's decode side sends the prefill side a
notification when its READ completed). No KV data moves: the blocks' identity is already in the request's tokens.

Frames are a 4-byte big-endian length then a msgpack map. Requests: `pull` {engine_id, remote_request_id (P/D) or
block_hashes (P2P), block_ids} -> {ok, num_tokens, num_blocks, node, engine_id} or {ok: false, error}; then `done`
{ok} -> {ok}. Any connection, protocol or timeout problem is a failed pull, never an exception for the engine loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

log = logging.getLogger(__name__)

_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(dict)
_MAX_FRAME = 64 << 20


class LeaseOwner(Protocol):
    """What a side-channel server needs from the engine whose blocks it serves."""

    engine_id: str
    node: str

    def lookup_lease(
        self, remote_request_id: str, block_ids: Sequence[int]
    ) -> list[tuple[bytes | None, list[int]]] | None: ...
    def release_lease(self, remote_request_id: str) -> bool: ...
    def lookup_cached(self, block_hashes: Sequence[bytes]) -> int: ...
    @property
    def block_size(self) -> int: ...


async def _send(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    data = _ENC.encode(msg)
    writer.write(len(data).to_bytes(4, "big") + data)
    await writer.drain()


async def _recv(reader: asyncio.StreamReader) -> dict[str, Any]:
    head = await reader.readexactly(4)
    n = int.from_bytes(head, "big")
    if n > _MAX_FRAME:
        raise ValueError(f"side-channel frame of {n} bytes is too large")
    return _DEC.decode(await reader.readexactly(n))


class SideChannelServer:
    """Serves one DP rank's leased (P/D) and cached (P2P) blocks to pullers."""

    def __init__(self, owner: LeaseOwner | None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.owner = owner  # may be set after start(): until then every pull is refused
        self.host = host
        self.port = port
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self.served = 0
        self.refused = 0

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for t in list(self._conns):
            t.cancel()
        for t in list(self._conns):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await self._serve(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, msgspec.DecodeError) as exc:
            log.debug("side channel connection ended: %s", exc)
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        owner = self.owner
        msg = await _recv(reader)
        if owner is None:
            await _send(writer, {"ok": False, "error": "engine not started"})
            return
        if msg.get("op") != "pull":
            await _send(writer, {"ok": False, "error": f"unknown op {msg.get('op')!r}"})
            return
        want = msg.get("engine_id")
        if want is not None and want != owner.engine_id:
            # vLLM's handshake checks the remote engine id: a port reused by another engine must not serve.
            self.refused += 1
            await _send(writer, {"ok": False, "error": f"engine {owner.engine_id!r} is not {want!r}"})
            return
        rid = msg.get("remote_request_id")
        if rid is not None:
            blocks = owner.lookup_lease(rid, list(msg.get("block_ids") or []))
            if blocks is None:
                self.refused += 1
                await _send(writer, {"ok": False, "error": f"no lease for request {rid!r} (unknown or expired)"})
                return
            reply = {"num_tokens": sum(len(toks) for _, toks in blocks), "num_blocks": len(blocks)}
        else:
            hashes = list(msg.get("block_hashes") or [])
            n = owner.lookup_cached(hashes)
            reply = {"num_tokens": n * owner.block_size, "num_blocks": n}
        await _send(writer, {"ok": True, "engine_id": owner.engine_id, "node": owner.node, **reply})
        done = await _recv(reader)
        if rid is not None and done.get("op") == "done":
            owner.release_lease(rid)
        self.served += 1
        await _send(writer, {"ok": True})


@dataclass(slots=True)
class PullResult:
    ok: bool
    num_tokens: int = 0  # tokens the peer had for us (P2P: may be fewer than asked)
    num_blocks: int = 0
    seconds: float = 0.0  # simulated transfer time
    same_node: bool = False
    error: str | None = None


async def pull_blocks(
    host: str,
    port: int,
    *,
    engine_id: str | None,
    remote_request_id: str | None,
    block_ids: Sequence[int] = (),
    block_hashes: Sequence[bytes] = (),
    max_tokens: int,
    node: str,
    transfer_time: Callable[[int, bool], float],
    sleep: Callable[[float], Awaitable[None]],
    timeout_s: float = 10.0,
) -> PullResult:
    """One pull: handshake, simulated transfer (`sleep(transfer_time(tokens, same_node))`), completion notice."""
    writer: asyncio.StreamWriter | None = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
        await _send(
            writer,
            {
                "op": "pull",
                "engine_id": engine_id,
                "remote_request_id": remote_request_id,
                "block_ids": list(block_ids),
                "block_hashes": list(block_hashes),
            },
        )
        reply = await asyncio.wait_for(_recv(reader), timeout_s)
        if not reply.get("ok"):
            return PullResult(False, error=str(reply.get("error")))
        tokens = min(int(reply.get("num_tokens", 0)), max_tokens)
        same_node = reply.get("node") == node
        seconds = transfer_time(tokens, same_node) if tokens > 0 else 0.0
        await sleep(seconds)
        await _send(writer, {"op": "done", "ok": True})
        await asyncio.wait_for(_recv(reader), timeout_s)
        return PullResult(True, tokens, int(reply.get("num_blocks", 0)), seconds, same_node)
    except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError, msgspec.DecodeError) as exc:
        return PullResult(False, error=f"{type(exc).__name__}: {exc}")
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
