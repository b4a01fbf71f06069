"""The threaded topology: target producer threads -> bounded queues -> drafter threads, in one process.

One producer thread per target device runs the frozen target and puts (tokens, features, anchors) into one
bounded queue per drafter it serves (drafter d is served by producer d % n_targets). One drafter thread per
drafter device (a device may repeat) trains its own replica. After every backward the drafter threads meet
at a barrier whose action averages the gradients of all replicas in-process (flatten, sum on the first
replica's device, copy back: the same code for CUDA and CPU "devices"), so replicas stay bit-identical.

Failure: a dying worker's traceback is printed by threading.excepthook, then the failure is recorded, the
barrier is broken and the main thread ends the process with EXIT_WORKER_FAILED. SIGTERM: the step in
flight finishes, a checkpoint is written, the process exits EXIT_STOPPED. What is not here: the replica's
step (replica.py), the model (model.py), compile strategies (compile.py), formatting (metrics.py).
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.compile import compile_target
from trainer.config import Config
from trainer.data import TokenSource
from trainer.metrics import MetricLog
from trainer.model import build_target, model_dtype
from trainer.replica import (
    Replica, Reporter, build_replica, debug_hooks, forward_backward, memory_gb, optimizer_step, replica_fields,
    restore_replica, seeded_drafter, stream_context, stream_for, synchronize, weights_digest,
)

EXIT_OK = 0
EXIT_WORKER_FAILED = 1
EXIT_USAGE = 2
EXIT_STOPPED = 75  # SIGTERM honoured: checkpoint written, resumable (EX_TEMPFAIL)
POLL_S = 0.2


@dataclass
class Batch:
    step: int
    tokens: torch.Tensor  # (b, T) on the target device
    features: torch.Tensor  # (b, T, K*H) on the target device
    anchors: torch.Tensor  # (b, A) on the target device


@dataclass
class RunState:
    """What the threads share: stop/failure flags and the outcome."""

    stop_requested: threading.Event = field(default_factory=threading.Event)
    failed: threading.Event = field(default_factory=threading.Event)
    failure: str = ""
    stop_at: int | None = None  # set in the barrier action: the last step every replica runs

    def record_failure(self, where: str, exc: BaseException) -> None:
        if not self.failed.is_set():
            self.failure = f"{where}: {type(exc).__name__}: {exc}"
        self.failed.set()

    def should_quit(self) -> bool:
        return self.failed.is_set()


def put_until(q, item: object, should_quit: Callable[[], bool]) -> bool:
    """Put into a bounded queue (thread or process queue), giving up once `should_quit()`; returns whether
    the item went in. Both topologies' producers use it."""
    while not should_quit():
        try:
            q.put(item, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False


def get_until(q: queue.Queue, state: RunState, timeout_s: float) -> Batch | None:
    deadline = time.monotonic() + timeout_s
    while not state.should_quit():
        try:
            return q.get(timeout=POLL_S)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no batch from the target producer in {timeout_s:.0f} s") from None
    return None


# ------------------------------------------------------------------------------------------- producer


class Producer:
    """Runs the frozen target on one device for the drafters it serves."""

    def __init__(self, target: nn.Module, device: str, source: TokenSource, serves: list[int],
                 queues: list[queue.Queue], steps: range, state: RunState) -> None:
        self.target, self.device, self.source = target, device, source
        self.serves, self.queues, self.steps, self.state = serves, queues, steps, state

    def run(self) -> None:
        stream = stream_for(self.device)
        for step in self.steps:
            for drafter in self.serves:
                with stream_context(stream):
                    batch = self.produce(step, drafter)
                if stream is not None:
                    stream.synchronize()  # the consumer may run on another stream or device
                if not put_until(self.queues[drafter], batch, self.state.should_quit):
                    return

    def produce(self, step: int, drafter: int) -> Batch:
        tokens, anchors = self.source.batch(step, drafter)  # (b, T), (b, A) on CPU
        tokens = tokens.to(self.device, non_blocking=True)
        features = self.target.features(tokens)  # (b, T, K*H)
        return Batch(step, tokens, features, anchors.to(self.device, non_blocking=True))


# ------------------------------------------------------------------------------------------ replicas


def build_replicas(cfg: Config, frozen: dict[str, tuple[nn.Module, nn.Module]]) -> list[Replica]:
    """Identical replicas: built once from the seed on the first drafter device, then copied."""
    prototype = seeded_drafter(cfg, cfg.run.drafter_devices[0])
    return [build_replica(cfg, index, device, prototype, *frozen[device])
            for index, device in enumerate(cfg.run.drafter_devices)]


def build_targets(cfg: Config) -> dict[str, nn.Module]:
    """One identical frozen target per target device (built on the first, copied to the others)."""
    devices = list(dict.fromkeys(cfg.run.target_devices))
    first = build_target(cfg, devices[0]).to(dtype=model_dtype(cfg))
    targets = {device: first if device == devices[0] else copy.deepcopy(first).to(device) for device in devices}
    for target in targets.values():
        compile_target(cfg.target.compile, target)
    return targets


def frozen_heads(cfg: Config, targets: dict[str, nn.Module]) -> dict[str, tuple[nn.Module, nn.Module]]:
    """The target's embedding and lm_head on every drafter device (shared where a target lives)."""
    any_target = next(iter(targets.values()))
    heads = {}
    for device in cfg.run.drafter_devices:
        if device in targets:
            heads[device] = (targets[device].embed, targets[device].lm_head)
        elif device not in heads:
            heads[device] = (copy.deepcopy(any_target.embed).to(device),
                             copy.deepcopy(any_target.lm_head).to(device))
    return heads


# ------------------------------------------------------------------------------- gradient averaging


def average_gradients(replicas: list[Replica]) -> None:
    """Mean of every replica's gradients, written back into each replica: bit-identical afterwards."""
    if len(replicas) < 2:
        return
    for replica in replicas:
        synchronize(replica.device)
    grads = [[p.grad for p in r.drafter.parameters()] for r in replicas]
    flats = [torch._utils._flatten_dense_tensors(g) for g in grads]
    root = replicas[0].device
    total = flats[0].clone()
    for flat in flats[1:]:
        total += flat.to(root)
    total /= len(replicas)
    for replica, flat, grad_list in zip(replicas, flats, grads):
        flat.copy_(total.to(replica.device))
        for grad, averaged in zip(grad_list, torch._utils._unflatten_dense_tensors(flat, grad_list)):
            grad.copy_(averaged)
        synchronize(replica.device)


# ----------------------------------------------------------------------------------------- the run


class ThreadedRun:
    """Owns the threads of one training run and decides how the process ends."""

    def __init__(self, cfg: Config, source: TokenSource, log: MetricLog, run_dir: Path,
                 resume: bool, state: RunState | None = None) -> None:
        self.cfg, self.source, self.log, self.run_dir = cfg, source, log, run_dir
        self.state = state or RunState()
        self.config_hash = cfg.hash()
        self.targets = build_targets(cfg)
        self.replicas = build_replicas(cfg, frozen_heads(cfg, self.targets))
        self.start_step = self._restore() if resume else 0
        self.queues = [queue.Queue(maxsize=cfg.run.queue_depth) for _ in self.replicas]
        self.reporter = Reporter(cfg, log, self.start_step, len(self.replicas), self._queue_fill,
                                 self._active_count)
        self.barrier = threading.Barrier(len(self.replicas), action=self._after_backward)
        self.done_step = self.start_step
        self.workers: list[threading.Thread] = []
        self.first_step_lock = threading.Lock()

    def _restore(self) -> int:
        state = load_checkpoint(self.run_dir, self.config_hash)
        for replica in self.replicas:
            restore_replica(replica, state)
        return int(state["step"])

    def _queue_fill(self) -> float:
        return sum(q.qsize() / q.maxsize for q in self.queues) / len(self.queues)

    def _mean_stats(self) -> tuple[float, float, float]:
        n = len(self.replicas)
        return tuple(sum(float(r.stats[i]) for r in self.replicas) / n for i in range(3))

    def _active_count(self) -> int:
        return sum(1 for w in self.workers if w.name.startswith("drafter") and w.is_alive())

    # barrier action: runs once per step, in the last replica thread to arrive, while the others wait
    def _after_backward(self) -> None:
        average_gradients(self.replicas)
        self.done_step += 1
        if self.state.stop_requested.is_set() and self.state.stop_at is None:
            self.state.stop_at = self.done_step
        lead = self.replicas[0]
        self.reporter.after_step(self.done_step, self._mean_stats, lead.scheduler.get_last_lr()[0],
                                 memory_gb([r.device for r in self.replicas]))

    def start(self) -> None:
        steps = range(self.start_step, self.cfg.run.steps)
        n_targets = len(self.targets)
        for t_index, (device, target) in enumerate(self.targets.items()):
            serves = [d for d in range(len(self.replicas)) if d % n_targets == t_index]
            producer = Producer(target, device, self.source, serves, self.queues, steps, self.state)
            self._spawn(f"target{t_index}", producer.run)
        for replica in self.replicas:
            self._spawn(f"drafter{replica.index}", lambda r=replica: self._train(r, steps))

    def _spawn(self, name: str, body) -> None:
        thread = threading.Thread(target=body, name=name, daemon=True)
        self.workers.append(thread)
        thread.start()

    def _train(self, replica: Replica, steps: range) -> None:
        replica.compiled.thread_init()
        replica.stream = stream_for(replica.device)
        with stream_context(replica.stream):
            for step in steps:
                batch = get_until(self.queues[replica.index], self.state, self.cfg.run.step_timeout_s)
                if batch is None or not self._train_step(replica, step, batch):
                    return
                if self.state.stop_at is not None and self.state.stop_at <= step + 1:
                    return

    def _train_step(self, replica: Replica, step: int, batch: Batch) -> bool:
        debug_hooks(self.cfg, replica.index, step)
        if step == self.start_step:
            self._first_step(replica, batch)
        else:
            self._receive_and_train(replica, batch)
        try:
            self.barrier.wait(timeout=self.cfg.run.step_timeout_s)
        except threading.BrokenBarrierError:
            if self.state.failed.wait(timeout=2.0):  # another worker broke it: its failure is the story
                return False
            raise TimeoutError(f"drafter replicas did not meet within {self.cfg.run.step_timeout_s:.0f} s") from None
        optimizer_step(self.cfg, replica)
        done = step + 1
        every = self.cfg.run.checkpoint_every
        if replica.index == 0 and every and done % every == 0 and done != self.cfg.run.steps:
            self.write_checkpoint(done)
        return True

    def _first_step(self, replica: Replica, batch: Batch) -> None:
        """The compiling step, one replica at a time: while torch.compile traces (FX patches
        nn.Module.__call__ process-wide), another thread must not run compiled code."""
        with self.first_step_lock:
            started = time.monotonic()
            self._receive_and_train(replica, batch)
            synchronize(replica.device)
            self.log.emit("compile", drafter=replica.index, device=replica.device, variant=self.cfg.run.compile,
                          seconds=time.monotonic() - started)

    def _receive_and_train(self, replica: Replica, batch: Batch) -> None:
        device = replica.device
        tokens, features, anchors = (t.to(device, non_blocking=True)
                                     for t in (batch.tokens, batch.features, batch.anchors))
        if replica.stream is not None:
            for tensor in (tokens, features, anchors):
                tensor.record_stream(replica.stream)  # produced on the producer's stream
        forward_backward(self.cfg, replica, tokens, features, anchors)

    def write_checkpoint(self, step: int) -> None:
        replica = self.replicas[0]
        synchronize(replica.device)
        path = save_checkpoint(self.run_dir, step, self.config_hash, replica.drafter, replica.optimizer,
                               replica.scheduler)
        self.log.emit("checkpoint", step=step, path=str(path))

    def wait(self) -> int:
        """Block until the workers finish, fail or are told to stop; returns the process exit status."""
        drafters = [w for w in self.workers if w.name.startswith("drafter")]
        while any(w.is_alive() for w in drafters):
            if self.state.failed.is_set():
                return self._fail()
            time.sleep(POLL_S)
        if self.state.failed.is_set():
            return self._fail()
        final = self.done_step
        self.write_checkpoint(final)
        stopped = self.state.stop_at is not None and final < self.cfg.run.steps
        self.log.emit("done", step=final, reason="sigterm" if stopped else "finished",
                      exit=EXIT_STOPPED if stopped else EXIT_OK,
                      **replica_fields([weights_digest(r.drafter) for r in self.replicas]))
        return EXIT_STOPPED if stopped else EXIT_OK

    def _fail(self) -> int:
        self.barrier.abort()
        self.log.emit("error", step=self.done_step, reason=self.state.failure)
        return EXIT_WORKER_FAILED

    def on_worker_exception(self, args: threading.ExceptHookArgs) -> None:
        """threading.excepthook: print the traceback first, then flag the run as failed."""
        threading.__excepthook__(args)
        self.state.record_failure(args.thread.name if args.thread else "thread", args.exc_value)
        self.barrier.abort()
