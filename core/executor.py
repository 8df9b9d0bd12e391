"""Executors: how a step reaches the model runner(s), between the decoder and the runner.

- ``uniproc``: today's one runner, called on the engine's step thread.
- ``multiproc``: one process per tensor-parallel rank (core/parallel.py). Rank 0 is the
  engine's own process: it schedules, turns each batch into a :class:`StepPlan` and
  broadcasts it; every rank runs the plan (the model's all-reduces keep them in step) and
  rank 0 gets the gathered logits, samples and verifies. Ranks 1..N-1 are started as
  ``python -m tokenloom.core.executor`` processes and rendezvous over TCP on this machine, or, under
  ``torchrun``, are the other processes torchrun started (on this machine or others) with
  the rendezvous torchrun provides: the same code path after ``init_process_group``.

Commands go out on a group of their own (:class:`Groups`), on which the other ranks wait
as long as the engine idles; the model's collectives run on a third group. Rank 0's
waits on both are bounded by ``engine.distributed_timeout_s``: that bounds how long a hung
rank can stall a step. Any
failure in a tensor-parallel step leaves the ranks out of step, so it is final: the
executor raises :class:`ExecutorFailed`, the engine ends every request with an error and
reports itself dead (core/health.py), and a supervisor restarts the server. A rank that
exits is noticed at once (its socket closes, and a watcher thread names its exit code, which
the engine's health reports even while it idles); a rank that hangs, within the timeout.
These bounds hold on gloo. On NCCL a collective does not fail on rank 0's thread: a dead or
hung GPU rank is caught by NCCL's own watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), which
ends the process — a supervisor restarts it either way.

Ranks run only the operations in :data:`RANK_OPS`. Under torchrun a process hosts one
engine: the other ranks leave when it closes.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import structlog
import torch

from tokenloom.core.interfaces import AdapterInfo
from tokenloom.core.parallel import TensorParallel
from tokenloom.core.runner import ForwardOutput, HiddenRows, ModelRunner, forward_output
from tokenloom.core.sequence import Batch

if TYPE_CHECKING:  # torch.distributed is imported where it is used
    from torch.distributed import ProcessGroup

log = structlog.get_logger("tokenloom.executor")

#: commands wait on their own group: an idle engine sends nothing for as long as it likes
COMMAND_TIMEOUT = timedelta(days=365)


class ExecutorFailed(RuntimeError):
    """A rank died, hung past the timeout or failed a step: the group cannot go on.
    ``public``: what a client may read (no addresses or paths)."""

    def __init__(self, detail: str, public: str):
        super().__init__(detail)
        self.public = public


#: what rank 0 may ask the other ranks to run (a ModelRunner method each)
RANK_OPS = ("execute", "move_kv_slots", "allocate_kv_cache", "prefill_logits", "prefill_hidden")


class UniprocExecutor:
    """The runner in this process; every call goes straight to it."""

    name = "uniproc"
    world_size = 1
    failed: str | None = None  # why the ranks cannot go on (never, with one)

    def __init__(self, runner: ModelRunner):
        self.driver = runner

    def forward(self, batch: Batch, *, return_hidden: HiddenRows = False) -> ForwardOutput:
        return self.driver.forward(batch, return_hidden=return_hidden)

    def move_kv_slots(self, src: list[int], dst: list[int]) -> None:
        self.driver.move_kv_slots(src, dst)

    def allocate_kv_cache(self, num_blocks: int, kv_cache_dtype: str = "auto") -> None:
        self.driver.allocate_kv_cache(num_blocks, kv_cache_dtype)

    def prefill_logits(self, token_ids: list[int], block_table: list[int],
                       adapter: str | None = None) -> torch.Tensor | None:
        return self.driver.prefill_logits(token_ids, block_table, adapter)

    def prefill_hidden(self, token_ids: list[int], block_table: list[int], adapter: str | None = None) -> torch.Tensor:
        return self.driver.prefill_hidden(token_ids, block_table, adapter)

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        return self.driver.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        self.driver.unload_adapter(name)

    def adapters(self) -> list[AdapterInfo]:
        """The adapters rank 0 knows (every rank holds the same ones)."""
        return self.driver.adapters.adapters() if self.driver.adapters is not None else []

    def close(self) -> None:
        pass


class MultiprocExecutor(UniprocExecutor):
    """Rank 0's side of a tensor-parallel group. ``workers``: the processes this engine
    started (empty under torchrun, which owns them)."""

    name = "multiproc"

    def __init__(self, runner: ModelRunner, tp: TensorParallel, command_group: ProcessGroup,
                 workers: list[subprocess.Popen], timeout_s: float, failed: str | None = None,
                 threads_before: int | None = None):
        super().__init__(runner)
        self.tp, self.command_group, self.workers, self.timeout_s = tp, command_group, workers, timeout_s
        self.world_size = tp.world_size
        self.failed = failed  # why the group cannot go on
        self._public = "a tensor-parallel rank failed"
        self._closing = False
        self._threads_before = threads_before  # restored on close (rank 0 ran with its share)
        if workers and failed is None:
            self._watch()

    def _watch(self) -> None:
        for rank, proc in enumerate(self.workers, start=1):
            threading.Thread(target=self._watch_one, args=(rank, proc), name=f"tokenloom-rank{rank}-watch",
                             daemon=True).start()

    def _watch_one(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._closing and self.failed is None:
            self.failed = self._public = f"tensor-parallel rank {rank} exited (code {code})"
            log.error("rank_exited", rank=rank, exitcode=code)

    def _run(self, op: str, *args):
        """Send ``op`` to every other rank, then run it here; any failure is final."""
        if self.failed is not None:
            raise ExecutorFailed(self.failed, self._public)
        import torch.distributed as dist

        try:
            dist.broadcast_object_list([(op, args)], src=0, group=self.command_group)
            return rank_op(self.driver, op)(*args)
        except Exception as exc:
            if self.failed is None:
                gone = self._exited(wait_s=1.0)  # a closed socket usually means a dead rank: name it
                if gone is not None:
                    self.failed = self._public = gone
                else:
                    self.failed = f"tensor-parallel step failed on rank 0: {type(exc).__name__}: {exc}"[:300]
                    self._public = "a tensor-parallel collective failed or timed out"
            raise ExecutorFailed(self.failed, self._public) from exc

    def _exited(self, wait_s: float) -> str | None:
        end = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.workers, start=1):
                if proc.poll() is not None:
                    return f"tensor-parallel rank {rank} exited (code {proc.returncode})"
            if time.monotonic() >= end:
                return None
            time.sleep(0.05)

    def forward(self, batch: Batch, *, return_hidden: HiddenRows = False) -> ForwardOutput:
        plan, seqs, counts = self.driver.plan(batch)
        logits, hidden = self._run("execute", plan, return_hidden)
        return forward_output(plan, seqs, counts, logits, hidden, return_hidden)

    def move_kv_slots(self, src: list[int], dst: list[int]) -> None:
        self._run("move_kv_slots", src, dst)

    def allocate_kv_cache(self, num_blocks: int, kv_cache_dtype: str = "auto") -> None:
        self._run("allocate_kv_cache", num_blocks, kv_cache_dtype)

    def prefill_logits(self, token_ids: list[int], block_table: list[int],
                       adapter: str | None = None) -> torch.Tensor | None:
        return self._run("prefill_logits", token_ids, block_table, adapter)

    def prefill_hidden(self, token_ids: list[int], block_table: list[int], adapter: str | None = None) -> torch.Tensor:
        return self._run("prefill_hidden", token_ids, block_table, adapter)

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Every rank reads the adapter (its own share); a rank that cannot fails the group."""
        return self._run("load_adapter", name, path)

    def unload_adapter(self, name: str) -> None:
        self._run("unload_adapter", name)

    def close(self) -> None:
        """Stop every rank (they leave their loop), then reap what this engine started."""
        if self._closing:
            return
        self._closing = True
        stop_group(self.command_group, self.workers, healthy=self.failed is None, threads_before=self._threads_before)


