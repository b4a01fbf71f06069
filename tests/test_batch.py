"""dfo batch without machines: the experiments file's errors, matrix expansion, GPU ledger, and the scheduler
driven by a fake clock and a scripted watcher (overlap, concurrency caps, fallbacks, stop_when, resume)."""

from __future__ import annotations

import json
import os
import queue
import textwrap
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.cli import dfo
from orchestrator.batch import CellTable, GpuLedger, Scheduler, decision_of, plan_rows, run_spec
from orchestrator.chains import BATCH_POLICY, Claims, Outcome, Supervisor, catalogue_for, chain_variants, next_spec
from orchestrator.decide import Decision, next_variant, read_stored, rest_of_chain
from orchestrator.decide.policy import action_for
from orchestrator.experiments import load_experiments, parse_experiments
from orchestrator.errors import InventoryError
from orchestrator.events import DecisionMade, Step
from orchestrator.inventory import load_inventory, parse_inventory
from orchestrator.lifecycle import OUTCOMES, Lifecycle
from orchestrator.logfmt import format_ts
from orchestrator.states import Action, Verdict
from orchestrator.store import Run, Store, utc_now
from orchestrator.watch import WatchedRun

INVENTORY = parse_inventory(textwrap.dedent("""
    hosts:
      pve1:
        address: 10.0.0.1
        containers:
          ct200: {ctid: 200, gpus: [0, 1, 2, 3]}
          ct201: {ctid: 201, gpus: [0, 1]}
      pve2:
        address: 10.0.0.2
        containers:
          ct300: {ctid: 300}
    variants:
      trees: {compile: trees, preset: tiny-cpu}
      nographs: {compile: nographs, preset: tiny-cpu}
      eager: {compile: eager, preset: tiny-cpu}
      mine: {command: "bash run.sh"}
    fallback: [trees, nographs, eager]
"""), source="lab.yaml")


def plan_of(text: str):
    return parse_experiments(textwrap.dedent(text), INVENTORY, source="sweep.yaml")


def problems_of(text: str) -> list[str]:
    with pytest.raises(InventoryError) as info:
        plan_of(text)
    return info.value.problems


# ---------------------------------------------------------------------------------------------- the file

def test_errors_name_the_file_and_key_path_with_what_was_expected():
    problems = problems_of("""
        batch: sweep
        targets: [ct200, ct999, host:nope]
        matrix: {variant: [trees, fast], sett: [{}]}
        repeats: 0
        stop_when: {hours: 2}
        concurrency: {per_target: 0}
    """)
    text = "\n".join(problems)
    assert "sweep.yaml: matrix: unknown key 'sett' (did you mean 'set'?)" in problems
    assert "sweep.yaml: repeats: expected an integer from 1 to 1000, got 0" in problems
    assert ("sweep.yaml: stop_when: expected steady, {steps: N} or {minutes: M} (N an integer from 1 to "
            "1,000,000,000,000, M a number above 0 and at most 10080), got {'hours': 2}") in problems
    assert "concurrency.per_target" in text
    assert len(problems) == 4  # cross-checks wait until the shape is right


def test_cross_check_errors_list_the_known_names():
    problems = problems_of("""
        batch: "bad name"
        targets: [ct200, ct999, host:nope]
        matrix: {variant: [trees, fast, mine], set: [{batch_size: 4}]}
        fallback: [eager, turbo]
        gpus: 3
    """)
    assert problems[0].startswith("sweep.yaml: batch: invalid batch name 'bad name'")
    assert any(p.startswith("sweep.yaml: targets.1: unknown target 'ct999'") and "ct200, ct201, ct300" in p for p in problems)
    assert "sweep.yaml: targets.2: unknown host 'nope'; known hosts: pve1, pve2" in problems
    assert any(p.startswith("sweep.yaml: matrix.variant.1: unknown variant 'fast'; known variants: trees") for p in problems)
    assert any(p.startswith("sweep.yaml: matrix.variant.2: variant 'mine' runs its own command") for p in problems)
    assert any(p.startswith("sweep.yaml: fallback.1: unknown variant 'turbo'") for p in problems)
    assert not any("GPUs" in p for p in problems)  # ct200 lists 4: enough for `gpus: 3`


def test_an_experiments_chain_naming_a_variant_twice_is_refused():
    problems = problems_of("""
        batch: sweep
        targets: [ct200]
        matrix: {variant: [trees]}
        fallback: [trees, eager, trees]
    """)
    assert problems == ["sweep.yaml: fallback.2: variant 'trees' is already fallback.0; a chain runs each variant once, "
                        "in order: remove the repeat"]


def test_gpu_counts_are_checked_against_each_targets_listed_gpus():
    problems = problems_of("""
        batch: sweep
        targets: [all]
        matrix: {variant: [trees], gpus: [1, 2]}
    """)
    assert problems == ["sweep.yaml: matrix.gpus: a cell asks for 2 GPUs but target ct300 lists none "
                        "(give the container's `gpus:` in the inventory)"]
    one = problems_of("batch: sweep\ntargets: [ct300]\nmatrix: {variant: [trees], gpus: [1]}\n")
    assert one == ["sweep.yaml: matrix.gpus: a cell asks for 1 GPU but target ct300 lists none "
                   "(give the container's `gpus:` in the inventory)"]  # was "1 GPUs"


def test_yaml_syntax_error_points_at_the_line():
    assert problems_of("batch: [unclosed\n")[0].startswith("sweep.yaml: line 2, column 1: YAML syntax error")


# ---------------------------------------------------------------------------------------------- expansion

def test_matrix_expands_to_every_combination_with_stable_readable_ids():
    text = """
        batch: sweep
        targets: [host:pve1]
        matrix:
          variant: [trees, eager]
          set: [{batch_size: 4}, {batch_size: 8}]
          args: {lr: [0.001, 0.0003]}
        repeats: 2
        stop_when: {steps: 500}
    """
    plan = plan_of(text)
    assert len(plan.cells) == 2 * 2 * 2 * 2 * 2  # targets x variants x sets x lr x repeats
    assert len({cell.id for cell in plan.cells}) == len(plan.cells)
    first = plan.cells[0]
    assert (first.id, first.target, first.variant, dict(first.sets), first.repeat) == (
        "trees.ct200.batch_size-4_lr-0.001.r1", "ct200", "trees", {"batch_size": 4, "lr": 0.001}, 1)
    assert [c.repeat for c in plan.cells[:16]] == [1] * 16  # every configuration once before any repeat
    assert [c.id for c in plan_of(text).cells] == [c.id for c in plan.cells]  # same file, same ids
    assert plan.chain == ("trees", "nographs", "eager")
    assert plan.experiments.stop_when.kind == "steps" and plan.experiments.stop_when.value == 500


