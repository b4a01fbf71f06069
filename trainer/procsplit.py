"""The procsplit topology: each drafter replica in its own process, target producers in their own processes.

Why: CUDA graphs (CUDAGraph Trees and the non-tree path) break when the capturing code runs in a plain
worker thread (docs/design.md, "Crash signatures"); here every drafter trains in its process's MAIN thread.

    supervisor (python -m trainer)        spawns, watches, forwards SIGTERM, ends the run
      +-- target<i>  process              frozen target on its device; batches -> torch.multiprocessing
      |                                   queues (CUDA tensors travel by IPC handle, no host copy)
      +-- drafter<r> process (rank r)     one replica; gradients averaged by DistributedDataParallel
                                          (NCCL when every drafter has its own GPU, else gloo)

The first message a producer sends each drafter is the target's embedding and lm_head (the drafter's frozen
input and output layers), so drafters never build the target. Rank 0 writes the step lines, checkpoints
and the done line. A SIGTERM (to the supervisor or the whole process group): one rank stops after the
step in flight (or at once while it waits for a batch); several ranks agree on it at the next logging
step: they finish that step, rank 0 checkpoints, all exit EXIT_STOPPED. A process that dies (its traceback
is on stderr) makes the supervisor kill the others and exit EXIT_WORKER_FAILED.

No wait is unbounded: a drafter waits for its target in POLL_S slices (run.step_timeout_s, and after a stop
STOP_WAIT_S, then a NoAnswer naming the target), a target puts in slices until the run is finished, and
the supervisor gives its drafters STOP_GRACE_S after a stop and its targets REAP_GRACE_S after the
drafters, then kills what is left (a stopped process included) and says which did not end.

Several nodes (run.nnodes > 1): every node runs this same supervisor with its own run.node_rank; node k's
local drafter r is global rank k * (drafters per node) + r, its producer serves that global rank's batches.
The ranks meet at a c10d TCPStore on run.master_addr:run.master_port (node 0's rank 0 listens), which must
see every rank within run.rendezvous_timeout_s; the supervisor also bounds the whole rendezvous by that
time (a client that reached a foreign listener on the port waits past the store's own timeout). Each
node's lead (its local rank 0) writes the step, checkpoint and done lines and the checkpoint on its node
(replicas are identical), so every node's log shows progress and every node resumes; the ranks check they
resumed from one step. A step line's tok_s is the whole run's (every rank's tokens over the lead's step
time; the all_reduce keeps the ranks in lockstep, so the nodes' figures agree). A collective
that fails because a peer ended or became unreachable is reported as `cause=peer_lost`: a consequence of
another node's failure, not a failure of its own.
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
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as NotYet
from datetime import timedelta
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
from trainer.stopsignal import set_on_signal

POLL_S = 0.2  # every wait (a drafter on its inbox, a target on a full queue, the supervisor) looks up this often
STOP_WAIT_S = 8.0  # after a stop, how long one of several ranks still waits for its target's batch
STOP_GRACE_S = 60.0  # after a stop, how long the supervisor waits for its drafters before it kills them
REAP_GRACE_S = 5.0  # once the drafters ended, how long a target may take to end before it is killed
FAILURE_TEXT_BYTES = 800
RECORDED_EXIT_S = 2.0  # how long the supervisor waits for a drafter that recorded its failure to end
RENDEZVOUS_GRACE_S = 5.0  # beyond the store's own timeout, before the supervisor gives up on a rendezvous
PEER_LOST = "peer_lost"
RENDEZVOUS = "rendezvous"
DDP_BUCKET_MB = 100  # gradient all_reduce granularity: ~10 buckets per qwen3-8b-shape drafter layer
COLLECTIVE_WORDS = ("gloo", "Gloo", "NCCL", "Connection", "connection", "ProcessGroup")  # in a backend's errors


class RendezvousError(RuntimeError):
    """The ranks did not meet: the port is taken, or a node never came or cannot reach node 0."""


class PeerLost(RuntimeError):
    """A collective failed because another rank ended or became unreachable (a consequence, not a cause)."""


class NoAnswer(RuntimeError):
    """A rank's target sent nothing within run.step_timeout_s, or within STOP_WAIT_S of a stop."""