def stop_group(command_group: ProcessGroup, workers: list[subprocess.Popen], *, healthy: bool,
               threads_before: int | None) -> None:
    """Rank 0 ends a group: a healthy group's ranks hear "stop" and leave their loop; the
    processes this engine started are reaped (a failed group's may hang: killed sooner);
    this process gets its thread count back. Also for a group that failed before it had an
    executor (a rank could not load the model)."""
    import torch.distributed as dist

    if healthy:
        try:
            dist.broadcast_object_list([("stop", ())], src=0, group=command_group)
        except Exception as exc:  # noqa: BLE001 - closing anyway
            log.warning("rank_stop_failed", error=str(exc))
    for proc in workers:
        try:
            proc.wait(timeout=10 if healthy else 0.5)  # a failed group's ranks may hang
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    if threads_before:
        torch.set_num_threads(threads_before)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - already torn down
        pass


# ---- starting a group ------------------------------------------------------------------
def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun, else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ):
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True, slots=True)
class Groups:
    """The process groups of a tensor-parallel engine, made in this order on every rank.
    A group's timeout is each process's own: rank 0 waits at most ``timeout_s`` to hand out
    a command, while the other ranks wait for the next one as long as the engine idles."""

    startup: ProcessGroup  # loading reports: a large model may load for longer than a step's timeout
    commands: ProcessGroup  # rank 0 -> the others: what to run next (gloo)
    model: ProcessGroup  # the model's collectives (gloo on CPUs, NCCL on GPUs), bounded by timeout_s