def test_odd_setting_values_get_a_hashed_id_and_fallback_false_means_no_chain():
    plan = plan_of("""
        batch: sweep
        targets: [ct300]
        matrix: {variant: [trees], set: [{tag: "a b/c"}, {tag: "a b/d"}]}
        fallback: false
    """)
    ids = [cell.id for cell in plan.cells]
    assert ids[0].startswith("trees.ct300.s") and ids[0] != ids[1]
    assert plan.chain == ()


def test_dry_run_rows_name_each_run_and_what_would_happen():
    plan = plan_of("batch: sweep\ntargets: [ct200]\nmatrix: {variant: [trees, eager]}\n")
    with Store.in_memory() as store:
        CellTable(store).save_plan(plan, "2026-11-29T12:00:00.000Z")
        CellTable(store).update("sweep", plan.cells[0].id, state="done")
        rows = plan_rows(plan, store)
    assert [(r["run"], r["action"]) for r in rows] == [("sweep.trees.ct200.r1", "skip (done)"), ("sweep.eager.ct200.r1", "start")]


# ---------------------------------------------------------------------------------------------- GPU ledger

def test_ledger_gives_disjoint_gpus_and_keeps_whole_target_cells_alone():
    plan = plan_of("batch: b\ntargets: [ct200]\nmatrix: {variant: [trees, eager, nographs], gpus: [2]}\nconcurrency: {per_target: 4}\n")
    ledger = GpuLedger(plan.target_gpus, per_target=4, total=None)
    a, b, c = plan.cells[:3]
    assert ledger.take(a) == (0, 1)
    assert ledger.take(b) == (2, 3)
    assert ledger.take(c) is None  # all four GPUs are held
    ledger.release(a.id)
    assert ledger.take(c) == (0, 1)
    whole = plan_of("batch: b\ntargets: [ct200]\nmatrix: {variant: [trees]}\n").cells[0]
    assert ledger.take(whole) is None  # needs the whole target
    ledger.release(b.id), ledger.release(c.id)
    assert ledger.take(whole) == (0, 1, 2, 3)
    assert ledger.take(a) is None


def test_ledger_caps_per_target_and_total():
    plan = plan_of("batch: b\ntargets: [ct200, ct201]\nmatrix: {variant: [trees, eager], gpus: [1]}\n")
    ledger = GpuLedger(plan.target_gpus, per_target=1, total=None)
    on_200 = [c for c in plan.cells if c.target == "ct200"]
    assert ledger.take(on_200[0]) == (0,)
    assert ledger.take(on_200[1]) is None  # per_target 1, although GPUs are free
    capped = GpuLedger(plan.target_gpus, per_target=2, total=2)
    assert [capped.take(c) is not None for c in plan.cells] == [True, True, False, False]


# ---------------------------------------------------------------------------------------------- scheduler

@dataclass
class Script:
    """How a fake run of a variant behaves: seconds until steady, or until it crashes."""

    steady_after: float | None = None
    crash_after: float | None = None
    stall_after: float | None = None  # judged stalled while its process lives on
    too_slow_after: float | None = None
    exit_after: float | None = None