class Topology:
    """Where this node's drafters sit in the whole run: global ranks, world size, the rendezvous endpoint."""

    def __init__(self, cfg: Config, single_node_port: int = 0) -> None:
        self.local = len(cfg.run.drafter_devices)
        self.nnodes, self.node_rank = cfg.run.nnodes, cfg.run.node_rank
        self.world = self.nnodes * self.local
        self.offset = self.node_rank * self.local  # global rank of this node's local rank 0
        multi = self.nnodes > 1
        self.addr = cfg.run.master_addr if multi else "127.0.0.1"
        self.port = cfg.run.master_port if multi else single_node_port
        self.timeout_s = cfg.run.rendezvous_timeout_s

    def rank(self, local_rank: int) -> int:
        return self.offset + local_rank

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{self.port}"


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


def rendezvous(cfg: Config, topo: Topology, rank: int) -> None:
    """Join the run's process group through a c10d TCPStore on the rendezvous endpoint (rank 0 hosts it and
    waits for every rank); collectives then time out after run.step_timeout_s."""
    timeout = timedelta(seconds=topo.timeout_s)
    try:
        store = dist.TCPStore(topo.addr, topo.port, world_size=topo.world, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=True)
    except dist.DistError as exc:
        raise RendezvousError(rendezvous_failure(topo, rank, exc)) from None
    dist.init_process_group(dist_backend(cfg), store=store, rank=rank, world_size=topo.world,
                            timeout=timedelta(seconds=cfg.run.step_timeout_s))


def rendezvous_failure(topo: Topology, rank: int, exc: BaseException) -> str:
    text = str(exc)
    where = f"rendezvous at {topo.endpoint}"
    if "EADDRINUSE" in text or "address already in use" in text:
        return f"{where}: the port is already taken on node 0 (set run.master_port / MASTER_PORT to a free port)"
    if rank == 0:
        joined = text.split("waiting for clients.")[-1].strip().rstrip(".") if "clients joined" in text else ""
        return (f"{where}: not every rank joined within {topo.timeout_s:g}s ({joined or first_line(text)}): "
                f"start every node (run.nnodes={topo.nnodes}) and let them reach this port")
    return (f"{where}: node 0 did not answer within {topo.timeout_s:g}s: start node 0, check run.master_addr / "
            "MASTER_ADDR and that the port is open between the nodes")


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:240]


def is_collective_failure(exc: BaseException) -> bool:
    """A torch.distributed failure (its own error type, or the backend's words in a RuntimeError)."""
    return isinstance(exc, dist.DistError) or any(word in str(exc) for word in COLLECTIVE_WORDS)


def collective(op, *args):
    """A torch.distributed collective whose failure (a peer ended, a connection closed, a timeout) is PeerLost."""
    try:
        return op(*args)
    except (RuntimeError, dist.DistError) as exc:
        raise PeerLost(f"{op.__name__} failed, a peer rank ended or is unreachable: {first_line(str(exc))}") from exc


def producer_of(cfg: Config, local_rank: int) -> int:
    """The index of the target process that serves a node's local drafter."""
    return local_rank % len(dict.fromkeys(cfg.run.target_devices))


def start_step_of(cfg: Config, run_dir: Path, resume: bool) -> int:
    """0, or the resumed checkpoint's step (memory-mapped: the supervisor reads no weights)."""
    return int(load_checkpoint(run_dir, cfg.hash(), mmap=True)["step"]) if resume else 0


# ----------------------------------------------------------------------------------------- producer


