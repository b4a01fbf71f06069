"""The procsplit topology: each drafter replica in its own process, target producers in their own processes.

Why: CUDA graphs (CUDAGraph Trees and the non-tree path) break when the capturing code runs in a plain
worker thread (../shared/crash-signatures.md); here every drafter trains in its process's MAIN thread.

    supervisor (python -m trainer)        spawns, watches, forwards SIGTERM, ends the run
      +-- target<i>  process              frozen target on its device; batches -> torch.multiprocessing
      |                                   queues (CUDA tensors travel by IPC handle, no host copy)
      +-- drafter<r> process (rank r)     one replica; gradients averaged with torch.distributed
                                          all_reduce (NCCL when every drafter has its own GPU, else gloo)

The first message a producer sends each drafter is the target's embedding and lm_head (the drafter's frozen
input and output layers), so drafters never build the target. Rank 0 writes the step lines, checkpoints
and the done line. A SIGTERM (to the supervisor or the whole process group) is agreed on by all ranks at
the next logging step: they finish that step, rank 0 checkpoints, all exit EXIT_STOPPED. A process that
dies (its traceback is on stderr) makes the supervisor kill the others and exit EXIT_WORKER_FAILED.
Multi-host runs are not built; the rendezvous (init_method) is the only place they would change.
"""

from __future__ import annotations

import gc
import multiprocessing.util
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.compile import compile_target
from trainer.config import Config
from trainer.data import build_source
from trainer.metrics import MetricLog, open_sink
from trainer.model import build_target, model_dtype
from trainer.pipeline import EXIT_OK, EXIT_STOPPED, EXIT_WORKER_FAILED, put_until
from trainer.replica import (
    Reporter, build_replica, debug_hooks, forward_backward, is_cuda, memory_gb, optimizer_step, replica_fields,
    restore_replica, seeded_drafter, weights_digest,
)

POLL_S = 0.2
SHUTDOWN_GRACE_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dist_backend(cfg: Config) -> str:
    """NCCL needs one GPU per rank; two drafters sharing a GPU (or CPU drafters) use gloo."""
    devices = cfg.run.drafter_devices
    if all(is_cuda(d) for d in devices) and len(set(devices)) == len(devices):
        return "nccl"
    return "gloo"


def start_step_of(cfg: Config, run_dir: Path, resume: bool) -> int:
    """0, or the resumed checkpoint's step (memory-mapped: the supervisor reads no weights)."""
    return int(load_checkpoint(run_dir, cfg.hash(), mmap=True)["step"]) if resume else 0


# ----------------------------------------------------------------------------------------- producer


