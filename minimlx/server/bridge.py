"""The bridge between the HTTP server's event loop and the decode engine's thread.

One thread steps the engine while any generation runs; requests join its batch as they arrive. Each request owns an
asyncio queue, which the engine thread fills through the event loop. A client that goes away cancels its
generations, which leave the batch at the next step. A generation running past `request_timeout` ends there with
finish_reason "length"; once draining (SIGTERM, SIGINT) the running ones end at the cutoff.
"""

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import mlx.core as mx

from ..decode import Engine, Generation, Output, Request, SamplingSettings
from ..decode.images import PromptImages
from ..errors import InvalidSettingError, PromptTooLongError, QueueFullError
from .fields import APIError, bad

log = logging.getLogger("minimlx.serve")
DRAINING = object()  # put on every request's queue when the server starts draining
T = TypeVar("T")
GATHER_QUIET, GATHER_LIMIT = 0.002, 0.02  # seconds: see EngineBridge.gather


class EngineBridge:
    """The engine, the thread that steps it, and the queues its outputs reach the event loop by.

    `request_timeout` (seconds) ends a generation running longer, as its token limit would.
    """

    def __init__(self, engine: Engine, request_timeout: float | None = None):
        self.engine, self.request_timeout = engine, request_timeout
        self.draining = False  # set on SIGTERM/SIGINT: new requests are answered 503
        self.cutoff: float | None = None  # then, when the running ones are ended
        # Every array the model holds, private ones too (RoPE's frequencies), evaluated here: an unevaluated
        # array belongs to the stream of the thread that made it, and the engine thread has its own.
        mx.eval([a for module in engine.model.modules() for a in module.values() if isinstance(a, mx.array)])
        self.listeners: dict[Generation, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.listening = threading.Lock()  # a generation is listened to before the engine thread can deliver to it
        # generations of answers dropped unread, cancelled by the engine thread: a finalizer runs wherever a garbage
        # collection happens, maybe inside this lock or the engine's, so it only queues them (deque.append is atomic)
        self.dropped = collections.deque()
        self.jobs: collections.deque = collections.deque()  # (function, its future, the future's loop): `run`
        self.stopping = False
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread that steps the engine."""
        self.stopping = False
        self.thread = threading.Thread(target=self.run_engine, name="minimlx-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """End the engine's thread (once what it is doing is done) and write the prompt cache's folder."""
        self.stopping = True
        self.engine.wake.set()
        if self.thread is not None:
            self.thread.join(timeout=10)
        if self.engine.prompt_cache is not None:
            self.engine.prompt_cache.flush()  # its folder's files written before the server says it stopped

    def run_engine(self) -> None:
        with mx.stream(mx.new_stream(mx.default_device())):  # MLX streams belong to the thread that made them
            while not self.stopping:
                self.engine.wake.wait()
                self.engine.wake.clear()
                self.run_jobs()
                self.gather()
                self.cancel_dropped()
                while self.engine.busy and not self.stopping:
                    self.cancel_dropped()
                    self.run_jobs()
                    try:
                        outputs = self.engine.step()
                    except Exception as e:  # a bug: fail the requests in flight, keep serving the next ones
                        log.exception("engine step failed")
                        self.engine.clear()
                        outputs = []
                        failure = APIError(500, f"generation failed: {e}", code="engine_error", kind="server_error")
                        for generation in list(self.listeners):
                            self.deliver(generation, failure)
                    for output in outputs:
                        self.deliver(output.generation, output)
                mx.clear_cache()  # idle: MLX's freed buffers go back to the system, so memory stays flat
            if self.engine.compiled:  # traces made on this thread's stream must not outlive it (CompiledDecoder.forget)
                self.engine.decoder.forget()

    async def run(self, function: Callable[[], T]) -> T:
        """`function()` computed on the engine's thread between two steps (embeddings: the model's other use), so
        that it never runs beside a step; its result or exception comes back to the event loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.jobs.append((function, future, loop))
        self.engine.wake.set()
        return await future

    def run_jobs(self) -> None:
        while self.jobs:
            function, future, loop = self.jobs.popleft()
            try:
                result = function()
            except Exception as e:
                loop.call_soon_threadsafe(settle, future, None, e)
            else:
                loop.call_soon_threadsafe(settle, future, result, None)

    def gather(self) -> None:
        """Before an idle engine starts: wait while requests keep arriving (each within GATHER_QUIET seconds of the
        last, GATHER_LIMIT at most). Requests sent together reach the engine one by one, as the event loop reads and
        tokenizes each; gathered, they prefill as one group (one pass over the weights) and their first tokens come
        together, where the first alone would be prefilled while the others wait for it."""
        deadline, waiting = time.monotonic() + GATHER_LIMIT, len(self.engine.waiting)
        while waiting and time.monotonic() < deadline:
            time.sleep(GATHER_QUIET)
            if len(self.engine.waiting) == waiting:
                return
            waiting = len(self.engine.waiting)

    def deliver(self, generation: Generation, item) -> None:
        with self.listening:
            listener = self.listeners.get(generation)
        if listener is not None:
            loop, queue = listener
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def submit(
        self,
        prompt: list[int],
        settings: SamplingSettings,
        n: int,
        param: str,
        cache_key: str | None = None,
        adapter: str | None = None,
        images: PromptImages | None = None,
    ) -> tuple[list[Generation], asyncio.Queue]:
        """Start `n` generations of `prompt` (the request's field `param`, holding `images`), with the engine's
        `adapter` (None: the base model); their outputs come on the returned queue."""
        queue, generations = asyncio.Queue(), []
        try:
            for _ in range(n):
                with self.listening:
                    request = Request(prompt, settings, cache_key=cache_key, adapter=adapter, images=images)
                    generation = self.engine.submit(request)
                    self.listeners[generation] = (asyncio.get_running_loop(), queue)
                generations.append(generation)
        except QueueFullError as e:
            self.cancel(generations)
            raise APIError(429, str(e), code="rate_limit_exceeded", kind="rate_limit_error") from e
        except PromptTooLongError as e:
            self.cancel(generations)
            raise APIError(400, str(e), param, "context_length_exceeded") from e
        except InvalidSettingError as e:  # a setting only the engine can check (a logit_bias id past the vocabulary)
            self.cancel(generations)
            raise bad(e.field, str(e)) from e
        return generations, queue

    def drain(self, grace: float) -> None:
        """Answer new requests 503 and end the running ones (finish_reason "length") `grace` seconds from now."""
        self.draining, self.cutoff = True, time.monotonic() + grace
        with self.listening:
            listeners = list(self.listeners.values())
        for loop, queue in listeners:
            loop.call_soon_threadsafe(queue.put_nowait, DRAINING)

    def cancel_dropped(self) -> None:
        while self.dropped:
            self.cancel(self.dropped.popleft())

    def cancel(self, generations: list[Generation]) -> None:
        for generation in generations:
            self.engine.cancel(generation)
            with self.listening:
                self.listeners.pop(generation, None)

    async def outputs(
        self, generations: list[Generation], queue: asyncio.Queue, heartbeat: float | None = None
    ) -> AsyncIterator[Output | None]:
        """Every output of `generations` until all have finished; cancels them if the consumer stops early. At
        `request_timeout` the ones still running end with finish_reason "length", as at their token limit. With a
        `heartbeat` (seconds), None comes whenever that long passed without an output (a long prefill): streams
        send a keep-alive then, so that clients and proxies do not take the silence for a dead connection."""
        running = len(generations)
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        try:
            while running:
                ends = [t for t in (deadline, self.cutoff) if t is not None]
                left = max(min(ends) - time.monotonic(), 0) if ends else None
                wait = left if heartbeat is None else heartbeat if left is None else min(left, heartbeat)
                try:
                    item = await asyncio.wait_for(queue.get(), wait)
                except TimeoutError:
                    if left is None or wait < left:
                        yield None
                        continue
                    log.warning("a request ran past --request-timeout or --shutdown-timeout; ended")
                    for generation in generations:
                        if generation.finish_reason is None:
                            self.engine.cancel(generation)
                            yield Output(generation, -1, "", "length")
                    return
                if item is DRAINING:  # the cutoff was just set: wait again, until it
                    continue
                if isinstance(item, APIError):
                    raise item
                if item.finish_reason == "error":  # this request's own step failed; the others go on
                    failure = item.generation.failure
                    log.error("a generation failed", exc_info=failure)
                    message = f"generation failed: {type(failure).__name__}: {failure}"
                    raise APIError(500, message, code="engine_error", kind="server_error")
                running -= item.finish_reason is not None
                yield item
        finally:
            self.cancel(generations)


def settle(future: asyncio.Future, result, error: Exception | None) -> None:
    """Resolve `future` (on its loop), unless its awaiter has gone (a client that hung up)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