def init_group(rank: int, world: int, init_method: str, timeout_s: float, device: torch.device) -> Groups:
    """Join the default process group and make :class:`Groups` (explicit timeouts on each:
    a process that joined an earlier default group keeps that group's)."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    bounded = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=bounded)
    startup = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    commands = dist.new_group(backend="gloo", timeout=bounded if rank == 0 else COMMAND_TIMEOUT)
    return Groups(startup, commands, dist.new_group(backend=backend, timeout=bounded))


def rank_op(runner: ModelRunner, op: str):
    """The runner method a command names; only :data:`RANK_OPS` may be asked for."""
    ops = {"execute": runner.execute, "move_kv_slots": runner.move_kv_slots,
           "allocate_kv_cache": runner.allocate_kv_cache, "prefill_logits": runner.prefill_logits,
           "prefill_hidden": runner.prefill_hidden, "load_adapter": runner.load_adapter,
           "unload_adapter": runner.unload_adapter}
    if op not in ops:
        raise ValueError(f"unknown rank operation {op!r}")
    return ops[op]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """This rank's device: on GPUs one each, by local rank (torchrun's LOCAL_RANK), made
    the current device so kernels launch where the tensors are."""
    if device.type != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", rank))
    if local >= torch.cuda.device_count():
        from tokenloom.core.errors import ConfigError

        raise ConfigError(f"rank {rank} needs GPU {local}, and this machine has {torch.cuda.device_count()}")
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    return dev


def report_load(ok: str, group) -> list[str]:
    """Every rank says whether it loaded (``"ok"`` or the error): a rank that cannot load
    fails the start-up with its reason instead of leaving the others waiting."""
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, ok, group=group)
    return out


def serve_rank(rank: int, world: int, init_method: str, config, timeout_s: float, threads: int,
               pm=None) -> bool:
    """A rank other than 0: load this rank's share of the model, then run what rank 0
    sends until it says stop (True) or the group fails (False). ``pm``: the plugin manager
    (a fresh one, entry points included, when this process has none)."""
    import torch.distributed as dist

    from tokenloom.core.build import build_runner
    from tokenloom.core.plugins import PluginManager

    if threads:
        torch.set_num_threads(threads)
    from tokenloom.core.runner import pick_device

    device = rank_device(pick_device(config.engine.device), rank)
    groups = init_group(rank, world, init_method, timeout_s, device)
    tp = TensorParallel(rank, world, groups.model)
    try:
        runner = build_runner(config, pm or PluginManager(), tp, device).runner
        status = "ok"
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the start-up
        runner, status = None, f"rank {rank}: {type(exc).__name__}: {exc}"
    ok = False
    try:
        if any(s != "ok" for s in report_load(status, groups.startup)) or runner is None:
            return False
        while True:
            msg: list = [None]
            dist.broadcast_object_list(msg, src=0, group=groups.commands)
            op, args = msg[0]
            if op == "stop":
                ok = True
                break
            rank_op(runner, op)(*args)
    except Exception as exc:  # noqa: BLE001 - rank 0 went away or a step failed: leave
        log.error("rank_stopped", rank=rank, error=f"{type(exc).__name__}: {exc}")
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    return ok


def start_workers(world: int, config, timeout_s: float, threads: int) -> tuple[str, list[subprocess.Popen]]:
    """Start ranks 1..world-1 on this machine, each a fresh interpreter running
    ``python -m tokenloom.core.executor`` (nothing of the caller's ``__main__`` is
    re-imported, unlike multiprocessing's spawn); their settings arrive pickled on stdin.
    Returns the rendezvous address and the processes."""
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    payload = pickle.dumps((world, init_method, config, timeout_s, threads))
    env = {**os.environ, "TOKENLOOM_LOG_LEVEL": os.environ.get("TOKENLOOM_LOG_LEVEL", "WARNING")}
    procs = []
    for rank in range(1, world):
        p = subprocess.Popen([sys.executable, "-m", "tokenloom.core.executor", str(rank)], stdin=subprocess.PIPE,
                             env=env)
        assert p.stdin is not None  # stdin=PIPE
        p.stdin.write(payload)
        p.stdin.close()
        procs.append(p)
    return init_method, procs


def _main() -> None:
    """A rank started by :func:`start_workers`."""
    from tokenloom.core.logging import configure_logging

    rank = int(sys.argv[1])
    world, init_method, config, timeout_s, threads = pickle.loads(sys.stdin.buffer.read())
    configure_logging(os.environ.get("TOKENLOOM_LOG_LEVEL", "WARNING"), None)
    sys.exit(0 if serve_rank(rank, world, init_method, config, timeout_s, threads) else 1)


if __name__ == "__main__":
    _main()
