"""OpenMP waiting and torch's CPU threads: the policy set before torch is imported, the count
measured per machine, and a governor that gives up the extra threads while another process uses
the cores.

OpenMP's default is to spin-wait between parallel regions. Decoding a small model is thousands
of short regions a second: with spinning threads on an idle 2-core CPU a forward of SmolLM2-135M
takes ~12 ms instead of ~15 ms with one thread, and a tree's extra rows cost half as much
(`python scripts/rows_by_threads.py`); with passive waiting two threads are slower than one
(~20 ms). But when another process holds one of the cores, every region waits for the thread
that shares it: plain decoding fell from ~110 to ~35 tok/s with 2 spinning threads, while one
thread made ~71 idle and busy alike (`python scripts/busy_neighbour.py`).

So where the kernel reports how busy each core is (Linux `/proc/stat`), entmtp leaves OpenMP's
own waiting (spin, then sleep) and decodes with the measured thread count while the process's
cores are its own, with one thread while other processes use them (`ThreadGovernor`, checked
every few steps). Elsewhere it asks for passive waiting (`OMP_WAIT_POLICY=PASSIVE`) and one
thread unless all of them are much faster (`entmtp.tuning`). `OMP_WAIT_POLICY`, `ENTMTP_THREADS`
and `ENTMTP_ADAPTIVE_THREADS=0` override.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Optional

DEFAULT_WAIT_POLICY = "PASSIVE"  # where the threads cannot follow the load of the cores
# the policy the environment asked for before entmtp set its default (None: OpenMP's own), for
# processes that should wait as a plain transformers program does (`entmtp.stock_process`)
USER_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")
BUSY_CORES = 0.3  # other processes using at least this many of our cores: decode with one thread
GOVERNOR_INTERVAL_S = 0.2  # how often the governor reads the load (a few decoding steps)


def _our_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def adaptive_threads_possible() -> bool:
    """Whether the thread count can follow the load of this process's cores: Linux's per-core
    counters are readable, the process may run on more than one core, and neither
    ENTMTP_THREADS nor ENTMTP_ADAPTIVE_THREADS=0 fixes the count."""
    if os.environ.get("ENTMTP_ADAPTIVE_THREADS", "1").strip() == "0" or os.environ.get("ENTMTP_THREADS", "").strip():
        return False
    return len(_our_cpus()) > 1 and CoreLoad().sample() is not None


def configure_wait_policy() -> str | None:
    """Choose OpenMP's waiting before torch loads it, unless OMP_WAIT_POLICY is set: OpenMP's own
    (spinning, then sleeping) where the thread count can follow the load of the cores
    (`adaptive_threads_possible`), else passive. Returns the policy in force ("default" for
    OpenMP's own), or None when torch was imported first (whatever it started with holds)."""
    if "OMP_WAIT_POLICY" in os.environ:
        return os.environ["OMP_WAIT_POLICY"]
    if "torch" in sys.modules:
        return None
    if adaptive_threads_possible():
        return "default"
    os.environ["OMP_WAIT_POLICY"] = DEFAULT_WAIT_POLICY
    return DEFAULT_WAIT_POLICY


# worker processes this process runs work in (`stock_process`: `generate` timed beside our loop):
# their CPU time is ours, not a neighbour's, or every run of ours after one of theirs would start
# on one thread
_WORKERS: set[int] = set()


def count_as_own(pid: int) -> None:
    """Count process `pid`'s CPU time as this process's in `CoreLoad` (until `forget_worker`)."""
    _WORKERS.add(int(pid))


def forget_worker(pid: int) -> None:
    _WORKERS.discard(int(pid))


def process_cpu_seconds(pid: int, proc_root: str = "/proc") -> Optional[float]:
    """User + system CPU seconds of process `pid` from `/proc/<pid>/stat` (None: gone or unreadable)."""
    try:
        with open(os.path.join(proc_root, str(pid), "stat")) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def own_cpu_seconds(workers: Optional[set[int]] = None, proc_root: str = "/proc") -> float:
    """CPU seconds of this process and of its registered workers (`count_as_own`); a worker that
    has ended is dropped from the set."""
    workers = _WORKERS if workers is None else workers
    total = sum(os.times()[:2])
    for pid in list(workers):
        t = process_cpu_seconds(pid, proc_root)
        if t is None:
            workers.discard(pid)
        else:
            total += t
    return total


class CoreLoad:
    """How much of this process's cores other processes (or, on a VM, the host) used, from the
    kernel's per-core counters (`/proc/stat`) less the CPU time of this process and its workers
    (`own_cpu_seconds`)."""

    def __init__(self, cpus: Optional[list[int]] = None, stat_path: str = "/proc/stat",
                 cpu_time=own_cpu_seconds, clock=time.monotonic):
        self.cpus = cpus if cpus is not None else _our_cpus()
        self.stat_path, self.cpu_time, self.clock = stat_path, cpu_time, clock  # the last two: this process's
        self._last = self.sample()

    def sample(self) -> Optional[tuple[float, float, float]]:
        """(busy seconds of our cores since boot, this process's CPU seconds, monotonic time), or
        None where the counters cannot be read."""
        try:
            with open(self.stat_path) as f:
                lines = f.read().splitlines()
            tick = os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            return None
        want = {f"cpu{i}" for i in self.cpus}
        busy = 0
        seen = 0
        for line in lines:
            parts = line.split()
            if parts and parts[0] in want and len(parts) >= 8:
                # user nice system idle iowait irq softirq steal: all but idle and iowait are busy
                v = [int(x) for x in parts[1:9]]
                busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
                seen += 1
        if not seen:
            return None
        return busy / tick, self.cpu_time(), self.clock()

    def others(self) -> Optional[float]:
        """Cores' worth of CPU other processes used since the previous call (None: unreadable)."""
        now = self.sample()
        last, self._last = self._last, now
        if now is None or last is None or now[2] - last[2] <= 0:
            return None
        return max(0.0, ((now[0] - last[0]) - (now[1] - last[1])) / (now[2] - last[2]))


def busy_note(load: Optional[CoreLoad], what: str) -> Optional[str]:
    """Why a measurement that began when `load` was made must not be kept: other processes (or
    the host) used at least BUSY_CORES of this process's cores on average meanwhile, so its step
    times are another machine's -- or None (a quiet machine, or counters that cannot be read)."""
    others = load.others() if load is not None else None
    if others is None or others < BUSY_CORES:
        return None
    return (f"{what} measured while other processes used {others:.1f} cores' worth of this machine: "
            "not cached, measured again at the next load")


class ThreadGovernor:
    """Decode with `wide` torch threads while this process's cores are its own, with one while
    other processes use at least `busy` cores' worth of them (one thread never waits on a core
    another process holds). The load is read at most every `interval` seconds."""

    def __init__(self, wide: int, load: Optional[CoreLoad] = None, interval: float = GOVERNOR_INTERVAL_S,
                 busy: float = BUSY_CORES):
        self.wide, self.load, self.interval, self.busy = wide, load or CoreLoad(), interval, busy
        self.current = wide
        self.others: Optional[float] = None  # the last reading
        self._t = time.monotonic()

    def threads(self) -> int:
        """The count to decode the next step with."""
        now = time.monotonic()
        if now - self._t >= self.interval:
            self._t = now
            others = self.load.others()
            if others is not None:
                self.others = others
                self.current = 1 if others >= self.busy else self.wide
        return self.current

    def apply(self) -> int:
        """Set torch's threads to `threads()` (when it changed); returns the count."""
        import torch

        n = self.threads()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n


def threads_override() -> int | None:
    """ENTMTP_THREADS (a positive int) when set: the thread count, not measured. ValueError otherwise."""
    v = os.environ.get("ENTMTP_THREADS", "").strip()
    if not v:
        return None
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"ENTMTP_THREADS={v!r} must be a positive integer")
    return int(v)


def default_threads() -> int:
    """The thread count torch starts with here (OMP_NUM_THREADS, else the cores)."""
    v = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(v) if v.isdigit() and int(v) > 0 else (os.cpu_count() or 1)


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run the block with torch's CPU thread count at `n` (None: as it is), then restore it."""
    import torch

    old = torch.get_num_threads()
    if n and n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)


__all__ = ["DEFAULT_WAIT_POLICY", "USER_WAIT_POLICY", "BUSY_CORES", "adaptive_threads_possible", "configure_wait_policy",
           "count_as_own", "forget_worker", "process_cpu_seconds", "own_cpu_seconds", "CoreLoad", "busy_note", "ThreadGovernor", "threads_override", "default_threads", "torch_threads"]
