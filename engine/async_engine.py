"""`AsyncEngine`: the engine for asyncio callers (the server, the worker). Steps run on one thread.

The synchronous `LLMEngine` lives entirely on a dedicated engine thread; callers on any event loop
talk to it through a locked inbox (adds and aborts) and receive `RequestOutput` deltas on
per-request asyncio queues, fed with `loop.call_soon_threadsafe`. The thread sleeps on a condition
variable when there is nothing to run. Admission (`admit`: validation, max_tokens, grammar
compilation) happens on the caller's side before anything is queued, so a bad request raises at
once and never reaches the engine thread. A request that fails inside the engine gets
`RequestFailedError` and the engine serves on; only an error the engine cannot blame on a request
stops its thread, after which `unavailable()` says why (health checks report it). Protocol
conversion is server/'s job.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from deepserve.engine.admission import AdmittedRequest, EngineLimits
from deepserve.engine.block_manager import prompt_block_keys
from deepserve.engine.config import EngineConfig
from deepserve.engine.contract import EngineStats, KVHandOff
from deepserve.engine.errors import EngineError, InvalidRequestError, RequestFailedError
from deepserve.engine.llm_engine import LLMEngine
from deepserve.engine.outputs import EngineLoad, RequestOutput, merge_deltas
from deepserve.engine.sampling_params import SamplingParams
from deepserve.engine.step_isolation import is_fatal


@dataclass
class _PendingAdd:
    request_id: str
    admitted: AdmittedRequest


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


MAX_BLOCK_EVENTS = 100_000
# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms). The
# engine thread shares the interpreter with the server's event loop, which streams every
# token of every request; with the default, the step's host work (scheduling, the next graph's
# inputs) could wait up to 5 ms behind the loop while the GPU idles.
GIL_SWITCH_INTERVAL_S = 0.0005
# An idle engine waits for a burst of arrivals to end before its first step (`_gather_burst`):
# it ends at a pause this long between arrivals, and never lasts longer than BURST_MAX_S.
BURST_QUIET_S = 0.003
BURST_MAX_S = 0.05


class EngineDeadError(EngineError):
    """The engine thread stopped (shutdown or a crash); no more requests are served."""


class AsyncEngine:
    """The in-process `EngineClient` (engine/contract.py)."""

    def __init__(self, config: EngineConfig, loaded=None) -> None:
        self.config = config
        self._cond = threading.Condition()
        self._adds: list[_PendingAdd] = []
        self._arriving = 0  # requests being read and prepared for `generate` (`arriving`)
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable, tuple, Future]] = []  # run between steps (`_call`)
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._error: BaseException | None = None
        # Block stored/removed events for KV-aware routers, drained on the engine thread every
        # step; bounded, so an engine nobody asks keeps only the newest.
        self._block_events: collections.deque = collections.deque(maxlen=MAX_BLOCK_EVENTS)
        self._pending: list[RequestOutput] = []  # the last step's outputs (engine thread only)
        built: Future[LLMEngine] = Future()
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._thread = threading.Thread(
            target=self._run, args=(loaded, built), name="deepserve-engine", daemon=True
        )
        self._thread.start()
        self.engine = built.result()  # re-raises a load error here, in the caller
        self.tokenizer = self.engine.tokenizer
        self.model_info = self.engine.model_info
        self.card = self.engine.card()
        self._load = self.engine.load()

    # ---- caller side ----------------------------------------------------------------------

    @property
    def limits(self) -> EngineLimits:
        return self.engine.limits

    def admit(
        self, prompt_token_ids: list[int], params: SamplingParams, resume_token_ids=()
    ) -> AdmittedRequest:
        """Validate, resolve max_tokens and compile the output constraint (which can take 100+
        ms: call it off the event loop for such requests). Raises InvalidRequestError."""
        return self.engine.admit(prompt_token_ids, params, resume_token_ids)

    async def generate(
        self, request_id: str, admitted: AdmittedRequest
    ) -> AsyncIterator[RequestOutput]:
        """Stream an admitted request's deltas; leaving the iteration early aborts it."""
        self._raise_if_dead()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._cond:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
            self._adds.append(_PendingAdd(request_id, admitted))
            self._cond.notify()
        finished = False
        held: object = None  # an error read while merging, raised on the next round
        try:
            while not finished:
                item = held if held is not None else await stream.queue.get()
                item, held = _drain(stream.queue, item)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                await self.abort(request_id)

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        with self._cond:
            self._arriving += 1
        try:
            yield
        finally:
            # No notify: the request is added right after, and a wake-up now would end a burst
            # gather just before that add.
            with self._cond:
                self._arriving -= 1

    async def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step runs."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def load(self) -> EngineLoad:
        return self._load

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def hand_off_prompt(
        self, prompt_token_ids: list[int], timeout: float, cache_salt: str | None = None
    ) -> KVHandOff | None:
        """Wait (up to `timeout`) until the background write-through has put the prompt's full
        blocks in the shared tier, and write again those the store lost; the keys a decode worker
        will find them under (none when the wait timed out). None when there is no shared tier."""
        tiering = self.engine.kv_tiering
        if tiering is None or tiering.tiers.store is None:
            return None
        size = self.card.block_size
        blocks = len(prompt_token_ids) // size
        start = time.perf_counter()
        flushed = await asyncio.to_thread(tiering.tiers.drain, timeout)
        if not flushed:
            return KVHandOff(False, [], blocks, time.perf_counter() - start)
        keys = prompt_block_keys(self.card.info.fingerprint, prompt_token_ids, size, cache_salt)
        await self._rewrite_lost_blocks(keys)
        return KVHandOff(True, keys, blocks, time.perf_counter() - start)

    async def _rewrite_lost_blocks(self, keys: list[str]) -> None:
        """Write again those of the prompt's blocks the store lost (a FLUSHALL, a restart, its
        eviction) from the device pool. A repeated prompt is a device prefix hit here, so its
        blocks are never computed, hence never written through, again: without this every later
        hand-off of it would name blocks the decode worker cannot find. Costs one EXISTS round
        trip when nothing is missing; the copies are taken between steps, on the engine thread,
        where no block is reused meanwhile (one evicted since is simply not written)."""
        tiering = self.engine.kv_tiering
        lost = await asyncio.to_thread(tiering.tiers.absent_from_store, keys)
        if not lost:
            return
        cached = self.engine.block_manager.cached_block
        items = await self._call(tiering.snapshot_cached, lost, cached)
        await asyncio.to_thread(tiering.tiers.rewrite_to_store, items)

    async def _call(self, fn: Callable, *args):
        """`fn(*args)` run on the engine thread between two steps; its result or its error."""
        done: Future = Future()
        with self._cond:
            if self._stopping or self._error is not None:
                raise EngineDeadError(f"the engine is not running ({self._error or 'shut down'})")
            self._calls.append((fn, args, done))
            self._cond.notify()
        return await asyncio.wrap_future(done)

    def take_block_events(self) -> list:
        """The block manager's `BlockStored` / `BlockRemoved` events since the last call."""
        with self._cond:
            events = list(self._block_events)
            self._block_events.clear()
        return events

    async def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join)
        self.engine.close()

    def unavailable(self) -> str | None:
        """None while the engine serves; else why it cannot (crashed or shut down)."""
        if self._stopping or not self._thread.is_alive() or self._error is not None:
            return f"the engine is not running ({self._error or 'shut down'})"
        return None

    def _raise_if_dead(self) -> None:
        reason = self.unavailable()
        if reason is not None:
            raise EngineDeadError(reason)

    # ---- engine thread --------------------------------------------------------------------

    def _run(self, loaded, built: Future) -> None:
        # The engine is built on this thread, not the caller's: OpenMP (torch's CPU threads) keeps
        # one worker pool per thread that runs parallel regions, and once two pools exist libgomp
        # counts more threads than cores and stops spin-waiting; a 16-row decode step then ran
        # ~30% slower on the 2-core box than with a single pool (benchmarks/RESULTS.md).
        try:
            engine = LLMEngine(self.config, loaded)
        except BaseException as e:
            built.set_exception(e)
            return
        self._load = engine.load()
        built.set_result(engine)
        self.engine = engine
        # A step's outputs are delivered once the next step's GPU work is queued: the event loop
        # then streams them while the GPU runs, instead of contending for the GIL with the host
        # work that prepares the next step (that contention cost the step ~2.5 ms at 64 streams,
        # benchmarks/RESULTS.md). A token waits only for that preparation (a graph step's host
        # work, or an eager step's launches); when no step follows it goes at once.
        try:
            while self._take_inbox():
                outputs = self.engine.step(on_launched=self._flush)
                self._flush()  # the previous step's, when this one launched nothing
                self._load = self.engine.load()  # before delivery: a finished caller sees it freed
                self._keep_block_events()
                self._pending = outputs
                if not self.engine.has_unfinished():
                    self._flush()
            self._flush()
            self._fail_all(EngineDeadError("the engine shut down"))
        except BaseException as e:  # deliver the crash to every waiting caller, then stop
            self._error = e
            self._fail_all(e)
            raise

    def _take_inbox(self) -> bool:
        """Apply queued adds and aborts; sleep while idle. False when shutting down."""
        with self._cond:
            while not (
                self._stopping
                or self._adds
                or self._aborts
                or self._calls
                or self.engine.has_unfinished()
            ):
                self._cond.wait()
            if self._stopping:
                return False
            if self._adds and not self.engine.has_unfinished():
                self._gather_burst()
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
        for fn, args, done in calls:
            try:
                done.set_result(fn(*args))
            except Exception as e:  # the caller's failure, not the engine's
                done.set_exception(e)
        for add in adds:
            self._admit(add)
        if aborts:
            self._flush()  # an aborted request's last tokens go before its final output
        finals = [out for rid in aborts if (out := self.engine.abort(rid)) is not None]
        self._load = self.engine.load()
        for out in finals:
            self._deliver(out)
        return True

    def _gather_burst(self) -> None:
        """Hold an idle engine's first step while a burst of requests is still arriving (caller
        holds `_cond`). HTTP requests reach the engine one by one over tens of ms (each is
        parsed, tokenized and admitted on the event loop), and stepping at the first one cut
        a burst into many small eager prefill and mixed steps, each costing about what a full
        one does; that held `bench serve` at 64 streams to 0.69 of offline (benchmarks/RESULTS.md,
        run 6). The wait ends when arrivals pause for `BURST_QUIET_S` with no request still
        being prepared (`arriving`), after `BURST_MAX_S`, or once the first step is full (token
        budget or sequence slots): a lone request pays at most the quiet gap."""
        config = self.config
        deadline = time.monotonic() + BURST_MAX_S
        while not self._stopping and time.monotonic() < deadline:
            tokens = sum(len(a.admitted.prompt_token_ids) for a in self._adds)
            if tokens >= config.max_num_batched_tokens or len(self._adds) >= config.max_num_seqs:
                return
            seen = len(self._adds)
            self._cond.wait(min(BURST_QUIET_S, max(0.0, deadline - time.monotonic())))
            if len(self._adds) == seen and not self._arriving:  # nothing new, none coming
                return

    def _keep_block_events(self) -> None:
        events = self.engine.block_manager.take_events()
        if events:
            with self._cond:
                self._block_events.extend(events)

    def _admit(self, add: _PendingAdd) -> None:
        try:
            self.engine.add_admitted(add.request_id, add.admitted)
        except InvalidRequestError as e:  # e.g. a duplicate id racing another caller
            self._deliver_error(add.request_id, e)
        except Exception as e:  # admission touched no shared state: only this request fails
            if is_fatal(e):
                raise
            message = f"the engine could not admit this request: {type(e).__name__}: {e}"
            self._deliver_error(add.request_id, RequestFailedError(message))

    def _deliver(self, out: RequestOutput) -> None:
        if out.error is not None:
            self._deliver_error(out.request_id, RequestFailedError(out.error))
            return
        with self._cond:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
        if stream is not None:
            _post(stream, out)

    def _flush(self) -> None:
        outputs, self._pending = self._pending, []
        self._deliver_all(outputs)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, one wake-up per caller loop rather than one per request: each
        wake-up costs the engine thread a syscall and the GIL while the loop streams tokens."""
        posts: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        failed = []
        with self._cond:
            for out in outputs:
                if out.error is not None:
                    failed.append(out)
                    continue
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
                if stream is not None:
                    posts.setdefault(stream.loop, []).append((stream.queue, out))
        for out in failed:
            self._deliver(out)
        for loop, items in posts.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody listens
                loop.call_soon_threadsafe(_put_all, items)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        with self._cond:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            _post(stream, error)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, []
        dead = error if isinstance(error, EngineDeadError) else EngineDeadError(repr(error))
        for stream in streams.values():
            _post(stream, dead)
        for _, _, done in calls:
            done.set_exception(dead)


def _post(stream: _Stream, item: object) -> None:
    # RuntimeError: the caller's loop is closed, so nobody is listening any more.
    with contextlib.suppress(RuntimeError):
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _drain(queue: asyncio.Queue, item: object) -> tuple[object, object]:
    """`item` merged with the deltas queued behind it, and whatever non-delta ended the merge.
    Under load the loop streaming tokens falls behind the engine; one merged delta then costs it
    one chunk instead of one per step, so it catches up instead of holding the GIL that the
    engine thread needs."""
    while isinstance(item, RequestOutput) and not item.finished and not queue.empty():
        later = queue.get_nowait()
        if not isinstance(later, RequestOutput):
            return item, later
        item = merge_deltas(item, later)
    return item, None