def producer_main(cfg: Config, index: int, device: str, serves: list[int], queues: list, start: int,
                  finished, rank_offset: int = 0) -> None:
    """A target process: head weights first, then one batch per (step, served drafter); a drafter's batch is
    its global rank's (rank_offset + local index), so nodes train on different data."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the drafters decide when to stop; we follow `finished`
    share_cpu(cfg, device)
    target = build_target(cfg, device).to(dtype=model_dtype(cfg))
    compile_target(cfg.target.compile, target)
    source = build_source(cfg)
    for drafter in serves:
        put_until(queues[drafter], ("head", target.embed.weight, target.lm_head.weight), finished.is_set)
    for step in range(start, cfg.run.steps):
        for drafter in serves:
            tokens, anchors = source.batch(step, rank_offset + drafter)  # (b, T), (b, A)
            tokens = tokens.to(device)
            features = target.features(tokens)  # (b, T, K*H)
            if is_cuda(device):
                torch.cuda.current_stream(device).synchronize()  # complete before another process reads it
            if not put_until(queues[drafter], ("batch", step, tokens, features, anchors.to(device)), finished.is_set):
                return
    finished.wait()  # our CUDA tensors must outlive the consumers' use of them


# ------------------------------------------------------------------------------------------ drafter


class DrafterProcess:
    """Rank r's main thread: receive, train, all_reduce, and (the node's lead: its local rank 0, on one node
    rank 0) report and checkpoint on its node."""

    def __init__(self, cfg: Config, rank: int, world: int, device: str, inbox, run_dir: Path, start: int,
                 stop, lead: bool | None = None, target: str = "target0") -> None:
        self.cfg, self.rank, self.world, self.device, self.inbox = cfg, rank, world, device, inbox
        self.run_dir, self.start, self.stop = run_dir, start, stop
        self.lead = rank == 0 if lead is None else lead
        self.target = target  # the producer process that feeds this rank, named in a NoAnswer
        # takes one message off the inbox while the main thread waits for it in slices: unpickling a CPU
        # tensor asks the sending process for its file descriptor and blocks for good if that one is stopped
        self.receiver = ThreadPoolExecutor(1, thread_name_prefix="receive")
        self.log = MetricLog()
        self.replica = self._build()
        self.reporter = Reporter(cfg, self.log, start, world, self._queue_fill, lambda: world)

    def _build(self):
        kind, embed_w, head_w = self._take("head weights", stop_at_once=False)
        assert kind == "head", f"expected the head weights first, got {kind!r}"
        embed = nn.Embedding.from_pretrained(embed_w.to(self.device).clone(), freeze=True)
        lm_head = nn.Linear(head_w.shape[1], head_w.shape[0], bias=False, device=self.device, dtype=head_w.dtype)
        lm_head.weight = nn.Parameter(head_w.to(self.device).clone(), requires_grad=False)
        del embed_w, head_w  # release the producer's IPC memory
        replica = build_replica(self.cfg, self.rank, self.device, seeded_drafter(self.cfg, self.device),
                                embed, lm_head)
        self._check_same_start()
        if self.start:
            restore_replica(replica, load_checkpoint(self.run_dir, self.cfg.hash()))
        if self.world > 1:
            self._average_with_ddp(replica)
        return replica

    def _check_same_start(self) -> None:
        """Every node resumes from its own checkpoint: they must agree on the step (else a node's is stale)."""
        starts = [0] * self.world
        collective(dist.all_gather_object, starts, self.start)
        if len(set(starts)) > 1:
            raise RuntimeError(f"ranks start at different steps {starts} (a node's checkpoint is stale): "
                               "copy node 0's OUT/RUN/checkpoint.pt to every node, or start without --resume")

    def _average_with_ddp(self, replica) -> None:
        """DistributedDataParallel around the drafter, inside the training forward: it broadcasts rank 0's
        weights (an identical start whatever the device's RNG did) and averages gradients in buckets while
        the backward still runs (under drafter.compile_scope=layers each layer's backward is a region of its
        own, so the all_reduce of the last layers overlaps the backward of the first). The replica keeps
        the bare drafter for checkpoints and digests."""
        from torch.nn.parallel import DistributedDataParallel

        objective = replica.compiled.module

        def broadcast_and_wrap(drafter):
            return DistributedDataParallel(
                drafter, device_ids=[self.device] if is_cuda(self.device) else None, broadcast_buffers=False,
                gradient_as_bucket_view=True, bucket_cap_mb=DDP_BUCKET_MB)

        objective.drafter = collective(broadcast_and_wrap, objective.drafter)

    def _queue_fill(self) -> float:
        try:
            return self.inbox.qsize() / self.cfg.run.queue_depth
        except NotImplementedError:  # macOS
            return 0.0

    def _take(self, what: str, stop_at_once: bool):
        """The next message from this rank's target, waited for in POLL_S slices. Once a stop is asked:
        None at once when `stop_at_once` (one rank stops without agreeing with anyone), else the wait goes on
        (the ranks agree on the stop at the next logging step and need the batches up to it) for at most
        STOP_WAIT_S. A target silent past either bound is a NoAnswer naming it."""
        limit_s = self.cfg.run.step_timeout_s
        deadline, stop_deadline = time.monotonic() + limit_s, None
        message = self.receiver.submit(self.inbox.get)
        while True:
            try:
                return message.result(timeout=POLL_S)
            except NotYet:
                pass
            if self.stop.is_set():
                if stop_at_once:
                    return None
                stop_deadline = stop_deadline or time.monotonic() + STOP_WAIT_S
                if time.monotonic() > stop_deadline:
                    raise NoAnswer(f"{self.target} sent no {what} within {STOP_WAIT_S:g}s of the stop "
                                   "(it is stuck or stopped)")
            if time.monotonic() > deadline:
                raise NoAnswer(f"{self.target} sent no {what} within {limit_s:g}s (run.step_timeout_s)")

    def _receive(self, step: int):
        """This step's batch on the drafter's device (own copy), or None: one rank asked to stop."""
        message = self._take(f"batch for step {step + 1}", stop_at_once=self.world == 1)
        if message is None:
            return None
        _, _, tokens, features, anchors = message
        received = tuple(t.to(self.device).clone() for t in (tokens, features, anchors))
        del tokens, features, anchors, message
        return received

    def _forward_backward(self, tokens, features, anchors) -> None:
        """The step; DDP averages the gradients during its backward, so a peer lost there is PeerLost too."""
        try:
            forward_backward(self.cfg, self.replica, tokens, features, anchors)
        except (RuntimeError, dist.DistError) as exc:
            if self.world > 1 and is_collective_failure(exc):
                raise PeerLost("the gradient all_reduce failed, a peer rank ended or is unreachable: "
                               f"{first_line(str(exc))}") from exc
            raise

    def _log_step_stats(self) -> tuple[float, float, float, bool]:
        """All ranks: mean loss/acc/accept_len and whether any rank was asked to stop."""
        stats = torch.stack([*self.replica.stats, torch.tensor(float(self.stop.is_set()), device=self.device)])
        if self.world > 1:
            collective(dist.all_reduce, stats)
        values = stats.tolist()
        return values[0] / self.world, values[1] / self.world, values[2] / self.world, values[3] > 0

    def train(self) -> int:
        """The steps; a stop ends them after the step in flight on one rank, at the next logging step (agreed
        in its all_reduce) on several, and the last completed step is checkpointed."""
        stop_now, done = False, self.start
        for step in range(self.start, self.cfg.run.steps):
            started = time.monotonic()
            debug_hooks(self.cfg, self.rank, step)
            received = self._receive(step)
            if received is None:
                stop_now = True
                break
            self._forward_backward(*received)
            if step == self.start:
                self._log_compile(time.monotonic() - started)
            optimizer_step(self.cfg, self.replica)
            done = step + 1
            if self.reporter.is_log_step(done):
                *means, stop_now = self._log_step_stats()
            if self.world == 1:
                stop_now = self.stop.is_set()
            if self.lead:
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
        if not self.lead:
            return
        r = self.replica
        path = save_checkpoint(self.run_dir, step, self.cfg.hash(), r.drafter, r.optimizer, r.scheduler)
        self.log.emit("checkpoint", step=step, path=str(path))

    def _finish(self, done: int, stopped: bool) -> int:
        status = EXIT_STOPPED if stopped else EXIT_OK
        digests = [""] * self.world
        collective(dist.all_gather_object, digests, weights_digest(self.replica.drafter))
        self._checkpoint(done)
        if self.lead:
            self.log.emit("done", step=done, reason="sigterm" if stopped else "finished", exit=status,
                          **replica_fields(digests))
        return status


def drafter_main(cfg: Config, local_rank: int, topo: Topology, device: str, inbox, run_name: str,
                 wandb_mode: str, run_dir: str, start: int, stop, failure, joined) -> None:
    signal.signal(signal.SIGTERM, set_on_signal(stop))
    rank = topo.rank(local_rank)
    try:
        share_cpu(cfg, device)
        if is_cuda(device):
            torch.cuda.set_device(device)
        joined.begin()
        rendezvous(cfg, topo, rank)
        joined.done()
        process = DrafterProcess(cfg, rank, topo.world, device, inbox, Path(run_dir), start, stop,
                                 lead=local_rank == 0, target=f"target{producer_of(cfg, local_rank)}")
        if rank == 0:
            process.log.sink = open_sink(wandb_mode, run_name, cfg.to_dict(), run_dir)
        status = process.train()
    except BaseException as exc:  # noqa: BLE001 - traceback to the log, then leave at once: a normal
        failure.record(local_rank, exc)  # interpreter teardown could wait on a process group whose other
        print(f"Process drafter{rank}:", file=sys.stderr)  # ranks sit in a collective
        if isinstance(exc, (RendezvousError, NoAnswer)):
            print(f"error: {exc}", file=sys.stderr)
        else:
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(EXIT_WORKER_FAILED)
    process.log.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(status)  # skip interpreter teardown with CUDA IPC handles still registered


# --------------------------------------------------------------------------------------- supervisor


class FirstFailure:
    """Shared between a node's drafters: which local rank raised first (before its peers fail in the
    collective), what it raised (one line) and its cause (peer_lost, rendezvous or none)."""

    def __init__(self, ctx) -> None:
        self.rank = ctx.Value("i", -1)
        self.text = ctx.Array("c", FAILURE_TEXT_BYTES)
        self.cause = ctx.Array("c", 32)

    def record(self, local_rank: int, exc: BaseException) -> None:
        with self.rank.get_lock():
            if self.rank.value >= 0:
                return
            self.rank.value = local_rank
            text = f"{type(exc).__name__}: {first_line(str(exc))}".encode("utf-8", "replace")
            self.text.value = text[:FAILURE_TEXT_BYTES - 1]
            cause = PEER_LOST if isinstance(exc, PeerLost) else RENDEZVOUS if isinstance(exc, RendezvousError) else ""
            self.cause.value = cause.encode()

    def describe(self, local_rank: int) -> tuple[str, str | None]:
        """(the exception's line, its cause) when `local_rank` is the one that raised first, else ("", None)."""
        if self.rank.value != local_rank:
            return "", None
        return self.text.value.decode("utf-8", "replace"), self.cause.value.decode() or None


class RendezvousProgress:
    """Shared between a node's drafters and its supervisor: when the last of them began the rendezvous (on
    the system-wide monotonic clock) and how many have joined. The supervisor's deadline counts from that
    start, not from the spawn: importing torch can take longer than the rendezvous on a loaded machine."""

    def __init__(self, ctx) -> None:
        self.since = ctx.Value("d", 0.0)
        self.joined = ctx.Value("i", 0)

    def begin(self) -> None:
        with self.since.get_lock():
            self.since.value = max(self.since.value, time.monotonic())

    def done(self) -> None:
        with self.joined.get_lock():
            self.joined.value += 1

    def overdue(self, ranks: int, limit_s: float) -> bool:
        """Not all `ranks` joined `limit_s` after the last one began."""
        since = self.since.value
        return self.joined.value < ranks and since > 0 and time.monotonic() > since + limit_s


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
        self.failure = FirstFailure(ctx)
        self.joined = RendezvousProgress(ctx)
        start = start_step_of(cfg, run_dir, resume)
        self.topo = topo = Topology(cfg, single_node_port=free_port() if cfg.run.nnodes == 1 else 0)
        self.producers = [
            ctx.Process(target=producer_main, name=f"target{i}", daemon=True,
                        args=(cfg, i, device, [d for d in range(len(drafters)) if producer_of(cfg, d) == i], queues,
                              start, self.finished, topo.offset))
            for i, device in enumerate(targets)
        ]
        self.drafters = [
            ctx.Process(target=drafter_main, name=f"drafter{topo.rank(local)}",
                        args=(cfg, local, topo, device, queues[local], run_name, wandb_mode,
                              str(run_dir), start, self.stop, self.failure, self.joined))
            for local, device in enumerate(drafters)
        ]

    def run(self) -> int:
        signal.signal(signal.SIGTERM, set_on_signal(self.stop))
        for process in self.producers + self.drafters:
            process.start()
        status = EXIT_WORKER_FAILED
        try:
            status = self._watch()
            return status
        finally:
            self.finished.set()
            self._reap(REAP_GRACE_S if status != EXIT_WORKER_FAILED else 1.0)

    def _watch(self) -> int:
        stop_deadline = None
        while True:
            # one read of each exit code per round: a drafter that fails between two reads would otherwise
            # pass the failure check still running and then count as ended, and the run would exit 0
            codes = [(process.name, process.exitcode) for process in self.producers + self.drafters]
            for name, code in codes:
                if code is not None and code not in (EXIT_OK, EXIT_STOPPED):
                    return self._fail(*self._first_failed(name, code))
            drafter_codes = [code for _, code in codes[len(self.producers):]]
            if None not in drafter_codes:
                return EXIT_STOPPED if EXIT_STOPPED in drafter_codes else EXIT_OK
            if self.joined.overdue(len(self.drafters), self.topo.timeout_s + RENDEZVOUS_GRACE_S):
                return self._rendezvous_timed_out()
            if self.stop.is_set():
                stop_deadline = stop_deadline or time.monotonic() + STOP_GRACE_S
                if time.monotonic() > stop_deadline:
                    return self._stop_unanswered([name for name, code in codes[len(self.producers):] if code is None])
            time.sleep(POLL_S)

    def _stop_unanswered(self, running: list[str]) -> int:
        """Drafters still running STOP_GRACE_S after a stop (stopped, or stuck in a collective with a rank that
        does not answer): one `event=error` line naming them; the caller kills them."""
        reason = (f"{', '.join(running)}: did not end within {STOP_GRACE_S:g}s of the stop (a process stuck or "
                  "stopped, or a peer rank that does not answer): killed")
        print(f"error: {reason}", file=sys.stderr, flush=True)
        self.log.emit("error", reason=reason, node=self.topo.node_rank if self.topo.nnodes > 1 else None)
        return EXIT_WORKER_FAILED

    def _rendezvous_timed_out(self) -> int:
        """A rank still not in the group past the store's own timeout (e.g. it reached a foreign listener)."""
        reason = (f"rendezvous at {self.topo.endpoint}: this node's ranks did not join within "
                  f"{self.topo.timeout_s:g}s: start node 0 first, check run.master_addr / run.master_port and "
                  "that nothing else listens on that port")
        print(f"error: {reason}", file=sys.stderr, flush=True)
        self.log.emit("error", reason=reason, cause=RENDEZVOUS, node=self.topo.node_rank)
        return EXIT_WORKER_FAILED

    def _first_failed(self, name: str, code: int) -> tuple[str, int]:
        """A process killed by a signal (it raised nothing: the OOM killer, a user's kill), else the drafter
        whose exception came first when several have ended (its peers fail after it in the collective, and
        may be seen first by the poll), else the process the poll found."""
        for process in self.producers + self.drafters:
            if process.exitcode is not None and process.exitcode < 0:
                return process.name, process.exitcode
        rank = self.failure.rank.value
        if 0 <= rank < len(self.drafters):
            first = self.drafters[rank]
            first.join(timeout=RECORDED_EXIT_S)  # it recorded its failure and is on its way out
            if first.exitcode not in (None, EXIT_OK, EXIT_STOPPED):
                return first.name, first.exitcode
        return name, code

    def _fail(self, name: str, code: int) -> int:
        """One `event=error` line: the process, how it ended, what it raised, and `cause=peer_lost` when that
        was a collective failing because another node's rank went away (`cause=rendezvous`: never met)."""
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        local = next((i for i, p in enumerate(self.drafters) if p.name == name), -1)
        raised, cause = self.failure.describe(local) if code > 0 else ("", None)
        reason = f"{name}: process ended ({how})" + (f": {raised}" if raised else "")
        node = self.topo.node_rank if self.topo.nnodes > 1 else None
        self.log.emit("error", reason=reason, cause=cause, node=node)
        return EXIT_WORKER_FAILED

    def _reap(self, grace_s: float) -> None:
        """Let the processes end on their own for `grace_s`, then kill what is left (by PID; SIGKILL also ends
        a stopped process)."""
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