@dataclass
class FakeWatcher:
    """Plays the Watcher as open_watcher builds it (the follower of the batch's Lifecycle): advances the fake clock,
    writes decisions and run states to the store as the real one does (a crash or stall names the chain's next
    variant as its judge does, fallback on), hands each decision of a run it follows to its Lifecycle (which acts
    on those BATCH_POLICY falls back on) and takes the outcomes of the Lifecycle's actions from its queue, following
    a fallback's successor (lifecycle.done); stop_run ends a run."""

    store: Store
    clock: list
    scripts: dict
    gpus_of: dict = field(default_factory=dict)  # run -> (gpu ids, whole target)
    attached: list = field(default_factory=list)
    stopped: list = field(default_factory=list)
    started_at: dict = field(default_factory=dict)
    max_live: int = 0
    watched: dict = field(default_factory=dict)  # run -> its watch.WatchedRun, as the Lifecycle reads and marks it
    queue: queue.Queue = field(default_factory=queue.Queue)  # the Lifecycle's outcomes (ActionDone)
    chains: dict = field(default_factory=dict)  # chain root -> its runs this watch knows
    events: list = field(default_factory=list)

    def attach(self, name):
        self.attached.append(name)
        self.started_at.setdefault(name, self.clock[0])
        if name in self.watched:
            return self.watched[name]
        run = self.store.get_run(name)
        lineage = self.store.lineage(name)
        root = lineage[0]
        runs = self.chains.setdefault(root, list(lineage))
        if name not in runs:
            runs.append(name)
        self.lifecycle.claim(root)
        earlier, _ = read_stored(run.decision)  # an earlier batch's verdict, restored as Watcher._resume does
        watched = self.watched[name] = WatchedRun(
            run, root, chain_variants(self.store, root, INVENTORY), judge=None, parse=None, source=run.target, gpus=(),
            decision=earlier or Decision.from_json({"decision": "undecided", "run": name, "action": "none"}))
        watched.handled = self.lifecycle.acted_before(run, root, earlier)
        watched.dirty = earlier is not None and self.lifecycle.acts_on(earlier.decision)
        return watched

    def chain_runs(self, root):
        return self.chains[root]

    def follows_chain(self, root):
        return root in self.chains

    def step(self, timeout):
        self.clock[0] += timeout
        outcomes = []
        while not self.queue.empty():
            outcomes.append(self.queue.get())
        for outcome in outcomes:
            if isinstance(outcome, OUTCOMES):
                self.lifecycle.done(outcome)
        for root in self.chains:
            self.lifecycle.claim(root)  # renewed, as Lifecycle.renew_claims does
        for run in self.store.list_runs(active=True):
            if run.name in self.started_at:  # followed once attached (a fallback's successor starts on its own thread)
                self.events += self._advance(run)
        for watched in list(self.watched.values()):  # handed to the Lifecycle, as Watcher._judge does
            if watched.dirty and not (watched.stopping or watched.handled):
                watched.dirty = False
                self.lifecycle.decided(watched)
        self.max_live = max(self.max_live, len(self.store.list_runs(active=True)))
        events, self.events = self.events, []
        return events

    def _advance(self, run):
        script = self.scripts[run.variant]
        age = self.clock[0] - self.started_at[run.name]
        if script.crash_after is not None and age >= script.crash_after:
            return self._decide(run, {"decision": "crash", "signature": "exit_nonzero"}, state="crashed",
                                ended=self.started_at[run.name] + script.crash_after)
        if script.too_slow_after is not None and age >= script.too_slow_after and not run.decision:
            return self._decide(run, {"decision": "too_slow", "action": "stop", "steady_tok_s": 500.0, "reason": "below baseline"})
        if script.stall_after is not None and age >= script.stall_after and not run.decision:
            return self._decide(run, {"decision": "stall", "reason": "no new step"})
        if script.exit_after is not None and age >= script.exit_after:
            return self._decide(run, {"decision": "exited", "action": "none", "reason": "exited 0"}, state="exited",
                                ended=self.started_at[run.name] + script.exit_after)
        if script.steady_after is not None and age >= script.steady_after and not run.decision:
            return self._decide(run, {"decision": "steady", "action": "keep", "steady_tok_s": 1000.0, "interval": [990.0, 1010.0]})
        return []

    def _decide(self, run, decision, state=None, ended=None):
        """`ended`: when the run's process ended (its exit file's time, which the real watcher records as ended_at),
        before this step noticed it. A crash or stall names the next variant of the run's chain (or says stop) as
        the judge of a Watcher with fallback on does (decide.next_variant, action_for)."""
        decision = {**decision, "run": run.name}
        if Verdict(decision["decision"]).falls_back():
            signature = CATALOGUE.by_id(decision["signature"]) if decision.get("signature") else None
            following = next_variant(chain_variants(self.store, self.store.lineage(run.name)[0], INVENTORY), run.variant,
                                     signature)
            action = action_for(decision["decision"], following, fallback_enabled=True)
            decision = {**decision, "action": str(action), "next_variant": following if action is Action.FALLBACK else None}
        ends = {"state": state, "ended_at": format_ts(ended), "ended_from": "exit_file"} if state else {}
        self.store.update_run(run.name, decision=decision, **ends)
        watched = self.watched.get(run.name)
        if watched is not None:
            watched.run, watched.decision, watched.dirty = self.store.get_run(run.name), Decision.from_json(decision), True
            watched.alive = False if state else watched.alive
        return [DecisionMade(at=utc_now(), run=run.name, chain=run.name, decision=decision)]

    def stop_run(self, name, reason):
        self.stopped.append((name, reason))
        self.store.update_run(name, state="stopped")
        watched = self.watched.get(name)
        if watched is not None:
            watched.stopping = True

    def live_gpus(self, target):
        return [self.gpus_of[r.name] for r in self.store.list_runs(active=True, target=target)]

    # what the Lifecycle tells its follower (watch.Watcher's methods of the same names)

    def emit(self, watched, cls, **data):
        event = cls(at=utc_now(), run=watched.name, chain=watched.root, **data)
        self.events.append(event)
        return event

    def publish(self, event, run, store):
        self.events.append(event)

    def record_decision(self, watched, *, said=True):
        self.store.update_run(watched.name, decision=watched.decision.to_json())

    def read_to_end(self, watched):
        watched.ended = True

    def stop_waiting(self, wait):
        pass


CATALOGUE = catalogue_for(INVENTORY)


def starter(store, watcher, plan, launched):
    lock = threading.Lock()  # the scheduler launches several cells at once, on threads

    def start(cell, gpu_ids, variant, name, parent=None):
        whole = cell.gpus is None
        with lock:
            for other_ids, other_whole in watcher.live_gpus(cell.target):
                assert not (whole or other_whole or set(other_ids) & set(gpu_ids)), f"{cell.id} overlaps a live run"
            watcher.gpus_of[name] = (gpu_ids, whole)
            store.add_run(Run(name=name, target=cell.target, variant=variant, batch=plan.batch, parent=parent, state="running",
                              chain=rest_of_chain(plan.chain, variant)))  # as run_spec and chains.next_spec record it
            launched.append(name)
        return name

    return start


class PlayedSupervisor(Supervisor):
    """chains.Supervisor (the intent recorded once and carried out once, the successor named and launched by
    the code `dfo watch` uses) with its two remote steps played: the stop ends the run through the scripted
    watcher, the launch starts the successor on its parent's GPUs as the starter does."""

    def __init__(self, store, watcher, plan, launched):
        super().__init__(INVENTORY, SimpleNamespace(container=lambda target: target), store)
        self.watcher, self.cells = watcher, {cell.run_name(plan.batch): cell for cell in plan.cells}
        self.start = starter(store, watcher, plan, launched)

    def stop(self, name, reason):
        self.watcher.stop_run(name, reason)
        return Outcome(name, stopped=True, signal="SIGTERM", reason=reason)

    def launch_when_released(self, target, spec, name, *, after):
        root = self.store.lineage(after)[0]
        gpu_ids, _ = self.watcher.gpus_of.pop(after)  # the stopped run's GPUs, now released
        self.start(self.cells[root], gpu_ids, spec.variant, name, after)
        return self.store.get_run(name)


def scheduled(text, scripts, store, clock=None):
    plan = plan_of(text)
    clock = clock or [1_800_000_000.0]
    watcher = FakeWatcher(store, clock, scripts)
    launched: list[str] = []
    scheduler = Scheduler(plan, store, with_lifecycle(watcher, PlayedSupervisor(store, watcher, plan, launched), clock),
                          starter(store, watcher, plan, launched), clock=lambda: clock[0], poll_s=5.0)
    return plan, watcher, launched, scheduler