def producer_main(cfg: Config, index: int, device: str, serves: list[int], queues: list, start: int,
                  finished) -> None:
    """A target process: head weights first, then one batch per (step, served drafter)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the drafters decide when to stop; we follow `finished`
    share_cpu(cfg, device)
    target = build_target(cfg, device).to(dtype=model_dtype(cfg))
    compile_target(cfg.target.compile, target)
    source = build_source(cfg)
    for drafter in serves:
        put_until(queues[drafter], ("head", target.embed.weight, target.lm_head.weight), finished.is_set)
    for step in range(start, cfg.run.steps):
        for drafter in serves:
            tokens, anchors = source.batch(step, drafter)  # (b, T), (b, A)
            tokens = tokens.to(device)
            features = target.features(tokens)  # (b, T, K*H)
            if is_cuda(device):
                torch.cuda.current_stream(device).synchronize()  # complete before another process reads it
            if not put_until(queues[drafter], ("batch", step, tokens, features, anchors.to(device)), finished.is_set):
                return
    finished.wait()  # our CUDA tensors must outlive the consumers' use of them


# ------------------------------------------------------------------------------------------ drafter


class DrafterProcess:
    """Rank r's main thread: receive, train, all_reduce, and (rank 0) report and checkpoint."""

    def __init__(self, cfg: Config, rank: int, world: int, device: str, inbox, run_dir: Path, start: int,
                 stop) -> None:
        self.cfg, self.rank, self.world, self.device, self.inbox = cfg, rank, world, device, inbox
        self.run_dir, self.start, self.stop = run_dir, start, stop
        self.log = MetricLog()
        self.replica = self._build()
        self.reporter = Reporter(cfg, self.log, start, world, self._queue_fill, lambda: world)

    def _build(self):
        kind, embed_w, head_w = self.inbox.get(timeout=self.cfg.run.step_timeout_s)
        assert kind == "head", f"expected the head weights first, got {kind!r}"
        embed = nn.Embedding.from_pretrained(embed_w.to(self.device).clone(), freeze=True)
        lm_head = nn.Linear(head_w.shape[1], head_w.shape[0], bias=False, device=self.device, dtype=head_w.dtype)
        lm_head.weight = nn.Parameter(head_w.to(self.device).clone(), requires_grad=False)
        del embed_w, head_w  # release the producer's IPC memory
        replica = build_replica(self.cfg, self.rank, self.device, seeded_drafter(self.cfg, self.device),
                                embed, lm_head)
        if self.start:
            restore_replica(replica, load_checkpoint(self.run_dir, self.cfg.hash()))
        for param in replica.drafter.parameters():  # identical start whatever the device's RNG did
            dist.broadcast(param.data, src=0)
        return replica

    def _queue_fill(self) -> float:
        try:
            return self.inbox.qsize() / self.cfg.run.queue_depth
        except NotImplementedError:  # macOS
            return 0.0

    def _receive(self):
        _, step, tokens, features, anchors = self.inbox.get(timeout=self.cfg.run.step_timeout_s)
        received = tuple(t.to(self.device).clone() for t in (tokens, features, anchors))  # own copy
        del tokens, features, anchors
        return step, received

    def _average_gradients(self) -> None:
        if self.world == 1:
            return
        grads = [p.grad for p in self.replica.drafter.parameters()]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= self.world
        for grad, averaged in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(averaged)

    def _log_step_stats(self) -> tuple[float, float, float, bool]:
        """All ranks: mean loss/acc/accept_len and whether any rank was asked to stop."""
        stats = torch.stack([*self.replica.stats, torch.tensor(float(self.stop.is_set()), device=self.device)])
        if self.world > 1:
            dist.all_reduce(stats)
        values = stats.tolist()
        return values[0] / self.world, values[1] / self.world, values[2] / self.world, values[3] > 0

    def train(self) -> int:
        stop_now, done = False, self.start
        for step in range(self.start, self.cfg.run.steps):
            started = time.monotonic()
            debug_hooks(self.cfg, self.rank, step)
            _, (tokens, features, anchors) = self._receive()
            forward_backward(self.cfg, self.replica, tokens, features, anchors)
            self._average_gradients()
            if step == self.start:
                self._log_compile(time.monotonic() - started)
            optimizer_step(self.cfg, self.replica)
            done = step + 1
            if self.reporter.is_log_step(done):
                *means, stop_now = self._log_step_stats()
            if self.rank == 0:
                self.reporter.after_step(done, lambda: tuple(means), self.replica.scheduler.get_last_lr()[0],
                                         memory_gb([self.device]))
                every = self.cfg.run.checkpoint_every
                if every and done % every == 0 and done != self.cfg.run.steps:
                    self._checkpoint(done)
            if stop_now:
                break
        return self._finish(done, stopped=stop_now and done < self.cfg.run.steps)

    def _log_compile(self, seconds: float) -> None:
        if is_cuda(self.device):
            torch.cuda.synchronize(self.device)
        self.log.emit("compile", drafter=self.rank, device=self.device, variant=self.cfg.run.compile,
                      seconds=seconds, pid=os.getpid())

    def _checkpoint(self, step: int) -> None:
        r = self.replica
        path = save_checkpoint(self.run_dir, step, self.cfg.hash(), r.drafter, r.optimizer, r.scheduler)
        self.log.emit("checkpoint", step=step, path=str(path))

    def _finish(self, done: int, stopped: bool) -> int:
        status = EXIT_STOPPED if stopped else EXIT_OK
        digests = [""] * self.world
        dist.all_gather_object(digests, weights_digest(self.replica.drafter))
        if self.rank == 0:
            self._checkpoint(done)
            self.log.emit("done", step=done, reason="sigterm" if stopped else "finished", exit=status,
                          **replica_fields(digests))
        return status


