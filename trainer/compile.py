"""Compile strategies for the drafter's training forward: one named function each, applied in one place.

`apply_strategy(name, module)` returns a `Compiled` holding the callable to train with, the untouched
module (kept for checkpoints and optimizers), the exact settings made (logged in event=start), and the
hooks a worker must call: `thread_init` once at the start of each worker thread, `step_begin` before each
step. This module knows nothing about threads, queues or devices beyond those hooks.

Strategies (see docs/design.md, "Crash signatures" for how they fail under worker threads):
    eager      no compilation
    nographs   torch.compile(dynamic=False, options={"triton.cudagraphs": False})
    notrees    torch.compile(mode="reduce-overhead") with inductor triton.cudagraph_trees = False
    trees      torch.compile(mode="reduce-overhead"): CUDAGraph Trees
    localtls   trees, plus per-thread set-up of the trees' thread-local state through
               torch._C._stash_obj_in_tls (mode "share": the importing thread's containers; "fresh": new ones)
"""

from __future__ import annotations

import copy
import threading
import types
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from trainer.model import TargetModel

TREE_TLS_KEYS = ("tree_manager_containers", "tree_manager_locks")
_GRAPHS = "mode=reduce-overhead dynamic=False"
SETTINGS: dict[str, dict[str, str]] = {
    "eager": {"torch.compile": "off"},
    "nographs": {"torch.compile": "dynamic=False", "options": "triton.cudagraphs=False"},
    "notrees": {"torch.compile": _GRAPHS, "inductor.triton.cudagraph_trees": "False"},
    "trees": {"torch.compile": _GRAPHS, "inductor.triton.cudagraph_trees": "True"},
    "localtls": {"torch.compile": _GRAPHS, "inductor.triton.cudagraph_trees": "True",
                 "thread_init": f"torch._C._stash_obj_in_tls({'+'.join(TREE_TLS_KEYS)})"},
}


def strategy_settings(name: str, localtls_mode: str = "share") -> dict[str, str]:
    """Exactly what a strategy sets, for the start line."""
    settings = dict(SETTINGS[name])
    if name == "localtls":
        settings["thread_init"] += f" mode={localtls_mode}"
    return settings


@dataclass
class Compiled:
    step_fn: Callable
    module: nn.Module
    settings: dict[str, str]
    thread_init: Callable[[], None] = lambda: None
    step_begin: Callable[[], None] = lambda: None
    uses_graphs: bool = False


_NO_GRAPHS = {"dynamic": False, "options": {"triton.cudagraphs": False}}
_WITH_GRAPHS = {"mode": "reduce-overhead", "dynamic": False}
COMPILE_KWARGS: dict[str, dict] = {"nographs": _NO_GRAPHS, "notrees": _WITH_GRAPHS, "trees": _WITH_GRAPHS,
                                   "localtls": _WITH_GRAPHS}


def _configure(name: str) -> None:
    """Process-wide inductor settings a strategy needs before it compiles."""
    if name == "notrees":
        import torch._inductor.config as inductor_config

        inductor_config.triton.cudagraph_trees = False


def compile_eager(module: nn.Module) -> Compiled:
    return Compiled(module, module, SETTINGS["eager"])


def compile_nographs(module: nn.Module) -> Compiled:
    return Compiled(torch.compile(module, **_NO_GRAPHS), module, SETTINGS["nographs"])


def _mark_step_begin() -> None:
    torch.compiler.cudagraph_mark_step_begin()


def compile_notrees(module: nn.Module) -> Compiled:
    _configure("notrees")
    fn = torch.compile(module, **_WITH_GRAPHS)
    return Compiled(fn, module, SETTINGS["notrees"], step_begin=_mark_step_begin, uses_graphs=True)


def compile_trees(module: nn.Module) -> Compiled:
    fn = torch.compile(module, **_WITH_GRAPHS)
    return Compiled(fn, module, SETTINGS["trees"], step_begin=_mark_step_begin, uses_graphs=True)


def _importing_thread_tree_state() -> dict[str, object]:
    """The trees' thread-local containers as the thread that imported cudagraph_trees holds them."""
    import torch._inductor.cudagraph_trees as trees

    return {key: trees.get_obj(trees.local, key) for key in TREE_TLS_KEYS}