def with_lifecycle(watcher, supervisor, clock):
    """`watcher` given the batch's one Lifecycle, as open_watcher builds the Watcher's (policy BATCH_POLICY; the
    Scheduler makes it the batch's: act_for_batch), over `supervisor`, its claims on the fake clock."""
    watcher.lifecycle = Lifecycle(watcher, watcher.store, supervisor, policy=BATCH_POLICY,
                                  claims=Claims(watcher.store, clock=lambda: clock[0]))
    return watcher


STEADY = {"trees": Script(steady_after=30), "nographs": Script(steady_after=20), "eager": Script(steady_after=10)}


def test_scheduler_never_puts_two_runs_on_one_gpu_and_respects_caps():
    text = """
        batch: sweep
        targets: [ct200, ct201]
        matrix: {variant: [trees, nographs, eager], gpus: [1, 2]}
        concurrency: {per_target: 3, total: 5}
    """
    with Store.in_memory() as store:
        plan, watcher, launched, scheduler = scheduled(text, STEADY, store)
        records = scheduler.run()
    assert [r.state for r in records] == ["done"] * len(plan.cells)
    assert len(launched) == len(plan.cells) == 12
    assert 1 < watcher.max_live <= 5  # cells overlapped in time, never more than total
    assert all(reason.endswith("stop_when steady") for _, reason in watcher.stopped)
    assert records[0].outcome["decision"]["steady_tok_s"] == 1000.0


def test_a_crash_follows_the_chain_and_a_failed_cell_does_not_stop_the_batch():
    scripts = {"trees": Script(stall_after=10), "nographs": Script(steady_after=20), "eager": Script(crash_after=5)}
    text = "batch: sweep\ntargets: [ct200, ct300]\nmatrix: {variant: [trees, eager]}\nfallback: [trees, nographs]\n"
    with Store.in_memory() as store:
        plan, watcher, launched, scheduler = scheduled(text, scripts, store)
        records = {r.cell.id: r for r in scheduler.run()}
        trees = records["trees.ct200.r1"]
        assert trees.state == "done"
        assert trees.outcome["runs"] == ["sweep.trees.ct200.r1", "sweep.trees.ct200.r1.2-nographs"]
        assert ("sweep.trees.ct200.r1", "batch sweep: stall: no new step") in watcher.stopped  # stopped before the fallback
        assert store.get_run("sweep.eager.ct300.r1").state == "crashed" and not any("eager" in n for n, _ in watcher.stopped)
        assert store.get_run("sweep.trees.ct200.r1.2-nographs").parent == "sweep.trees.ct200.r1"
        assert records["eager.ct300.r1"].state == "failed"  # eager is not in the chain: nothing to fall back to
        assert records["eager.ct300.r1"].outcome["decision"]["decision"] == "crash"
        assert sorted(launched) == ["sweep.eager.ct200.r1", "sweep.eager.ct300.r1", "sweep.trees.ct200.r1",
                                    "sweep.trees.ct200.r1.2-nographs", "sweep.trees.ct300.r1", "sweep.trees.ct300.r1.2-nographs"]


def test_stop_when_steps_and_minutes():
    scripts = {"trees": Script(steady_after=5)}
    with Store.in_memory() as store:
        plan, watcher, _, scheduler = scheduled("batch: m\ntargets: [ct300]\nmatrix: {variant: [trees]}\nstop_when: {minutes: 2}\n", scripts, store)
        record = scheduler.run()[0]
        assert record.state == "done" and record.outcome["why"].endswith("minutes")
        assert 120 <= scheduler.clock() - 1_800_000_000.0 <= 130  # steady at 5 s did not end it; 2 minutes did
    with Store.in_memory() as store:
        plan, watcher, _, scheduler = scheduled("batch: s\ntargets: [ct300]\nmatrix: {variant: [trees]}\nstop_when: {steps: 100}\n", scripts, store)
        original = watcher.step

        def step_with_samples(timeout):
            events = original(timeout)
            for run in store.list_runs(active=True):
                store.add_samples(run.name, [{"step": int(watcher.clock[0] - watcher.started_at[run.name]) * 4, "tok_s": 1.0}])
            return events

        watcher.step = step_with_samples
        record = scheduler.run()[0]
        assert record.state == "done" and record.outcome["why"] == "stop_when reached step 100"
        assert watcher.stopped == [("s.trees.ct300.r1", "batch s: stop_when reached step 100")]


def test_too_slow_is_a_measurement_the_cell_is_done_without_a_fallback():
    with Store.in_memory() as store:
        _, watcher, launched, scheduler = scheduled("batch: w\ntargets: [ct300]\nmatrix: {variant: [trees]}\n",
                                                    {"trees": Script(too_slow_after=10)}, store)
        record = scheduler.run()[0]
    assert (record.state, record.outcome["decision"]["steady_tok_s"]) == ("done", 500.0)
    assert launched == ["w.trees.ct300.r1"] and watcher.stopped == [("w.trees.ct300.r1", "batch w: too_slow: below baseline")]


def test_a_run_that_exits_before_its_condition_ends_its_cell():
    with Store.in_memory() as store:
        _, _, _, scheduler = scheduled("batch: e\ntargets: [ct300]\nmatrix: {variant: [trees]}\n", {"trees": Script(exit_after=12)}, store)
        record = scheduler.run()[0]
        run = store.get_run("e.trees.ct300.r1")
    assert record.state == "done" and record.outcome["decision"]["decision"] == "exited"
    # the cell ended when its run did (the exit file's time), not when the scheduler's next pass saw it
    assert (record.ended_at, run.ended_from) == (run.ended_at, "exit_file") == (format_ts(1_800_000_012.0), "exit_file")


def test_second_invocation_skips_finished_cells_and_reattaches_running_ones():
    text = "batch: r\ntargets: [ct200]\nmatrix: {variant: [trees, nographs, eager]}\n"
    clock = [1_800_000_000.0]
    with Store.in_memory() as store:
        plan, watcher, launched, scheduler = scheduled(text, STEADY, store, clock)
        seen = []

        def interrupt(progress):
            seen.append(progress)
            if progress.counts["done"] == 1 and progress.running:
                raise KeyboardInterrupt  # Ctrl-C while the second cell runs

        scheduler.on_progress = interrupt
        with pytest.raises(KeyboardInterrupt):
            scheduler.run()
        assert [r.state for r in CellTable(store).records("r")] == ["done", "running", "pending"]

        plan, watcher2, launched2, again = scheduled(text, STEADY, store, clock)
        watcher2.started_at.update(watcher.started_at)
        watcher2.gpus_of.update(watcher.gpus_of)
        records = again.run()
    assert [r.state for r in records] == ["done"] * 3
    assert launched2 == ["r.eager.ct200.r1"]  # trees was done, nographs reattached, only eager started
    assert watcher2.attached[0] == "r.nographs.ct200.r1"