def drafter_main(cfg: Config, rank: int, world: int, device: str, inbox, port: int, run_name: str,
                 wandb_mode: str, run_dir: str, start: int, stop, first_failure) -> None:
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    share_cpu(cfg, device)
    if is_cuda(device):
        torch.cuda.set_device(device)
    dist.init_process_group(dist_backend(cfg), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        process = DrafterProcess(cfg, rank, world, device, inbox, Path(run_dir), start, stop)
        if rank == 0:
            process.log.sink = open_sink(wandb_mode, run_name, cfg.to_dict(), run_dir)
        status = process.train()
    except BaseException:  # noqa: BLE001 - traceback to the log, then leave at once: a normal interpreter
        with first_failure.get_lock():  # the rank that failed first, before its peers fail in the collective
            if first_failure.value < 0:
                first_failure.value = rank
        print(f"Process drafter{rank}:", file=sys.stderr)  # teardown could wait on a process group
        traceback.print_exc()  # whose other ranks sit in a collective
        sys.stderr.flush()
        os._exit(EXIT_WORKER_FAILED)
    process.log.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(status)  # skip interpreter teardown with CUDA IPC handles still registered


# --------------------------------------------------------------------------------------- supervisor


class Supervisor:
    """Starts the processes, forwards SIGTERM, and turns their exits into the run's exit status."""

    def __init__(self, cfg: Config, run_name: str, wandb_mode: str, log: MetricLog, run_dir: Path,
                 resume: bool) -> None:
        self.cfg, self.log = cfg, log
        ctx = mp.get_context("spawn")
        drafters, targets = cfg.run.drafter_devices, list(dict.fromkeys(cfg.run.target_devices))
        # kept on self: Process.start() drops its args, and a collected queue unlinks its semaphores
        self.queues = queues = [ctx.Queue(maxsize=cfg.run.queue_depth) for _ in drafters]
        self.finished, self.stop = ctx.Event(), ctx.Event()
        self.first_failure = ctx.Value("i", -1)  # rank of the drafter whose exception came first
        start, port = start_step_of(cfg, run_dir, resume), free_port()
        self.producers = [
            ctx.Process(target=producer_main, name=f"target{i}", daemon=True,
                        args=(cfg, i, device, [d for d in range(len(drafters)) if d % len(targets) == i], queues,
                              start, self.finished))
            for i, device in enumerate(targets)
        ]
        self.drafters = [
            ctx.Process(target=drafter_main, name=f"drafter{rank}",
                        args=(cfg, rank, len(drafters), device, queues[rank], port, run_name, wandb_mode,
                              str(run_dir), start, self.stop, self.first_failure))
            for rank, device in enumerate(drafters)
        ]

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.stop.set())
        for process in self.producers + self.drafters:
            process.start()
        status = EXIT_WORKER_FAILED
        try:
            status = self._watch()
            return status
        finally:
            self.finished.set()
            self._reap(SHUTDOWN_GRACE_S if status != EXIT_WORKER_FAILED else 1.0)

    def _watch(self) -> int:
        while True:
            for process in self.producers + self.drafters:
                code = process.exitcode
                if code is not None and code not in (EXIT_OK, EXIT_STOPPED):
                    return self._fail(*self._first_failed(process.name, code))
            if all(p.exitcode is not None for p in self.drafters):
                return EXIT_STOPPED if any(p.exitcode == EXIT_STOPPED for p in self.drafters) else EXIT_OK
            time.sleep(POLL_S)

    def _first_failed(self, name: str, code: int) -> tuple[str, int]:
        """A process killed by a signal (it raised nothing: the OOM killer, a user's kill), else the drafter
        whose exception came first when several have ended (its peers fail after it in the collective, and
        may be seen first by the poll), else the process the poll found."""
        for process in self.producers + self.drafters:
            if process.exitcode is not None and process.exitcode < 0:
                return process.name, process.exitcode
        rank = self.first_failure.value
        if 0 <= rank < len(self.drafters) and self.drafters[rank].exitcode not in (None, EXIT_OK, EXIT_STOPPED):
            return self.drafters[rank].name, self.drafters[rank].exitcode
        return name, code

    def _fail(self, name: str, code: int) -> int:
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        self.log.emit("error", reason=f"{name}: process ended ({how})")
        return EXIT_WORKER_FAILED

    def _reap(self, grace_s: float) -> None:
        """Let the processes end on their own for `grace_s`, then kill what is left (by PID)."""
        deadline = time.monotonic() + grace_s
        for process in self.drafters + self.producers:
            process.join(timeout=max(0.0, deadline - time.monotonic()) if process.exitcode is None else 0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


def run_procsplit(cfg: Config, run_name: str, wandb_mode: str, log: MetricLog, run_dir: Path,
                  resume: bool) -> int:
    supervisor = Supervisor(cfg, run_name, wandb_mode, log, run_dir, resume)
    status = supervisor.run()
    del supervisor
    gc.collect()
    multiprocessing.util._exit_function()  # what atexit would run; the caller leaves through os._exit
    return status


def share_cpu(cfg: Config, device: str) -> None:
    """CPU processes split the cores instead of each spinning up one thread per core."""
    if not is_cuda(device):
        processes = len(cfg.run.drafter_devices) + len(set(cfg.run.target_devices))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))
