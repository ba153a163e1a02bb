"""The engine on a thread of its own, for the asyncio server: requests go in through a queue, each
request's outputs come back to the event loop it was added from. Steps run back to back while any
request is unfinished; new requests join the next step (continuous batching)."""

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from kiln.errors import KilnError
from kiln.runtime.engine import Engine, RequestOutput
from kiln.runtime.lockstep import StepFeed
from kiln.runtime.metrics import Metrics
from kiln.runtime.sampler import SamplingParams
from kiln.runtime.scheduler import Sequence

logger = logging.getLogger(__name__)


@dataclass
class _Choices:
    """The sequences of one request (its `n` choices), for the metrics of the request as a whole."""

    n: int
    unfinished: int
    most_generated: int = 0


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    prompt_tokens: int
    max_tokens: int
    choices: _Choices
    arrival: float = field(default_factory=time.perf_counter)
    last_token: float | None = None
    first_token: float | None = None
    generated: int = 0
    scheduled: float | None = None
    """When the scheduler first admitted it into the running batch (None: not yet)."""


class EngineUnavailable(Exception):
    """The engine thread has stopped (a failed step under tensor parallelism, or shutdown): no request
    can run."""


class StepFailed(Exception):
    """A step this request was in failed (a bug, an out-of-memory): the request ends with a 500, the
    engine goes on with the others."""


class RequestFailed(Exception):
    """This request alone failed (its preparation, sampling, grammar or output raised); the others in
    its step went on. `client_error`: the request itself cannot go on (answered 400), else a failure
    inside kiln (500)."""

    def __init__(self, error: BaseException):
        self.client_error = isinstance(error, KilnError)
        detail = str(error) if self.client_error else f"{type(error).__name__}: {error}"
        super().__init__(detail if self.client_error else f"the request failed: {detail}")


class Overloaded(Exception):
    """More requests wait than the server admits (`max_queued`): answered 503 with Retry-After."""


class ShuttingDown(Exception):
    """The server is stopping: it finishes the requests it has and admits no more (503 with
    Retry-After, for the client to retry elsewhere or after the restart)."""


class RequestTimedOut(Exception):
    """The request ran past the server's request timeout and was aborted (answered 408)."""