@pytest.mark.parametrize("where", ["another workstation", "this workstation"])
def test_a_cell_held_by_another_dfo_batch_says_who_since_when_and_how_to_take_it_over_as_dfo_watch_does(where):
    """A cell whose lease a live dfo batch holds (pid 4242 on ws2, or a live process of this workstation) since 90 s:
    the batch says, once, who holds it, since when, that it only shows the cell meanwhile and what takes it over,
    in the words of `dfo watch`'s `lease_held` line (events.lease_held_text); it said only `run by another dfo batch
    (ws2:4242)`. The lease runs out (that dfo stopped renewing it): the batch takes the cell over and runs it."""
    import socket

    from orchestrator.events import LeaseHeld
    from orchestrator.logfmt import format_ts

    clock = [1_800_000_000.0]
    since = format_ts(clock[0] - 90)
    text = "batch: held\ntargets: [ct200]\nmatrix: {variant: [trees]}\n"
    host, pid = ("ws2.example.org", 4242) if where == "another workstation" else (socket.gethostname(), os.getpid())
    with Store.in_memory() as store:
        plan, watcher, launched, scheduler = scheduled(text, STEADY, store, clock)
        key = f"cell:held/{plan.cells[0].id}"
        store.claim(key, "other-dfo", pid=pid, host=host, ttl_s=15, now=clock[0] - 90)
        store.claim(key, "other-dfo", pid=pid, host=host, ttl_s=15, now=clock[0])  # renewed: 15 s left
        news: list[str] = []
        scheduler.on_progress = lambda progress: news.extend(line for line in progress.news if line not in news)
        records = scheduler.run()
    said = [line for line in news if "held by dfo" in line or "another dfo batch" in line]
    held = (f"trees.ct200.r1: its cell is held by dfo pid {pid} on {host} since {since[:10]} {since[11:19]} UTC: this "
            "batch shows it and stores or acts on nothing while that dfo renews its lease; it takes the cell over ")
    if where == "another workstation":  # its pid cannot be looked at from here: the lease is waited out
        assert said == [held + "once that dfo ends (its lease runs out 15 s later): end it on ws2.example.org "
                               "(Ctrl-C, or kill 4242) to take over"], news
        watch_line = LeaseHeld(at="", run="r", chain="r", host=host, pid=pid, since=since, lease_s=15).text
        assert said[0] == "trees.ct200.r1: " + watch_line.replace("chain", "cell").replace("this watch", "this batch")
    else:  # chains.Claims takes a cell of a dfo of this workstation over the moment its pid is gone
        assert said == [held + f"as soon as that dfo ends: end it (Ctrl-C, or kill {pid}) to take over"], news
    assert [r.state for r in records] == ["done"] and launched == ["held.trees.ct200.r1"]  # taken over once it ran out


def test_a_cell_whose_launch_is_refused_is_reported_and_retried_next_time():
    from orchestrator.errors import RefusedError

    text = "batch: x\ntargets: [ct200, ct300]\nmatrix: {variant: [eager]}\n"
    with Store.in_memory() as store:
        plan, watcher, launched, scheduler = scheduled(text, STEADY, store)
        good = scheduler.start

        def refuse_ct300(cell, *args):
            if cell.target == "ct300":
                raise RefusedError("GPUs busy")
            return good(cell, *args)

        scheduler.start = refuse_ct300
        states = [(r.state, r.outcome.get("error")) for r in scheduler.run()]
        assert states == [("done", None), ("error", "GPUs busy")]
        _, _, launched2, again = scheduled(text, STEADY, store)
        assert [r.state for r in again.run()] == ["done", "done"]
        assert launched2 == ["x.eager.ct300.r1"]


def test_batch_reads_decisions_from_the_watchers_typed_events_only():
    made = DecisionMade(at="2026-01-01T00:00:00.000Z", run="a", chain="a", decision={"decision": "steady", "run": "a"})
    assert decision_of(made) == {"decision": "steady", "run": "a"}
    assert decision_of(Step(at=made.at, run="a", chain="a", step=3, tok_s=1.0, loss=None, phase=None)) is None


# ---------------------------------------------------------------------------------------------- files and CLI

REPO = Path(__file__).resolve().parents[1]


def test_the_example_sweep_is_valid_against_the_example_lab():
    plan = load_experiments(REPO / "examples/compile-sweep.yaml", load_inventory(REPO / "inventory/lab.example.yaml"))
    assert len(plan.cells) == 3 * 2 * 2 * 2 * 2  # variants x set x drafter.layers x targets x repeats
    assert all(cell.gpus == 4 for cell in plan.cells)


def test_cli_refuses_a_broken_file_with_exit_2_and_prints_a_dry_run_plan(tmp_path):
    env = {"DFO_HOME": str(tmp_path / "state")}
    inventory = REPO / "inventory/lab.example.yaml"
    broken = tmp_path / "broken.yaml"
    broken.write_text("batch: b\ntargets: [ct200]\nmatrix: {variant: [trees]}\nstop_when: sometimes\n")
    refused = dfo("batch", str(broken), "-i", str(inventory), env=env)
    assert refused.returncode == 2
    assert f"dfo: error: {broken}: stop_when: expected steady" in " ".join(refused.stderr.split())
    plan = dfo("batch", str(REPO / "examples/compile-sweep.yaml"), "-i", str(inventory), "--dry-run", "--json", env=env)
    assert plan.returncode == 0, plan.stderr
    cells = json.loads(plan.stdout)["cells"]
    assert len(cells) == 48 and {c["action"] for c in cells} == {"start"}


def test_settings_that_read_alike_get_distinct_ids_and_exact_duplicates_run_once():
    plan = plan_of("batch: d\ntargets: [ct300]\nmatrix: {variant: [trees, trees], set: [{a: 1}, {a: '1'}, {a: 1}]}\n")
    ids = [cell.id for cell in plan.cells]
    assert len(ids) == 2 == len(set(ids))
    assert all(cell_id.startswith("trees.ct300.s") for cell_id in ids)


