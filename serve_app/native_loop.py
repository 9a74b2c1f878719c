"""The native engine's own thread: the only thread that ever touches a `NativeEngine`.

NativeEngine is not thread-safe, and its step is a blocking PyTorch computation, so a
replica runs it on one dedicated thread that loops `engine.step()` while there is work and
sleeps on its command queue while there is none. Everything else reaches the engine through
that queue, between two steps:
- `submit(id, prompt, params, sink)`: add a request; `sink(RequestOutput)` is then called on
  the engine thread with each of its outputs (the last one has `finished=True`);
- `abort(id)`: cancel it (its final output, finish_reason "abort", still reaches the sink);
- `call(fn)`: run `fn(engine)` and get its result (policies, telemetry drains).
A command issued while a step runs takes effect from the next step; that is what
"a policy is in force from the next step" means for this engine.

If a step raises, the engine's state is unknown: every open request is failed, later
commands fail, and `healthy` turns False so Serve replaces the replica.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from typing import Any, Callable

import torch

from native_engine.engine import NativeEngine
from native_engine.requests import RequestOutput, SamplingParams

logger = logging.getLogger("ray.serve")

Sink = Callable[[RequestOutput | BaseException], None]  # called on the engine thread


class EngineLoop:
    """Runs one NativeEngine on one thread; other threads talk to it through commands."""

    def __init__(self, engine: NativeEngine, torch_threads: int):
        self._engine = engine
        self._torch_threads = torch_threads
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # (fn, future) | None to stop
        self._sinks: dict[str, Sink] = {}  # request id -> where its outputs go
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="adaspec-native-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._failure is None and self._thread.is_alive()

    # ------------------------------------------------------------------ commands (any thread)
    def call(self, fn: Callable[[NativeEngine], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between two steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._failure is not None:
            future.set_exception(RuntimeError(f"native engine failed: {self._failure!r}"))
        else:
            self._commands.put((fn, future))
        return future

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, sink: Sink
               ) -> concurrent.futures.Future:
        """Add a request; the future fails with the engine's ValueError if it refuses it."""
        def add(engine: NativeEngine) -> None:
            engine.add_request(request_id, prompt, params)
            self._sinks[request_id] = sink
        return self.call(add)

    def abort(self, request_id: str) -> None:
        self.call(lambda engine: engine.abort(request_id))

    def stop(self, timeout_s: float = 10) -> None:
        self._commands.put(None)
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        # Process-wide, but this thread is the only one running torch in the replica.
        torch.set_num_threads(self._torch_threads)
        while True:
            # Block for a command only when there is nothing to step.
            if not self._run_commands(block=not self._engine.has_unfinished()):
                return
            if not self._engine.has_unfinished():
                continue
            try:
                outputs = self._engine.step()
            except BaseException as e:  # noqa: BLE001 - reported to every waiting request
                logger.exception("adaspec: native engine step failed; failing %d requests", len(self._sinks))
                self._fail(e)
                return
            for out in outputs:
                sink = self._sinks.pop(out.request_id) if out.finished else self._sinks.get(out.request_id)
                if sink is not None:
                    sink(out)

    def _run_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one if `block`); False when asked to stop."""
        while True:
            try:
                item = self._commands.get(block=block)
            except queue.Empty:
                return True
            if item is None:
                self._fail(RuntimeError("native engine stopped"))
                return False
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self._engine))
                except Exception as e:  # the caller's error (e.g. a refused request)
                    future.set_exception(e)
            block = False

    def _fail(self, error: BaseException) -> None:
        self._failure = error
        for sink in self._sinks.values():
            sink(error)
        self._sinks.clear()
        while True:  # commands queued behind the failure
            try:
                item = self._commands.get(block=False)
            except queue.Empty:
                return
            if item is not None:
                item[1].set_exception(RuntimeError(f"native engine failed: {error!r}"))
