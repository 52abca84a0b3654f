"""The app's compute thread: every wrapped call, from any thread, runs on one thread."""

from __future__ import annotations

import contextvars
import inspect
import threading

import pytest

from entmtp.compute_thread import ComputeThread


@pytest.fixture
def compute():
    c = ComputeThread(name="test-compute")
    yield c
    c.shutdown()


def test_calls_from_many_threads_run_on_one_thread(compute):
    seen = []
    work = compute.wrap(lambda k: seen.append((k, threading.get_ident())) or k * k)
    results = {}
    callers = [threading.Thread(target=lambda k=k: results.__setitem__(k, work(k))) for k in range(8)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert results == {k: k * k for k in range(8)}
    assert {ident for _, ident in seen} == {compute.ident}
    assert compute.ident not in {t.ident for t in callers} | {threading.get_ident()}


def test_a_call_made_on_the_thread_runs_inline(compute):
    inner = compute.wrap(lambda: threading.get_ident())
    outer = compute.wrap(lambda: (threading.get_ident(), inner()))  # would deadlock if queued behind itself
    a, b = outer()
    assert a == b == compute.ident


def test_errors_reach_the_caller(compute):
    def boom():
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        compute.wrap(boom)()
    assert compute.wrap(lambda: 3)() == 3  # the thread survives


def test_a_generator_stays_one_and_steps_on_the_thread(compute):
    log = []

    def gen(n):
        try:
            for k in range(n):
                log.append(("step", threading.get_ident()))
                yield k
        finally:
            log.append(("closed", threading.get_ident()))

    wrapped = compute.wrap(gen)
    assert inspect.isgeneratorfunction(wrapped)
    assert list(inspect.signature(wrapped).parameters) == ["n"]  # what gradio reads
    assert list(wrapped(3)) == [0, 1, 2]
    assert log and {ident for _, ident in log} == {compute.ident}

    log.clear()
    it = wrapped(10)
    assert next(it) == 0
    it.close()  # a client that goes away: the generator's own clean-up is queued on the thread
    compute.call(lambda: None)  # calls run in order: the close has run
    assert log == [("step", compute.ident), ("closed", compute.ident)]


def test_a_generator_error_reaches_the_caller(compute):
    def gen():
        yield 1
        raise RuntimeError("step failed")

    it = compute.wrap(gen)()
    assert next(it) == 1
    with pytest.raises(RuntimeError, match="step failed"):
        next(it)


def test_the_callers_context_variables_travel_with_each_call(compute):
    request = contextvars.ContextVar("request", default=None)

    def read():
        yield request.get()
        yield request.get()

    out = {}

    def caller(name):
        request.set(name)  # a web framework sets its request context per worker thread like this
        out[name] = (list(compute.wrap(read)()), compute.wrap(request.get)())

    ts = [threading.Thread(target=caller, args=(n,)) for n in ("a", "b")]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert out == {"a": (["a", "a"], "a"), "b": (["b", "b"], "b")}
    assert request.get() is None


def test_closing_a_generator_does_not_wait_for_a_busy_thread(compute):
    """A client gone mid-reply closes the wrapper from the server's event loop: that must not block
    behind a long handler (a lab search) holding the compute thread."""
    closed, release = threading.Event(), threading.Event()

    def gen():
        try:
            yield 1
            yield 2
        finally:
            closed.set()

    it = compute.wrap(gen)()
    assert next(it) == 1
    busy = compute.submit(release.wait, 10)
    it.close()  # returns at once, the thread still busy
    assert not closed.is_set()
    release.set()
    busy.result()
    compute.call(lambda: None)
    assert closed.is_set()


def test_a_stream_that_must_wait_first_says_for_what(compute):
    """A chat sent while a long labelled handler (a lab search) holds the thread yields a waiting
    update first, naming it; one sent to an idle thread does not."""
    started, release = threading.Event(), threading.Event()

    def search():
        started.set()
        release.wait(10)
        return "frontier"

    def reply():
        yield "token"

    chat = compute.wrap(reply, label="a chat reply", waiting=lambda what: f"waiting for {what}")
    assert list(chat()) == ["token"] and compute.busy_with() is None
    lab = threading.Thread(target=lambda: out.append(compute.wrap(search, label="a topology-lab search")()))
    out = []
    lab.start()
    assert started.wait(10)
    assert compute.busy_with() == "a topology-lab search"
    it = chat()
    assert next(it) == "waiting for a topology-lab search"  # at once, while the search runs
    release.set()
    assert list(it) == ["token"]
    lab.join()
    assert out == ["frontier"] and compute.busy_with() is None