def test_a_cells_runs_carry_its_settings_and_gpus_into_every_fallback():
    plan = plan_of("batch: g\ntargets: [ct200]\nmatrix: {variant: [trees], set: [{data.batch: 8}], gpus: [2]}\n")
    cell = plan.cells[0]
    first = run_spec(plan, INVENTORY, cell, (2, 3), "trees")
    with Store.in_memory() as store:  # a fallback's spec is `dfo watch`'s: from what the cell's first run was launched with
        root = store.add_run(Run(name="g.trees.ct200.data.batch-8.g2.r1", target="ct200", variant="trees", batch="g",
                                 state="crashed"))
        store.add_event(root.name, "started", {"sets": dict(first.sets), "env": dict(first.env), "wandb": first.wandb})
        fallback = next_spec(INVENTORY, store, store.get_run(root.name), "nographs", plan.chain)
    for spec in (first, fallback):
        assert spec.env["CUDA_VISIBLE_DEVICES"] == "2,3" and spec.args["data.batch"] == 8 and spec.batch == "g"
    assert (first.variant, first.chain, first.parent) == ("trees", ("nographs", "eager"), None)
    assert (fallback.compile, fallback.chain, fallback.parent) == ("nographs", ("eager",), "g.trees.ct200.data.batch-8.g2.r1")
    whole = plan_of("batch: g\ntargets: [ct200]\nmatrix: {variant: [trees]}\n").cells[0]
    assert "CUDA_VISIBLE_DEVICES" not in run_spec(plan, INVENTORY, whole, (0, 1, 2, 3), "trees").env  # the container's own view


def test_a_stop_interrupted_by_ctrl_c_is_finished_on_resume_not_taken_for_a_crash():
    text = "batch: i\ntargets: [ct300]\nmatrix: {variant: [trees]}\n"
    with Store.in_memory() as store:
        _, watcher, _, scheduler = scheduled(text, STEADY, store)
        watcher.stop_run = lambda name, reason: watcher.stopped.append((name, reason))  # the stop is still in flight

        def interrupt(progress):
            if watcher.stopped:
                raise KeyboardInterrupt

        scheduler.on_progress = interrupt
        with pytest.raises(KeyboardInterrupt):
            scheduler.run()
        # meanwhile the stop's SIGTERM ended the run; reattached, the watcher judges its exit 143 a crash
        crash = {"decision": "crash", "run": "i.trees.ct300.r1", "action": "stop", "signature": "exit_nonzero"}
        store.update_run("i.trees.ct300.r1", state="crashed", exit_code=143, decision=crash)
        _, _, launched, again = scheduled(text, STEADY, store)
        record = again.run()[0]
    assert (record.state, record.outcome["decision"]["decision"], record.outcome["why"]) == ("done", "steady", "stop_when steady")
    assert launched == []  # trees is first in the chain, yet nothing fell back: the exit was dfo's own stop


def test_a_stop_when_stop_and_a_fallback_of_one_cell_never_both_run():
    # a) stop_when steady holds and the cell's stop is under way (the run not ended yet) when the watcher judges it
    # stalled, a verdict the batch falls back on, and then its SIGTERM's exit (143) a crash: the cell ends done
    # with its steady figure, one stop, nothing falls back
    text = "batch: x\ntargets: [ct300]\nmatrix: {variant: [trees]}\nfallback: [trees, nographs]\n"
    with Store.in_memory() as store:
        _, watcher, launched, scheduler = scheduled(text, STEADY, store)
        original = watcher.step

        def judged(name, decision, **state):
            decision = {**decision, "run": name}
            store.update_run(name, decision=decision, **state)
            scheduler.decisions[name] = decision

        def stop_in_flight(name, reason):
            watcher.stopped.append((name, reason))
            judged(name, {"decision": "stall", "action": "stop", "reason": "no new step"})  # still running

        looks_since_stop = []

        def step_then_end(timeout):  # the stop's SIGTERM ends the run three looks later, judged a crash
            events = original(timeout)
            if watcher.stopped:
                looks_since_stop.append(timeout)
                if len(looks_since_stop) == 3:
                    judged(watcher.stopped[0][0], {"decision": "crash", "action": "stop", "signature": "exit_nonzero"},
                           state="crashed", exit_code=143)
            return events

        watcher.stop_run, watcher.step = stop_in_flight, step_then_end
        record = scheduler.run()[0]
        assert (record.state, record.outcome["decision"]["decision"], record.outcome["why"]) == ("done", "steady", "stop_when steady")
        assert launched == ["x.trees.ct300.r1"] and len(watcher.stopped) == 1
        assert store.open_intents("x.trees.ct300.r1") == [] and store.find_run("x.trees.ct300.r1.2-nographs") is None
    # b) the run crashes at the step stop_when steps is reached: the crash falls back (one stop, the fallback's),
    # no stop_when stop of the crashed run beside it; the successor then meets stop_when and is stopped once
    text = "batch: y\ntargets: [ct300]\nmatrix: {variant: [trees]}\nfallback: [trees, nographs]\nstop_when: {steps: 100}\n"
    scripts = {"trees": Script(crash_after=25), "nographs": Script()}
    with Store.in_memory() as store:
        _, watcher, launched, scheduler = scheduled(text, scripts, store)
        original = watcher.step

        def step_with_samples(timeout):
            events = original(timeout)
            for run in store.list_runs():
                if run.name in watcher.started_at and (run.active or run.state == "crashed"):
                    step = int(watcher.clock[0] - watcher.started_at[run.name]) * 4  # step 100 at 25 s
                    store.add_samples(run.name, [{"step": min(step, 100), "tok_s": 1.0}])
            return events

        watcher.step = step_with_samples
        record = scheduler.run()[0]
        assert launched == ["y.trees.ct300.r1", "y.trees.ct300.r1.2-nographs"]
        assert (record.state, record.outcome["why"], record.outcome["final_run"]) == (
            "done", "stop_when reached step 100", "y.trees.ct300.r1.2-nographs")
        assert watcher.stopped == [("y.trees.ct300.r1.2-nographs", "batch y: stop_when reached step 100")]
        assert store.get_run("y.trees.ct300.r1.2-nographs").parent == "y.trees.ct300.r1"
        assert store.open_intents("y.trees.ct300.r1") == []  # the fallback's intent carried out, once


