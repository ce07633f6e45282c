"""KV events from every engine rank into the router's KVIndex: one ZMQ SUB per (pod, DP rank), in order.

Order matters (a BlockRemoved applied before the BlockStored it follows would leave a stale hit), so a sequence gap is
not applied around: live batches are buffered while the publisher's replay socket (DEALER -> ROUTER, vLLM's protocol:
`[b"", start_seq]` -> batches from that seq on, then an end marker) resends the missed ones, and the buffer is applied
after them. Each subscription starts with a replay from seq 0 too, which fills what the publisher sent before the SUB
connected (ZMQ's slow joiner). A seq going backwards is a publisher restart: the index forgets what it said.

A subscription is one epoch of one pod: when the pod dies the proxy stops it and drops the pod from the index; when it
comes back a new epoch starts with its own sequence state (the index keys sequences by (pod, rank, epoch)).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from llmd.kv.events import DecodedBatch, KVEventDecoder, is_replay_end, replay_request
from llmd.kv.index import AnyKVIndex

log = logging.getLogger(__name__)

# A replay that leaves a gap again (a SUB that connected late, a trimmed publisher buffer) is retried this often
# in a row before the gap is accepted; the index records accepted gaps.
MAX_REPLAYS_IN_A_ROW = 3
MAX_BUFFERED = 100_000  # live batches held during one replay; beyond it the replay is abandoned
# Batches one subscription reads before the loop runs anything else: the burst read saves a loop round per batch, and
# the bound keeps a flood (hundreds of ranks after a burst of sub-agents) from holding requests up until it ends.
READ_BURST = 256
BAD_FRAME_LOG_EVERY = 1000  # after the first, one warning per this many bad frames of a subscription


class EventStats:
    """Counters a metrics collector reads; plain ints (the hot path must not pay for Prometheus calls)."""

    __slots__ = (
        "bad_frames",
        "batches",
        "duplicates",
        "gaps",
        "replay_batches",
        "replays_failed",
        "replays_ok",
        "restarts",
    )

    def __init__(self) -> None:
        self.batches = 0
        self.gaps = 0
        self.duplicates = 0
        self.restarts = 0
        self.replays_ok = 0
        self.replays_failed = 0
        self.replay_batches = 0
        self.bad_frames = 0  # frames or events that did not decode, and batches the index could not apply


class RankSubscription:
    """The KV event stream of one DP rank of one pod, for one epoch."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        index: AnyKVIndex,
        pod: str,
        rank: int,
        epoch: int,
        address: str,
        *,
        bind: bool = False,
        replay_address: str | None = None,
        replay_timeout_s: float = 2.0,
        stats: EventStats | None = None,
        on_batch: Callable[[str, int], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.index = index
        self.pod = pod
        self.rank = rank
        self.publisher = (pod, rank, epoch)
        self.address = address
        self.bind = bind
        self.replay_address = replay_address
        self.replay_timeout_s = replay_timeout_s
        self.stats = stats or EventStats()
        self.on_batch = on_batch
        self.decoder = KVEventDecoder()
        self.last: int | None = None
        self._buffer: list[DecodedBatch] | None = None  # not None while a replay is in flight
        self._replays_in_a_row = 0
        self._errors_seen = 0  # the decoder's error count already accounted for
        self._bad = 0
        self._sub: zmq.Socket | None = None
        self._watching: tuple[asyncio.AbstractEventLoop, int] | None = None  # the loop reading the socket's descriptor
        self._task: asyncio.Task[None] | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()

    # -- lifecycle
    def start(self) -> None:
        # A plain socket, read in bursts when its descriptor signals (`_run`), not zmq.asyncio's: that one makes a
        # future and a loop round per message, ~125 us of the router's CPU a batch against ~58 for the read itself,
        # and an engine sends a batch per step (measured with batches 1 ms apart, on uvloop).
        sub = zmq.Socket(self.ctx, zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # never drop on our side; the publisher's HWM is the only loss point
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if self.bind:
            sub.bind(self.address)
        else:
            sub.connect(self.address)
        self._sub = sub
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"kv-events-{self.pod}-{self.rank}-{self.publisher[2]}"
        )
        if self.replay_address is not None:
            # Catch up on what was published before we connected (replay answers from its buffer's oldest seq).
            self._begin_replay(0)

    async def stop(self) -> None:
        for t in (self._replay_task, self._task):
            if t is not None:
                t.cancel()
        for t in (self._replay_task, self._task):
            if t is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        self._task = self._replay_task = None
        self.close_socket()

    def close_socket(self) -> None:
        """Stop watching the socket's descriptor, then close the socket, in that order and at once: a closed
        descriptor's number is soon another socket's (a connection to an engine), and a reader still registered
        under it would take that socket's wakeups, or be removed later along with the new owner's."""
        self._unwatch()
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    def _unwatch(self) -> None:
        if self._watching is not None:
            loop, fd = self._watching
            self._watching = None
            with contextlib.suppress(Exception):  # the loop may be closed already
                loop.remove_reader(fd)

    async def _run(self) -> None:
        sub = self._sub
        assert sub is not None
        self.connected.set()
        loop = asyncio.get_running_loop()
        fd = sub.getsockopt(zmq.FD)
        readable = asyncio.Event()
        # ZMQ's descriptor is edge-triggered: it signals that the socket's state changed, not that a message is
        # waiting. So every wakeup reads until ZMQ says nothing is left (READ_BURST at a time, the loop's turn between
        # them), and the state is read again after the event is cleared, before waiting (a message that came in
        # between would otherwise wait for the next one).
        loop.add_reader(fd, readable.set)
        self._watching = (loop, fd)
        try:
            while True:
                try:
                    for _ in range(READ_BURST):
                        if not sub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                            break
                        self._frames(sub.recv_multipart(zmq.NOBLOCK))
                    else:
                        # More may wait: the loop's turn, then on reading (the descriptor would not signal them again).
                        await asyncio.sleep(0)
                        continue
                except zmq.Again:
                    pass
                except zmq.ZMQError as exc:
                    log.debug("KV event socket of %s/%d closed: %s", self.pod, self.rank, exc)
                    return
                readable.clear()
                if sub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    continue
                await readable.wait()
        finally:
            self._unwatch()  # a no-op when close_socket() gave the number up already

    def _frames(self, frames: list[bytes]) -> None:
        d = self.decoder.decode_frames(frames)
        if self.decoder.errors != self._errors_seen:
            self._bad_input(self.decoder.errors - self._errors_seen, self.decoder.last_error or "")
        if d is None:
            return
        if self._buffer is not None:
            if len(self._buffer) >= MAX_BUFFERED:
                log.warning("KV events of %s/%d: replay too slow, giving it up", self.pod, self.rank)
                self._cancel_replay()
                self._flush([])
            else:
                self._buffer.append(d)
                return
        self._accept(d)

    # -- ordering
    def _accept(self, d: DecodedBatch) -> None:
        """Apply one batch in sequence order, or start a replay for the ones missing before it."""
        seq = d.seq
        last = self.last
        if last is None or seq == last + 1:
            self._ingest(d)
            self._replays_in_a_row = 0
        elif seq > last + 1:
            if self.replay_address is not None and self._replays_in_a_row < MAX_REPLAYS_IN_A_ROW:
                self._begin_replay(last + 1)
                assert self._buffer is not None
                self._buffer.append(d)
                return
            self.stats.gaps += 1
            self._ingest(d)  # accepted with a hole: the index records the gap
        elif seq == last:
            self.stats.duplicates += 1
        else:
            # Backwards, outside a replay: the publisher restarted. The index sees the seq go back and forgets
            # everything this publisher told it before.
            self.stats.restarts += 1
            log.info("KV event publisher %s/%d restarted (seq %d after %d)", self.pod, self.rank, seq, last)
            self._ingest(d)

    def _bad_input(self, n: int, what: str) -> None:
        """Bad frames are counted and logged (the first, then one in BAD_FRAME_LOG_EVERY); the stream goes on."""
        self._errors_seen = self.decoder.errors
        first = self._bad == 0
        self._bad += n
        self.stats.bad_frames += n
        if first or self._bad % BAD_FRAME_LOG_EVERY < n:
            log.warning("KV events of %s/%d: %d bad frame(s) so far; last: %s", self.pod, self.rank, self._bad, what)

    def _ingest(self, d: DecodedBatch) -> None:
        try:
            self.index.ingest(self.pod, d.seq, d.batch, self.publisher)
        except Exception as exc:  # a batch that decoded but makes no sense must not end the subscription
            # Skipped, not re-asked for: a replay would bring the same batch back.
            self._bad_input(1, f"index could not apply batch {d.seq}: {type(exc).__name__}: {exc}")
            self.last = d.seq
            return
        self.last = d.seq
        self.stats.batches += 1
        if self.on_batch is not None:
            self.on_batch(self.pod, self.rank)

    # -- replay
    def _begin_replay(self, start: int) -> None:
        self._buffer = []
        self._replays_in_a_row += 1
        self._replay_task = asyncio.get_running_loop().create_task(
            self._replay(start), name=f"kv-replay-{self.pod}-{self.rank}"
        )

    def _cancel_replay(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            self._replay_task = None

    async def _replay(self, start: int) -> None:
        got: list[DecodedBatch] = []
        ok = False
        assert self.replay_address is not None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_address)
            await sock.send_multipart(replay_request(start))
            while True:
                if not await sock.poll(int(self.replay_timeout_s * 1000)):
                    log.warning("KV event replay from %s timed out", self.replay_address)
                    break
                frames = await sock.recv_multipart()
                if is_replay_end(frames):
                    ok = True
                    break
                d = self.decoder.decode_frames(frames)
                if self.decoder.errors != self._errors_seen:
                    self._bad_input(self.decoder.errors - self._errors_seen, self.decoder.last_error or "")
                if d is not None:
                    got.append(d)
        except zmq.ZMQError as exc:
            log.warning("KV event replay from %s failed: %s", self.replay_address, exc)
        finally:
            sock.close(linger=0)
        if ok:
            self.stats.replays_ok += 1
        else:
            self.stats.replays_failed += 1
        self.stats.replay_batches += len(got)
        self._replay_task = None
        self._flush(got)

    def _flush(self, replayed: list[DecodedBatch]) -> None:
        """Apply replayed batches, then the live ones buffered meanwhile, skipping what is already applied."""
        buffered = self._buffer or []
        self._buffer = None
        for d in replayed:
            if self.last is None or d.seq > self.last:
                self._ingest(d)
        for i, d in enumerate(buffered):
            if self.last is not None and d.seq <= self.last:
                continue  # the replay covered it
            self._accept(d)
            if self._buffer is not None:
                # A new gap started another replay: the rest waits behind it, in order.
                self._buffer.extend(buffered[i + 1 :])
                return
        if self._buffer is None:
            self._replays_in_a_row = 0


class KVEventHub:
    """Every pod's subscriptions, started when a pod comes up and stopped when it goes down."""

    def __init__(
        self,
        index: AnyKVIndex,
        *,
        replay_timeout_s: float = 2.0,
        on_batch: Callable[[str, int], None] | None = None,
    ) -> None:
        self.index = index
        self.ctx = zmq.asyncio.Context()
        self.replay_timeout_s = replay_timeout_s
        self.on_batch = on_batch
        self.stats = EventStats()
        self.subs: dict[str, list[RankSubscription]] = {}
        self._epoch = 0
        self._dying: set[asyncio.Task[None]] = set()

    def subscribe(self, pod: Any) -> list[RankSubscription]:
        """Start a new epoch of subscriptions for every rank of `pod` (a pods.Pod) that publishes events."""
        self.unsubscribe_now(pod.name)
        self._epoch += 1
        subs = []
        for rank in range(pod.info.dp_size):
            addr = pod.info.events_address(rank)
            if addr is None:
                continue
            sub = RankSubscription(
                self.ctx,
                self.index,
                pod.name,
                rank,
                self._epoch,
                addr[0],
                bind=addr[1],
                replay_address=pod.replay_address(rank),
                replay_timeout_s=self.replay_timeout_s,
                stats=self.stats,
                on_batch=self.on_batch,
            )
            try:
                sub.start()
            except zmq.ZMQError as exc:
                log.warning("cannot subscribe to KV events of %s/%d at %s: %s", pod.name, rank, addr[0], exc)
                continue
            subs.append(sub)
        if subs:
            self.subs[pod.name] = subs
        return subs

    def unsubscribe_now(self, name: str) -> None:
        """Stop a pod's subscriptions synchronously (tasks cancelled, sockets closed): nothing of it is applied after
        this returns, so the caller can drop the pod from the index right after."""
        for sub in self.subs.pop(name, []):
            for t in (sub._replay_task, sub._task):
                if t is not None:
                    t.cancel()
                    # Awaited at close(): a replay task owns a DEALER socket that must be closed before ctx.term().
                    self._dying.add(t)
                    t.add_done_callback(self._dying.discard)
            sub.close_socket()

    async def close(self) -> None:
        subs = [s for group in self.subs.values() for s in group]
        self.subs.clear()
        await asyncio.gather(*(s.stop() for s in subs), *self._dying, return_exceptions=True)
        self.ctx.term()