def compile_localtls(module: nn.Module, mode: str = "share") -> Compiled:
    compiled = compile_trees(module)
    shared = _importing_thread_tree_state() if mode == "share" else None

    def thread_init() -> None:
        if threading.current_thread() is threading.main_thread():
            return
        state = shared or {"tree_manager_containers": {}, "tree_manager_locks": defaultdict(threading.Lock)}
        for key in TREE_TLS_KEYS:
            torch._C._stash_obj_in_tls(key, state[key])

    compiled.thread_init = thread_init
    compiled.settings = strategy_settings("localtls", mode)
    return compiled


STRATEGIES: dict[str, Callable[..., Compiled]] = {
    "eager": compile_eager,
    "nographs": compile_nographs,
    "notrees": compile_notrees,
    "trees": compile_trees,
    "localtls": compile_localtls,
}


def apply_strategy(name: str, module: nn.Module, localtls_mode: str = "share",
                   regions: list[nn.Module] | None = None) -> Compiled:
    """The one place a strategy is applied: to the whole `module`, or, given `regions`, to each of those
    submodules in place (nn.Module.compile with the strategy's settings: submodules of identical code share
    one compiled graph), `module` itself then running eagerly around them."""
    if name == "localtls":
        compiled = compile_localtls(module, localtls_mode)
    else:
        compiled = STRATEGIES[name](module)
    if regions is None or name == "eager":
        return compiled
    for region in regions:
        if name == "notrees":
            _compile_own_graph(region, COMPILE_KWARGS[name])
        else:
            region.compile(**COMPILE_KWARGS[name])
    compiled.step_fn = module
    return compiled


def _compile_own_graph(region: nn.Module, kwargs: dict) -> None:
    """Compile `region` for CUDA graphs without trees: with a graph of its own, fed from buffers of its own.

    Such a graph replays with its static inputs at the addresses it was recorded with, and for the backward
    those are the parameters and the tensors saved by the forward, which include the region's own inputs (the
    previous layer's output, the context, the rope tables, the BlockMask's tensors), new tensors every step.
    So: the region's forward runs as a copy of the class's function with its own code object (torch.compile
    keeps graphs per code object: identical layers sharing one failed on the H200 with `assert
    dst.data_ptr() == src.data_ptr()` at the second layer), and its tensor inputs are first copied into
    persistent buffers (the backward then failed the same way at the second step); trees handle both by
    recording a graph per address set themselves."""
    forward = type(region).forward
    own = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                             forward.__defaults__, forward.__closure__)
    region.forward = StagedInputs(torch.compile(types.MethodType(own, region), **kwargs))


class StagedInputs:
    """Calls `fn` with its tensor arguments (and the tensor attributes of an argument object such as a
    BlockMask) copied into buffers it keeps, so `fn` sees the same addresses every call. Gradients flow
    through the copies: each call copies into a fresh detached alias of the buffer, which autograd records
    as a copy of the argument."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.buffers: dict[tuple, torch.Tensor] = {}

    def __call__(self, *args):
        return self.fn(*(self._stage(arg, (index,)) for index, arg in enumerate(args)))

    def _stage(self, value, key: tuple):
        if isinstance(value, torch.Tensor):
            buffer = self.buffers.get(key)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype \
                    or buffer.device != value.device:
                buffer = self.buffers[key] = torch.empty_like(value, requires_grad=False)
            return buffer.detach().copy_(value)
        attributes = getattr(value, "__dict__", None)
        if not attributes or not any(isinstance(item, torch.Tensor) for item in attributes.values()):
            return value
        staged = copy.copy(value)
        for name, item in attributes.items():
            if isinstance(item, torch.Tensor):
                setattr(staged, name, self._stage(item, (*key, name)))
        return staged


def compile_target(mode: str, target: nn.Module) -> None:
    """target.compile=layers: each decoder layer of the built-in target compiled without CUDA graphs (the
    layers share one code object, so one graph serves all of them). A Hugging Face target is left as it is.

    In the threaded topology the producer thread runs these layers while a drafter thread may be tracing
    its own first step; FX tracing is flagged process-wide, so a compiled layer entered meanwhile runs its
    eager code once instead of raising (torch._dynamo.config.error_on_nested_fx_trace)."""
    if mode != "layers" or not isinstance(target, TargetModel):
        return
    import torch._dynamo.config as dynamo_config

    dynamo_config.error_on_nested_fx_trace = False
    for layer in target.layers:
        layer.compile(**_NO_GRAPHS)