def test_a_cells_fallback_is_recorded_once_and_one_a_dead_batch_left_open_is_finished_on_resume():
    from orchestrator.chains import FALLBACK, record_fallback

    text = "batch: o\ntargets: [ct200]\nmatrix: {variant: [trees]}\nfallback: [trees, nographs]\n"
    scripts = {"trees": Script(stall_after=10), "nographs": Script(steady_after=20)}
    with Store.in_memory() as store:
        _, watcher, launched, scheduler = scheduled(text, scripts, store)
        died = threading.Event()

        def die(target, spec, name, *, after):  # the fallback's launch, on the Lifecycle's worker: it goes no further
            died.set()
            raise RuntimeError("the batch died here")

        def dead(progress):  # ... nor does the batch's loop
            if died.is_set():
                raise KeyboardInterrupt

        scheduler.supervisor.launch_when_released, scheduler.on_progress = die, dead
        with pytest.raises(KeyboardInterrupt):  # the batch dies inside the fallback's launch, after its stop
            scheduler.run()
        [intent] = store.open_intents("o.trees.ct200.r1")
        assert (intent.kind, intent.data["name"]) == (FALLBACK, "o.trees.ct200.r1.2-nographs")
        assert record_fallback(store, "o.trees.ct200.r1", FALLBACK, {**intent.data, "name": "other"}).id == intent.id  # once
        assert watcher.stopped == [("o.trees.ct200.r1", "batch o: stall: no new step")] and launched == ["o.trees.ct200.r1"]

        _, watcher2, launched2, again = scheduled(text, scripts, store)
        watcher2.gpus_of.update(watcher.gpus_of)
        [record] = again.run()
    assert (record.state, record.outcome["runs"]) == ("done", ["o.trees.ct200.r1", "o.trees.ct200.r1.2-nographs"])
    assert launched2 == ["o.trees.ct200.r1.2-nographs"] and watcher2.stopped[-1][1] == "batch o: stop_when steady"


def falling_back_stuck(store, batch):
    """A one-cell batch whose run stalls and whose fallback's launch is stuck until the test sets `release`
    (`launching` set once it is)."""
    from orchestrator.chains import GpusStillBusy

    text = f"batch: {batch}\ntargets: [ct200]\nmatrix: {{variant: [trees]}}\nfallback: [trees, nographs]\n"
    _, _, _, scheduler = scheduled(text, {"trees": Script(stall_after=10)}, store)
    launching, release = threading.Event(), threading.Event()

    def stuck(target, spec, name, *, after):
        launching.set()
        release.wait(60)
        raise GpusStillBusy("released only by the test")

    scheduler.supervisor.launch_when_released = stuck
    return scheduler, launching, release


