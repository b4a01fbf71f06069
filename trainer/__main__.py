"""`python -m trainer`: parse the command line, build the config, run a topology, exit with a status.

    python -m trainer --preset tiny-cpu --variant nographs --steps 200 --run-name NAME
                      [--set section.key=value ...] [--out DIR] [--wandb auto|off|offline|online] [--resume]
                      [--topology threads|procsplit] [--targets DEVS] [--drafters DEVS]

Exit status: 0 finished; 1 a worker thread/process failed (its traceback is in the log) or the run could not
start; 2 bad command line or config value (the message names the key and the expected form); 75 stopped by
SIGTERM after finishing the step in flight and writing a checkpoint (resume with --resume).
Metric lines (logfmt) go to stdout; tracebacks and notes to stderr. This module holds no training logic.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import traceback
from pathlib import Path

from trainer.config import (
    COMPILE_STRATEGIES, PRESETS, RUN_FLAGS, TOPOLOGIES, Config, ConfigError, build_config, check_world_size,
    env_assignments,
)

EXIT_USAGE = 2
RUN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
EXIT_FAILED = 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer", description="DFlash-style drafter trainer")
    parser.add_argument("--preset", default="tiny-cpu", choices=sorted(PRESETS))
    parser.add_argument("--variant", "--compile", dest="variant", choices=COMPILE_STRATEGIES,
                        help="compile strategy of the drafters (alias --compile)")
    parser.add_argument("--run-name", default="run", help="names the output directory and the W&B run")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override with a dotted key, e.g. drafter.layers=2 (repeatable)")
    parser.add_argument("--wandb", default="auto", choices=("auto", "off", "offline", "online"),
                        help="auto: offline unless WANDB_API_KEY is set; off: no W&B at all")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/RUN_NAME/checkpoint.pt")
    for flag in RUN_FLAGS:
        choices = TOPOLOGIES if flag == "topology" else None
        parser.add_argument(f"--{flag.replace('_', '-')}", dest=flag, choices=choices, help=f"= --set run.{flag}=")
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> Config:
    if not RUN_NAME_RE.fullmatch(args.run_name):
        raise ConfigError(f"--run-name {args.run_name!r}: expected letters, digits, '.', '_' or '-'")
    assignments = [f"run.{flag}={getattr(args, flag)}" for flag in RUN_FLAGS if getattr(args, flag) is not None]
    if args.variant:
        assignments.append(f"run.compile={args.variant}")
    config = build_config(args.preset, env_assignments(os.environ) + assignments + args.overrides)
    check_world_size(config, os.environ)
    return config


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    # torch and the models load only after the config is known to be good: a bad --set answers at once
    from trainer.metrics import MetricLog

    run_dir = Path(cfg.run.out) / args.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    log = MetricLog()
    try:
        return start_topology(cfg, args, log, run_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        log.emit("error", reason=str(exc))
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - the main thread's last word: traceback, then an error line
        traceback.print_exc()
        log.emit("error", reason=f"{type(exc).__name__}: {exc}")
        return EXIT_FAILED
    finally:
        log.close()


def start_topology(cfg: Config, args: argparse.Namespace, log, run_dir: Path) -> int:
    log_start(cfg, args.run_name, log)
    if cfg.run.topology == "procsplit":
        from trainer.procsplit import run_procsplit

        return run_procsplit(cfg, args.run_name, args.wandb, log, run_dir, args.resume)
    return run_threads(cfg, args, log, run_dir)


def log_start(cfg: Config, run_name: str, log) -> None:
    import torch

    from trainer.compile import strategy_settings

    settings = strategy_settings(cfg.run.compile, cfg.run.localtls_mode)
    if cfg.run.compile != "eager" and cfg.drafter.compile_scope == "layers":
        settings["scope"] = "layers"
    if cfg.target.compile != "off":
        settings["target.compile"] = cfg.target.compile
    settings = " ".join(f"{k}={v}" for k, v in settings.items())
    log.emit("start", run=run_name, variant=cfg.run.compile, topology=cfg.run.topology, torch=torch.__version__,
             targets=cfg.run.targets, drafters=cfg.run.drafters, config=cfg.hash(), steps=cfg.run.steps,
             dtype=cfg.run.dtype, compile_settings=settings, pid=os.getpid(), **node_fields(cfg))


def node_fields(cfg: Config) -> dict[str, object]:
    """A node of a multi-node run says which one it is and where the ranks meet (nothing on one node)."""
    if cfg.run.nnodes == 1:
        return {}
    return {"nnodes": cfg.run.nnodes, "node_rank": cfg.run.node_rank,
            "rendezvous": f"{cfg.run.master_addr}:{cfg.run.master_port}"}


def run_threads(cfg: Config, args: argparse.Namespace, log, run_dir: Path) -> int:
    from trainer.data import build_source
    from trainer.metrics import open_sink
    from trainer.pipeline import RunState, ThreadedRun
    from trainer.stopsignal import set_on_signal

    state = RunState()  # SIGTERM while the models are still being built stops the run after its first step
    signal.signal(signal.SIGTERM, set_on_signal(state.stop_requested))
    log.sink = open_sink(args.wandb, args.run_name, cfg.to_dict(), str(run_dir))
    pipeline = ThreadedRun(cfg, build_source(cfg), log, run_dir, args.resume, state)
    threading.excepthook = pipeline.on_worker_exception
    pipeline.start()
    return pipeline.wait()


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # worker threads may sit in CUDA calls: do not wait for them at interpreter exit
