"""transformers' own decoding (`generate`, and its prompt lookup) in a process of its own.

entmtp's process waits passively in OpenMP (`entmtp.threads`), which suits our kernels and a
busy neighbour core but slows transformers' stock kernels on an idle machine (bf16 `generate`
about 1.24x slower on a 2-core AVX-512-bf16 EPYC: `scripts/generate_wait_policy.py`). A user
who runs `generate` runs it in a process of its own with OpenMP's defaults, so the bench times it
that way: a worker process that imports torch before entmtp (OpenMP then keeps its default
spinning), loads the same model, picks its own fastest thread count, and decodes on request,
interleaved with our methods in the parent. One JSON line per request and per answer.

    with StockProcess(ModelOptions(model="default", dtype="bfloat16")) as stock:
        out = stock.decode("hf", ids, max_new_tokens=128)    # methods.Output
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
from typing import Optional

from .methods import ModelOptions, Output
from .threads import USER_WAIT_POLICY, count_as_own, forget_worker

PREFIX = "@@entmtp-stock "  # marks the worker's answers among anything else it prints

# torch first: OpenMP reads its wait policy once, when torch loads it, and `import entmtp` would
# otherwise set passive waiting
WORKER = """
import torch
import entmtp.stock_process as sp
sp.serve()
"""



def where_stock_ran(info: Optional[dict], threads: Optional[int] = None) -> str:
    """Where transformers' methods ran, in the words both the bench report and the app's Race use:
    `info` is a worker's load answer (`StockProcess.info`), None when they ran in this process."""
    if info is None:
        return "in this process" + (f", {threads} thread{'s' if threads != 1 else ''}" if threads else "")
    n = threads or info.get("threads", "?")
    return f"in a process of their own (OpenMP waiting {info.get('wait_policy', '?')}, {n} thread{'s' if n != 1 else ''})"

class StockProcessError(RuntimeError):
    """The worker could not start, or failed a request (its message is the worker's one line)."""


class StockProcess:
    """A worker decoding with transformers' methods (`hf`, `pld`) on the model `opts` names.

    Environment of the worker: OMP_WAIT_POLICY as the environment had it before entmtp set its
    default (`threads.USER_WAIT_POLICY`; unset: OpenMP's own), no ENTMTP_THREADS, no tuning
    probe (stock kernels only)."""

    def __init__(self, opts: ModelOptions, wait_policy: Optional[str] = USER_WAIT_POLICY):
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "ENTMTP_THREADS")}
        if wait_policy:
            env["OMP_WAIT_POLICY"] = wait_policy
        env["ENTMTP_TUNE"] = "0"
        self._lock = threading.Lock()
        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=env, text=True, bufsize=1)
        count_as_own(self.proc.pid)  # its CPU is ours to the thread governor, not a busy neighbour's
        try:
            self.info = self._ask({"op": "load", "opts": dataclasses.asdict(opts)})
        except BaseException:
            self.close()
            raise

    def _ask(self, request: dict) -> dict:
        with self._lock:  # one request at a time (the app's sessions share a worker)
            return self._ask_unlocked(request)

    def _ask_unlocked(self, request: dict) -> dict:
        if self.proc.poll() is not None:
            raise StockProcessError(f"the generate process has ended{self._last_log_line()}")
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise StockProcessError(f"the generate process has ended{self._last_log_line()}") from None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise StockProcessError(f"the generate process ended{self._last_log_line()}")
            if line.startswith(PREFIX):
                answer = json.loads(line[len(PREFIX):])
                if "error" in answer:
                    raise StockProcessError(answer["error"])
                return answer

    def _last_log_line(self) -> str:
        self._log.seek(0)
        lines = [s for s in self._log.read().splitlines() if s.strip()]
        return f": {lines[-1].strip()}" if lines else ""

    def decode(self, method: str, ids: list[int], max_new_tokens: int, pld_tokens: int = 10) -> Output:
        """`method` ("hf" or "pld") on prompt `ids`, greedy, in the worker."""
        a = self._ask({"op": "decode", "method": method, "ids": list(ids), "max_new_tokens": max_new_tokens,
                       "pld_tokens": pld_tokens})
        return Output(a["tokens"], a["forwards"])

    def fit_threads(self, method: str, ids: list[int], max_new_tokens: int, pld_tokens: int = 10) -> int:
        """The worker's fastest thread count for `method` (1 or all cores), kept for its later decodes."""
        return int(self._ask({"op": "fit", "method": method, "ids": list(ids), "max_new_tokens": max_new_tokens,
                              "pld_tokens": pld_tokens})["threads"])

    def close(self) -> None:
        forget_worker(self.proc.pid)
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # the worker's loop ends at end of input
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> "StockProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve() -> None:
    """The worker's loop: one JSON request per stdin line, one answer per stdout line (PREFIX)."""
    import torch

    from .methods import Runner, fit_stock_threads, get_method, load_engine_for

    def answer(d: dict) -> None:
        sys.stdout.write(PREFIX + json.dumps(d) + "\n")
        sys.stdout.flush()

    engine, threads = None, {}
    for line in sys.stdin:
        try:
            req = json.loads(line)
            if req["op"] == "load":
                # stock kernels, no heads, and the thread count fitted here rather than the parent's
                opts = ModelOptions(**{**req["opts"], "kernels": "stock", "heads": None, "threads": 0})
                engine = load_engine_for(opts, ["hf"], progress=None)
                answer({"wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"), "threads": torch.get_num_threads(),
                        "pid": os.getpid()})
                continue
            if engine is None:
                raise RuntimeError("no model loaded")
            runner = Runner(get_method(req["method"]), engine, req["max_new_tokens"], pld_tokens=req["pld_tokens"],
                            threads=threads.get(req["method"]))
            if req["op"] == "fit":
                threads[req["method"]] = fit_stock_threads(runner, req["ids"])  # None on a GPU
                answer({"threads": threads[req["method"]] or torch.get_num_threads()})
            else:
                out = runner(req["ids"])
                answer({"tokens": out.tokens, "forwards": out.forwards})
        except Exception as exc:  # noqa: BLE001  one line back to the parent, which raises it there
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            answer({"error": f"generate process: {msg}"})


__all__ = ["StockProcess", "StockProcessError", "serve", "where_stock_ran"]