def run_until_it_leaves(scheduler, release, waited):
    """scheduler.run() on a thread, as the batch command runs it, left 10 s to leave (`waited`: what it did if it
    does not), then the stuck remote call `release`d; what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            scheduler.run()
        except BaseException as exc:  # noqa: BLE001 - what the batch command would get
            raised.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    try:
        runner.join(10)
        assert not runner.is_alive(), waited
    finally:
        release.set()
        runner.join(10)
    [left] = raised
    return left


def test_a_second_ctrl_c_while_the_first_is_being_reported_leaves_the_fallback_at_once():
    # Ctrl-C while a cell falls back; the second comes while dfo is still saying which fallback it finishes
    # (on_interrupt): dfo leaves at once with the fallback left half done (FallbacksLeft), as a second Ctrl-C
    # during the wait does, instead of waiting for the fallback (here, a launch that never ends)
    from orchestrator.batch import FallbacksLeft

    with Store.in_memory() as store:
        scheduler, launching, release = falling_back_stuck(store, "cc")

        def first_ctrl_c(progress):
            if launching.is_set():
                raise KeyboardInterrupt

        def second_ctrl_c(fallbacks):
            raise KeyboardInterrupt

        scheduler.on_progress, scheduler.on_interrupt = first_ctrl_c, second_ctrl_c
        left = run_until_it_leaves(scheduler, release, "dfo batch waited for the fallback after a second Ctrl-C")
        assert isinstance(left, FallbacksLeft) and left.fallbacks == ["cc.trees.ct200.r1 to nographs (cell trees.ct200.r1)"]
        [intent] = store.open_intents("cc.trees.ct200.r1")  # half done, for the next dfo batch
        assert intent.data["variant"] == "nographs"


def test_one_ctrl_c_leaves_a_cells_fallback_stuck_past_its_bound_half_done_instead_of_waiting_for_ever():
    # Ctrl-C once while a cell falls back, its launch stuck past every remote call's timeout (the fallback's
    # bound): dfo batch waits for it only that long, then leaves it half done (FallbacksLeft, overdue_s: the
    # words `dfo watch` says), its intent open for the next `dfo batch`; it waited for ever before
    from orchestrator.batch import FallbacksLeft
    with Store.in_memory() as store:
        scheduler, launching, release = falling_back_stuck(store, "od")

        def ctrl_c(progress):
            if launching.is_set():
                raise KeyboardInterrupt

        told: list[list[str]] = []
        scheduler.supervisor.bound_s = lambda run, *, launches: 0.2  # its remote calls' timeouts, played short
        scheduler.on_progress, scheduler.on_interrupt = ctrl_c, told.append
        left = run_until_it_leaves(scheduler, release, "dfo batch waited for a fallback stuck past its bound")
        assert told == [["od.trees.ct200.r1 to nographs (cell trees.ct200.r1)"]]
        assert isinstance(left, FallbacksLeft) and left.overdue_s == 0.2
        assert left.fallbacks == ["od.trees.ct200.r1 to nographs (cell trees.ct200.r1)"]
        [intent] = store.open_intents("od.trees.ct200.r1")  # half done, for the next dfo batch
        assert intent.data["variant"] == "nographs"


def test_a_fallback_that_cannot_start_closes_its_cell_as_failed_with_the_verdict_and_why():
    from orchestrator.chains import GpusStillBusy

    text = "batch: n\ntargets: [ct200]\nmatrix: {variant: [trees]}\nfallback: [trees, nographs]\n"
    with Store.in_memory() as store:
        _, _, launched, scheduler = scheduled(text, {"trees": Script(stall_after=10)}, store)

        def busy(target, spec, name, *, after):
            raise GpusStillBusy(f"not launching {spec.variant}: the GPUs of {spec.target} are still busy")

        scheduler.supervisor.launch_when_released = busy
        [record] = scheduler.run()
        assert store.open_intents() == []  # closed: a launch that failed is not tried again
    assert record.state == "failed" and record.outcome["decision"]["decision"] == "stall"
    assert record.outcome["why"] == "stall; fallback did not start: not launching nographs: the GPUs of ct200 are still busy"
    assert launched == ["n.trees.ct200.r1"]


def test_a_fallback_whose_stop_keeps_failing_leaves_its_cell_to_the_next_batch_which_finishes_it_on_its_gpus():
    text = "batch: u\ntargets: [ct200]\nmatrix: {variant: [trees]}\nfallback: [trees, nographs]\n"
    scripts = {"trees": Script(stall_after=10), "nographs": Script(steady_after=20)}
    with Store.in_memory() as store:
        _, watcher, launched, scheduler = scheduled(text, scripts, store)
        tries = []

        def unreachable(name, reason):
            tries.append(name)
            return Outcome(name, reason=reason, error="stop failed: ct200 unreachable")

        scheduler.supervisor.stop = unreachable
        [record] = scheduler.run()
        [intent] = store.open_intents("u.trees.ct200.r1")  # left open for the next `dfo batch` of the file
        assert record.state == "error" and record.outcome["decision"]["decision"] == "stall"
        assert "stop failed: ct200 unreachable (the fallback stays open: the next `dfo batch`" in record.outcome["why"]
        assert set(tries) == {"u.trees.ct200.r1"} and launched == ["u.trees.ct200.r1"]  # nothing launched
        held = record.gpu_ids

        _, watcher2, launched2, again = scheduled(text, scripts, store)  # the target answers again
        watcher2.gpus_of.update(watcher.gpus_of)
        [record] = again.run()
    assert (record.state, record.outcome["runs"]) == ("done", ["u.trees.ct200.r1", "u.trees.ct200.r1.2-nographs"])
    assert launched2 == ["u.trees.ct200.r1.2-nographs"] and record.gpu_ids == held != ()


def test_a_damaged_stored_decision_is_no_verdict_the_cell_falls_back_from_nothing_and_closes_when_its_run_ends():
    # batch.py read a run's stored decision by string: a damaged one (a crash whose signature is no name, as an
    # older or broken dfo may leave in the registry) was taken for a crash verdict and fallen back from; it is read
    # through decide.read_stored now, and one it cannot read is no verdict
    class DamagedWatcher(FakeWatcher):
        def _advance(self, run):
            if self.clock[0] - self.started_at[run.name] >= 5 and run.active:
                self.store.update_run(run.name, state="crashed", decision={"decision": "crash", "action": "fallback",
                                                                           "signature": 5, "run": run.name})
            return []

    text = "batch: d\ntargets: [ct300]\nmatrix: {variant: [trees]}\nfallback: [trees, nographs]\n"
    with Store.in_memory() as store:
        plan = plan_of(text)
        clock, launched = [1_800_000_000.0], []
        watcher = DamagedWatcher(store, clock, {"trees": Script()})
        scheduler = Scheduler(plan, store, with_lifecycle(watcher, PlayedSupervisor(store, watcher, plan, launched), clock),
                              starter(store, watcher, plan, launched), clock=lambda: clock[0], poll_s=5.0)
        [record] = scheduler.run()
        assert launched == ["d.trees.ct300.r1"] and store.open_intents() == []  # nothing fallen back to
        assert record.state == "failed" and record.outcome["why"].startswith("run ended (crashed")


class FollowingWatcher(FakeWatcher):
    """The fake watcher whose stop_run is the Watcher's: a stop on its Lifecycle's executor (Lifecycle.stop, a
    worker thread, its outcome put on the queue), not one carried out at once."""

    def stop_run(self, name, reason):
        self.lifecycle.stop(self.watched[name], reason)


def test_one_ctrl_c_while_a_stop_when_stop_is_under_way_waits_for_it_within_its_bound_and_reports_it_half_done():
    # stop_when steady holds, and the cell's stop is stuck past every remote call's timeout (its bound) when Ctrl-C
    # comes: dfo batch says it finishes that stop first, waits for it only that long and leaves it half done
    # (FallbacksLeft, overdue_s). Before, the stop ran on the Watcher's own Lifecycle, a second one of the batch:
    # the Ctrl-C path neither said nor awaited it (a plain KeyboardInterrupt, the stop cut off by the exit)
    from orchestrator.batch import FallbacksLeft

    text = "batch: sw\ntargets: [ct200]\nmatrix: {variant: [trees]}\n"
    stopping, release = threading.Event(), threading.Event()

    class StuckStop(Supervisor):
        def stop(self, name, reason):
            stopping.set()
            release.wait(60)
            return Outcome(name, error="released only by the test")

        def bound_s(self, run, *, launches):
            return 0.2  # its remote calls' timeouts, played short

    with Store.in_memory() as store:
        plan, clock, launched = plan_of(text), [1_800_000_000.0], []
        watcher = FollowingWatcher(store, clock, {"trees": Script(steady_after=10)})
        with_lifecycle(watcher, StuckStop(INVENTORY, SimpleNamespace(container=lambda t: t), store), clock)
        told: list[list[str]] = []

        def ctrl_c(progress):
            if stopping.is_set():
                raise KeyboardInterrupt

        scheduler = Scheduler(plan, store, watcher, starter(store, watcher, plan, launched), clock=lambda: clock[0],
                              poll_s=5.0, on_progress=ctrl_c, on_interrupt=told.append)
        left = run_until_it_leaves(scheduler, release, "dfo batch waited for a stop stuck past its bound")
        assert told == [["sw.trees.ct200.r1 (a stop only: batch sw: stop_when steady)"]]
        assert isinstance(left, FallbacksLeft) and left.overdue_s == 0.2
        assert left.fallbacks == ["sw.trees.ct200.r1 (a stop only: batch sw: stop_when steady)"]
