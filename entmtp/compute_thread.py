"""One long-lived thread for all of a server's model work.

torch's Linux CPU wheels use GNU OpenMP (libgomp). Every thread that starts a parallel region gets
an OpenMP team of its own, and while the process has more OpenMP threads alive than CPUs, libgomp
cuts its spin-waiting to ~100 iterations for every team: each parallel region then wakes its
workers through the kernel. A web server runs its handlers in a pool of worker threads, so once two
of them have run a model, every layer of every decoding step pays that wake-up: on a 2-core Xeon
plain decoding fell from 68 to 35 tokens/s while a second live thread had run one torch operation
(`python scripts/openmp_teams.py`; docs/performance.md, "One thread runs the models").

So the app runs every handler that touches a model on one thread (`ComputeThread.wrap`): the
process keeps one OpenMP team for its life. Handlers queue there in arrival order; a streaming
handler (a generator) yields between its steps, so two chats interleave step by step.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

_END = object()
log = logging.getLogger(__name__)


def _log_failure(done: Future) -> None:
    if done.exception() is not None:
        log.warning("closing a handler on the compute thread failed: %s", done.exception())


class ComputeThread:
    """A single worker thread, started on first use. `call` runs a function there and returns its
    result (or raises its exception) in the caller; called on the thread itself, it runs inline.
    The caller's context variables (e.g. the web framework's request context, which its warnings
    need) travel with each call."""

    def __init__(self, name: str = "entmtp-compute"):
        self.name = name
        self._executor: Optional[ThreadPoolExecutor] = None
        self._ident: Optional[int] = None
        self._lock = threading.Lock()
        self._running: Optional[str] = None  # the label of the wrapped handler running now

    @property
    def ident(self) -> Optional[int]:
        """The thread's `threading.get_ident()` (None before its first use)."""
        return self._ident

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
                self._ident = self._executor.submit(threading.get_ident).result()
            return self._executor

    def on_thread(self) -> bool:
        return self._ident is not None and threading.get_ident() == self._ident

    def busy_with(self) -> Optional[str]:
        """The label of the wrapped handler the thread runs now (None: idle, or no label)."""
        return self._running

    def _labelled(self, label: Optional[str], fn: Callable[..., Any]) -> Callable[..., Any]:
        if label is None:
            return fn

        def run(*args, **kwargs):
            outer, self._running = self._running, label
            try:
                return fn(*args, **kwargs)
            finally:
                self._running = outer
        return run

    def submit(self, fn: Callable[..., Any], *args, **kwargs) -> Future:
        """Queue `fn(*args, **kwargs)` on the thread; its future."""
        ctx = contextvars.copy_context()
        return self._pool().submit(ctx.run, fn, *args, **kwargs)

    def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """`fn(*args, **kwargs)` run on the thread; waits for it."""
        if self.on_thread():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def wrap(self, fn: Callable[..., Any], label: Optional[str] = None,
             waiting: Optional[Callable[[str], Any]] = None) -> Callable[..., Any]:
        """`fn` made to run on the thread, keeping its signature (for frameworks that inspect it).
        A generator function stays one: each of its steps runs on the thread, and closing the
        wrapper queues the generator's close there. label: what `busy_with` says while `fn` runs
        (e.g. "a topology-lab search"). waiting(label) -> a first item a generator yields when it
        has to wait for another labelled handler, so its page says why nothing moves yet."""
        if inspect.isgeneratorfunction(fn):
            step = self._labelled(label, next)

            @functools.wraps(fn)
            def steps(*args, **kwargs):
                gen = fn(*args, **kwargs)  # runs none of its code yet
                try:
                    other = self.busy_with() if waiting is not None and not self.on_thread() else None
                    if other is not None:
                        yield waiting(other)
                    while True:
                        item = self.call(step, gen, _END)
                        if item is _END:
                            return
                        yield item
                finally:
                    # queued, not waited for: a client that went away can close the wrapper from the
                    # server's event loop, which must not block behind a long handler here
                    if self.on_thread():
                        gen.close()
                    else:
                        self.submit(gen.close).add_done_callback(_log_failure)
            return steps

        run = self._labelled(label, fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            return self.call(run, *args, **kwargs)
        return call

    def shutdown(self) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._executor, self._ident = None, None


COMPUTE = ComputeThread()  # the app's: one per process, like the OpenMP team it protects

__all__ = ["ComputeThread", "COMPUTE"]