class RequestStream:
    """One request's outputs, in order, ending with the finished one. Leaving the iteration early
    (a client that went away, or the request's deadline passing) aborts the request and frees its
    KV blocks."""

    def __init__(self, engine: "AsyncEngine", request_id: str, outputs: asyncio.Queue, deadline: float | None = None):
        self.request_id, self._engine, self._outputs = request_id, engine, outputs
        self.deadline = deadline
        """`time.monotonic()` past which the request is aborted with `RequestTimedOut`."""
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                if self.deadline is None:
                    out = await self._outputs.get()
                else:
                    try:
                        out = await asyncio.wait_for(self._outputs.get(), self.deadline - time.monotonic())
                    except TimeoutError:
                        raise RequestTimedOut(f"the request ran past the server's request timeout of "
                                              f"{self._engine.request_timeout:g} s and was stopped") from None
                if isinstance(out, BaseException):
                    raise out
                self.finished = out.finished
                yield out
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop the request if it still runs (a no-op once it finished)."""
        if not self.finished:
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: Metrics | None = None, feed: StepFeed | None = None,
                 model_name: str = "kiln", max_queued: int | None = None, request_timeout: float | None = None):
        self.engine = engine
        self.capacity = None if max_queued is None else engine.config.max_num_seqs + max_queued
        """Sequences admitted and unfinished at most (running + `max_queued` waiting); None: no limit."""
        self.request_timeout = request_timeout
        """Seconds a request may take from its arrival; None: no limit."""
        self.metrics = metrics or Metrics(model_name, engine.config.block_size, engine.scheduler.allocator.num_blocks,
                                          engine.max_model_len, engine.kv_cache_dtype)
        engine.scheduler.on_running = self._scheduled
        self._counted = self._scheduler_counts()
        """The scheduler's counters as last exported (an engine that ran before this one is not counted)."""
        self.feed = feed
        """Under tensor parallelism: where the requests each step starts with go to the other ranks."""
        self._applied: list = []  # messages applied since the last step, for the feed
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = False
        self.closing: str | None = None
        """Why new requests are refused while the admitted ones finish (a stopping server); None: open."""
        self.error: BaseException | None = None
        """Set when the engine thread stopped on a failure: the server then reports unhealthy."""
        self.on_stopped: Callable[[], None] | None = None
        """Called from the engine thread if it ends other than by `shutdown` (the server then exits, so
        that a supervisor restarts it, instead of answering 503 for ever)."""
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        if self.feed is not None and self.error is None:
            self.feed.publish([], stop=True)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_requests(self) -> int:
        """Requests added and not yet finished or aborted."""
        return len(self._streams)

    def admit(self, count: int) -> None:
        """Check that `count` more sequences fit under the capacity, from the event loop before adding
        them: `Overloaded` if not now, KilnError if never."""
        if self.capacity is None:
            return
        if count > self.capacity:
            raise KilnError(f"the request asks for {count} sequences; this server admits at most {self.capacity} "
                            "at once (max-num-seqs + max-queued-requests): ask for fewer")
        if self.num_requests + count > self.capacity:
            raise Overloaded(f"the server is at capacity ({self.num_requests} sequences running or queued, at most "
                             f"{self.capacity}): retry later")

    async def add(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
                  ) -> RequestStream:
        """Queue one request from the event loop (see `add_all`)."""
        return (await self.add_all([(prompt_token_ids, params, prompt)]))[0]

    async def add_all(self, requests: list[tuple[list[int], SamplingParams, str | None]], n: int = 1
                      ) -> list[RequestStream]:
        """Queue requests from the event loop, all or none: bad input raises KilnError here, before any
        runs. They are checked on a worker thread (a long prompt, a grammar to compile), never on the loop.
        Each `n` in a row are the choices of one client request (what its metrics count as one)."""

        def validate() -> None:
            for ids, params, _ in requests:
                self.engine.validate(ids, params)

        await asyncio.to_thread(validate)
        if not self.healthy:
            raise EngineUnavailable(f"the engine is not running ({self.error or 'shut down'})")
        if self.closing is not None:
            raise ShuttingDown(self.closing)
        self.admit(len(requests))
        loop, streams = asyncio.get_running_loop(), []
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        for i, (ids, params, prompt) in enumerate(requests):
            request_id = uuid.uuid4().hex
            if i % n == 0:
                choices = _Choices(n, n)
            stream = _Stream(loop, asyncio.Queue(), len(ids), params.max_tokens, choices)
            self._streams[request_id] = stream
            self._inbox.put(("add", request_id, list(ids), params, prompt))
            streams.append(RequestStream(self, request_id, stream.outputs, deadline))
        self._wake.set()
        return streams

    def abort(self, request_id: str) -> None:
        """Stop an unfinished request (its client left); counted as finish reason "abort"."""
        if self._streams.pop(request_id, None) is not None:
            self.metrics.finished("abort")
            self._inbox.put(("abort", request_id))
            self._wake.set()

    def close(self, reason: str) -> None:
        """Admit no more requests (each gets `ShuttingDown(reason)`); those admitted run on."""
        self.closing = reason

    def end_all(self, error: BaseException) -> int:
        """End every unfinished request with `error` (a stopping server's answer to those it could not
        finish) and free their blocks; how many there were."""
        ended = 0
        for request_id in list(self._streams):
            stream = self._streams.pop(request_id, None)
            if stream is None:  # it finished meanwhile
                continue
            ended += 1
            self.metrics.finished("abort")
            self._inbox.put(("abort", request_id))
            with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody is listening
                stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, error)
        self._wake.set()
        return ended

    # -- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._steps()
        except BaseException as e:  # a kiln bug outside any one request: nothing can be trusted to go on
            self.error = e
            logger.critical("the engine thread stopped", exc_info=e)
            for request_id in list(self._streams):
                self._deliver(request_id, EngineUnavailable(f"the engine stopped: {type(e).__name__}: {e}"))
            if self.feed is not None:
                with contextlib.suppress(Exception):
                    self.feed.publish([], stop=True)
        finally:
            if not self._stop and self.on_stopped is not None:
                self.on_stopped()

    def _steps(self) -> None:
        if self.engine.runner.device.type == "cuda":  # a new thread starts on GPU 0; Triton launches on this one
            torch.cuda.set_device(self.engine.runner.device)
        while not self._stop:
            self._drain()
            if not self.engine.has_unfinished():
                self._update_gauges()
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                if self.feed is not None:
                    self.feed.publish(self._applied)
                self._applied = []
                outputs = self.engine.step()
                self.metrics.step(self.engine.step_tokens)
            except Exception as e:  # the batch's forward: a bug or an out-of-memory
                logger.exception("engine step failed")
                if self.feed is None:  # fail the step's requests only, and go on serving the rest
                    self._fail_running(e)
                    continue
                self.error = e  # the other ranks cannot be brought back in step: stop, report unhealthy
                self.feed.publish([], stop=True)
                for request_id in list(self._streams):
                    self._deliver(request_id, EngineUnavailable(f"the engine failed: {type(e).__name__}: {e}"))
                return
            now = time.perf_counter()
            for out in outputs:
                if out.error is not None:
                    self._failed(out.request_id, out.error)
                    continue
                self._record(out, now)
                self._deliver(out.request_id, out)
            self._update_gauges()

    def _failed(self, request_id: str, error: BaseException) -> None:
        """End one request that failed alone (400 or 500); the other ranks drop it too."""
        self._applied.append(("abort", request_id))
        if request_id in self._streams:
            self.metrics.finished("error")
            self._deliver(request_id, RequestFailed(error))

    def _fail_running(self, e: Exception) -> None:
        """End every request the failed step ran (their state is suspect) with `StepFailed`; their
        blocks are freed, the waiting requests stay queued."""
        for seq in list(self.engine.scheduler.running):
            self.engine.abort(seq.request_id)
            if seq.request_id in self._streams:
                self.metrics.finished("error")
                self._deliver(seq.request_id, StepFailed(f"the step running this request failed: "
                                                         f"{type(e).__name__}: {e}"))

    def _drain(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "abort":
                self.engine.abort(message[1])
                self._applied.append(message)
                continue
            _, request_id, ids, params, prompt = message
            if request_id not in self._streams:  # aborted before it was added
                continue
            self._applied.append(message)
            try:
                self.engine.add_request(ids, params, prompt, request_id=request_id)
                self.metrics.admitted(len(ids))
            except Exception as e:  # noqa: BLE001 - this request's preparation: it fails alone
                if not isinstance(e, KilnError):
                    logger.error("request %s failed to start", request_id, exc_info=e)
                self.engine.abort(request_id)
                self._failed(request_id, e)

    def _record(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        self.metrics.token(now - stream.arrival, None if stream.last_token is None else now - stream.last_token)
        stream.last_token = now
        stream.first_token = stream.first_token or now
        stream.generated += 1
        if out.finished:
            admitted = stream.scheduled or stream.arrival
            self.metrics.finished(out.finish_reason, now - stream.arrival, stream.prompt_tokens, stream.generated,
                                  stream.first_token - admitted, now - stream.first_token, stream.max_tokens)
            choices = stream.choices
            choices.unfinished -= 1
            choices.most_generated = max(choices.most_generated, stream.generated)
            if choices.unfinished == 0:
                self.metrics.request_finished(choices.n, choices.most_generated)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        last = isinstance(item, BaseException) or item.finished  # popped in one step: `abort` pops on other threads
        stream = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    def _scheduled(self, seq: Sequence) -> None:
        """The scheduler moved `seq` from waiting to running (on the engine thread, inside the step)."""
        stream = self._streams.get(seq.request_id)
        if stream is not None and stream.scheduled is None:  # a preempted request's return is not queue time
            stream.scheduled = time.perf_counter()
            self.metrics.scheduled(stream.scheduled - stream.arrival)

    def _scheduler_counts(self) -> tuple[int, int, int]:
        scheduler = self.engine.scheduler
        return scheduler.num_preemptions, scheduler.prefix_cache_queries, scheduler.prefix_cache_hits

    def _update_gauges(self) -> None:
        scheduler = self.engine.scheduler
        self.metrics.scheduler_state(len(scheduler.running), len(scheduler.waiting), scheduler.kv_usage)
        counts = self._scheduler_counts()
        self.metrics.scheduler_counts(*(now - before for now, before in zip(counts, self._counted)))
        self._counted = counts
