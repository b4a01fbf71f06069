"""The lifecycle controller: what is done about a watched run's decisions, and the one executor that does it.

    follower (watch.Watcher: observe, parse, judge, store, emit)  --each decision of a run it follows-->  Lifecycle
                                                                                                        policy: act?
        <--ActionDone on the follower's queue: read the stopped run to its end, follow the successor--  executor
                                                                                                        (worker threads)

The Watcher hands every decision it reaches (Lifecycle.decided, with the run it follows) to its Lifecycle and acts on
none: the Lifecycle owns the policy (which verdicts are answered with the chain's next variant: chains.WATCH_POLICY
or BATCH_POLICY), the chain claims (chains.Claims: only the holder of a chain's claim acts, and only it stores),
the fallback intents a dead dfo left open, and the executor: chains.Supervisor (intent, identity-checked stop,
GPU release, launch) on worker threads, each bounded (UnderWay), their outcomes handed back to the follower's
loop through its queue (ActionDone), and the Ctrl-C path (finish_actions: what is under way is finished, a second
Ctrl-C leaves it half done with its intent open; nothing remote is signalled by either).

Here, not in chains.py: chains.py is the library of chain steps (naming, specs, intents carried out once, the
Supervisor) that a multi-node fallback and `dfo batch` call too; this is the one object that decides to call them for a
followed run and runs them off the loop's thread.

What it must not do: judge (decide/ does), read a log or store samples (the follower does), render or parse options.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from . import events as ev
from .chains import (GPU_RELEASE_S, WATCH_POLICY, Claims, FallbacksLeft, Outcome, Policy, Supervisor, batch_command,
                     chain_key, fallback_text, finish_under_way, wait_until)
from .errors import DfoError
from .states import Action
from .store import Store, utc_now

if TYPE_CHECKING:  # the follower; imported only for its types (watch.py imports this module)
    from .watch import Watcher, WatchedRun

ACTION_JOIN_S = 5.0  # on close: how long the actions under way get to end before the claims are given up

ActionDone = Outcome  # what an action thread did, handed back to the follower's loop through its queue


@dataclass
class UnderWay:
    """A fallback or a stop carried out on a worker thread: what it does, in words, and how long it takes at the
    most, every remote call of it at its timeout (Supervisor.bound_s)."""

    what: str
    bound_s: float
    started: float = field(default_factory=time.monotonic)
    ended: threading.Event = field(default_factory=threading.Event)  # set by its thread, whatever it did
    result: Any = None  # a caller's own action (carry_out): what its work returned, once ended
    raised: BaseException | None = None  # ... or what it raised

    @property
    def deadline(self) -> float:
        return self.started + self.bound_s


class Lifecycle:
    """The policy, the claims and the one executor of actions of one follower (a Watcher): see the module
    docstring. `fallback` False: verdicts are reported, never acted on (--no-fallback, and `dfo batch`, whose
    scheduler acts on its cells' verdicts itself)."""

    def __init__(self, follower: "Watcher", store: Store, supervisor: Supervisor, *, fallback: bool = True,
                 policy: Policy = WATCH_POLICY, claims: Claims | None = None) -> None:
        self.follower, self.store, self.supervisor = follower, store, supervisor
        self.fallback = fallback
        self.policy = policy  # the verdicts answered with the chain's next variant
        self.claims = claims or Claims(store)
        self.owned: set[str] = set()  # chain roots whose claim is held here (the follower stores, this acts for them)
        self.actions: list[UnderWay] = []
        self._left_to_batch: set[int] = set()  # the open batch fallbacks (intent ids) said to be left to dfo batch

    @classmethod
    def for_watch(cls, follower: "Watcher", inventory, connections, store: Store, *, stop_grace_s: float | None,
                  gpu_release_s: float = GPU_RELEASE_S, fallback: bool = True, policy: Policy = WATCH_POLICY,
                  claims: Claims | None = None) -> "Lifecycle":
        """The lifecycle of a watch: its Supervisor's stops tell the follower while they wait for a run to exit."""
        supervisor = Supervisor(inventory, connections, store, stop_grace_s=stop_grace_s, gpu_release_s=gpu_release_s,
                                on_wait=follower.stop_waiting)
        return cls(follower, store, supervisor, fallback=fallback, policy=policy, claims=claims)

    # ------------------------------------------------------------------ claims: who stores, who acts

    def claim(self, root: str) -> bool:
        """Whether this dfo holds chain `root`'s claim now (the registry's lease, chains.Claims): held, the follower
        stores for the chain and this lifecycle acts for it; given up or held elsewhere, neither (stores_for)."""
        held = self.claims.holds(chain_key(root))
        (self.owned.add if held else self.owned.discard)(root)
        return held

    def stores_for(self, root: str) -> bool:
        """The one check of "only the chain's owner stores (and acts)": whether chain `root`'s claim was held here at
        the last claim(); an observing follower shows what it reads and keeps it for a take-over."""
        return root in self.owned

    def stores_any(self) -> bool:
        """Whether this lifecycle holds any chain's claim (a target's own events are stored only then)."""
        return bool(self.owned)

    # ------------------------------------------------------------------ policy

    def acts_on(self, verdict: str | None) -> bool:
        """Whether `verdict` is one this lifecycle answers with the chain's next variant (a final one to act on)."""
        return self.policy.falls_back(verdict)

    def decided(self, watched: "WatchedRun") -> None:
        """The follower's decision about `watched` (watched.decision): acted on once, by the chain's owner, when the
        policy says so."""
        if watched.handled or not self.stores_for(watched.root) or not self.acts_on(watched.decision.decision):
            return
        self._act(watched)

    def acted_on(self, watched: "WatchedRun") -> bool:
        """Whether the chain's former owner acted on the run's verdict already, so that a take-over does not act
        (nor record the action) again: a fallback it recorded (its intent, open or done: an open one is finished
        by finish_open_intents) or whose successor it launched; a stop it asked for (stop_requested_at, set
        before the signal) or recorded as under way (its stored `acting` event: the run had ended already)."""
        if self.store.children(watched.name) or self.store.intents_about(watched.root, watched.name):
            return True
        run = self.store.find_run(watched.name)
        if watched.decision.action is not Action.STOP or run is None:
            return False
        return run.stop_requested_at is not None or bool(self.store.events(watched.name, kind=ev.Acting.kind))

    # ------------------------------------------------------------------ acting

    def stop(self, watched: "WatchedRun", reason: str) -> None:
        """Stop a followed run for the caller's own reason (batch's stop_when); no fallback follows."""
        if watched.stopping:
            return
        watched.stopping = watched.acting = True
        watched.stopped_reason = reason
        self.follower.emit(watched, ev.Stopping, reason=reason)
        self._start_action(watched, launch_next=None, reason=reason)

    def _act(self, watched: "WatchedRun") -> None:
        """A final verdict: with fallback on, stop the run (if it still runs) and launch the next variant."""
        watched.handled = True
        decision = watched.decision
        if not self.fallback or not decision.action.acts():
            return  # --no-fallback only reports
        if watched.run.batch:  # a batch cell's run: `dfo batch` acts, keeping the cell's GPUs in its bookkeeping
            self.follower.emit(watched, ev.LeftToBatch, batch=watched.run.batch,
                               command=batch_command(self.store, watched.run.batch))
            return
        watched.stopping = watched.acting = True
        self.follower.emit(watched, ev.Acting, action=decision.action, next_variant=decision.next_variant)
        self._start_action(watched, launch_next=decision.next_variant if decision.action is Action.FALLBACK else None,
                           reason=decision.decision + (f" [{decision.signature}]" if decision.signature else ""))

    def _start_action(self, watched: "WatchedRun", *, launch_next: str | None, reason: str) -> None:
        """Hand the run to the supervisor on a worker thread: a fallback (intent, stop, GPUs, launch), or a stop."""
        bound_s = self.supervisor.bound_s(watched.run, launches=bool(launch_next))
        if launch_next:
            self._start_worker(watched, lambda: self.supervisor.fall_back(watched.run, launch_next, watched.chain, reason),
                               UnderWay(fallback_text({"run": watched.name, "variant": launch_next}), bound_s))
        elif watched.alive is not False and watched.run.active:
            self._start_worker(watched, lambda: self.supervisor.stop(watched.name, reason),
                               UnderWay(f"{watched.name} (a stop only: {reason})", bound_s))
        else:
            self.follower.queue.put(ActionDone(watched.name, reason=reason))

    def _start_worker(self, watched: "WatchedRun", work: Callable[[], Any], action: UnderWay) -> None:
        """Run `work` (`action`) on its own thread; what it did comes back to the follower's loop as ActionDone(s)
        on its queue."""
        def body() -> None:
            try:
                try:
                    done = work()
                except DfoError as exc:
                    done = ActionDone(watched.name, error=str(exc))
                for item in done if isinstance(done, list) else [done]:
                    self.follower.queue.put(item)
            finally:
                action.ended.set()

        self.actions.append(action)
        threading.Thread(target=body, name=f"act-{watched.name}", daemon=True).start()

    def done(self, done: ActionDone) -> None:
        """What an action did, on the follower's loop: the stopped run read to its end and no longer followed, the
        stop and the fallback said (and the decision's next_run recorded), the successor followed."""
        follower = self.follower
        watched = follower.watched.get(done.run)
        if watched is None:  # an intent finished for a run of the chain this watch did not follow
            if done.launched is not None and done.launched.name not in follower.watched:
                follower.attach(done.launched.name)
            return
        watched.acting, watched.exit_wait = False, None
        follower.read_to_end(watched)
        refreshed = self.store.find_run(watched.name)
        watched.run = refreshed or watched.run
        if not watched.run.active:
            watched.alive = False  # no longer followed: its end is what the stop recorded
        if done.stopped:
            follower.emit(watched, ev.Stopped, signal=done.signal, reason=done.reason)
        if done.note:
            follower.emit(watched, ev.NotSignalled, why=done.note)
        if done.error:
            follower.emit(watched, ev.ActionError, error=done.error)
        if done.launched is not None:
            follower.chain_runs(watched.root).append(done.launched.name)
            watched.decision = replace(watched.decision, next_run=done.launched.name)
            follower.record_decision(watched, said=False)  # the crash was said; fell_back names its successor
            follower.emit(watched, ev.FellBack, next_run=done.launched.name, variant=done.launched.variant)
            try:
                follower.attach(done.launched.name)
            except DfoError as exc:  # it runs; `dfo watch` can pick it up once the target answers
                follower.emit(watched, ev.ActionError, error=f"cannot follow {done.launched.name}: {exc}")

    # ------------------------------------------------------------------ intents a dead dfo left open

    def finish_open_intents(self, root: str) -> None:
        """A fallback a dfo that died left half done: finish it (stop, launch) on a worker; the runs it is about
        are acted on already, so their verdicts start nothing more."""
        intents = self.store.open_intents(root) if self.fallback else []
        batch = self.store.get_run(root).batch if intents else None
        watched_runs = self.follower.watched
        for intent in intents:
            watched = watched_runs.get(intent.data["run"])
            if batch:  # a batch cell's: `dfo batch` finishes it (its GPU ledger), never this watch
                self._leave_to_batch(root, intent, batch)
            elif watched is not None:
                watched.handled = watched.acting = watched.stopping = True
        if batch:
            return
        current = watched_runs.get(self.follower.chain_runs(root)[-1])
        if intents and current is not None:
            bound_s = sum(self.supervisor.bound_s(self.store.find_run(intent.data["run"]) or current.run, launches=True)
                          for intent in intents)
            self._start_worker(current, lambda: self.supervisor.finish_open(root),
                               UnderWay("; ".join(fallback_text(intent.data) for intent in intents), bound_s))

    def _leave_to_batch(self, root: str, intent, batch: str) -> None:
        """Say once (however often the chain is attached or taken over) that the open fallback `intent` of batch
        cell chain `root` is left to `dfo batch`, which this watch names; its run is acted on already."""
        watched = self.follower.watched.get(intent.data["run"])
        if watched is not None:
            watched.handled = True
        if intent.id in self._left_to_batch:
            return
        self._left_to_batch.add(intent.id)
        event = ev.LeftToBatch(at=utc_now(), run=intent.data["run"], chain=root, batch=batch,
                               command=batch_command(self.store, batch))
        self.follower.publish(event, intent.data["run"], event.stored and self.stores_for(root))

    # ------------------------------------------------------------------ a caller's own actions (dfo batch's cells)

    def carry_out(self, what: str, bound_s: float, work: Callable[[], Any]) -> UnderWay:
        """`work` (`what`, in Ctrl-C's words) on a worker thread of this executor, for a caller that takes what it
        did itself (dfo batch: a cell's fallback, its GPU ledger follows the outcome): bounded by `bound_s` and
        finished on Ctrl-C with this lifecycle's own actions (finish_actions); what it returned, or raised (a
        Ctrl-C inside it too), is kept on the returned UnderWay once `ended` is set, never put on the follower's queue."""
        action = UnderWay(what, bound_s)

        def body() -> None:
            try:
                action.result = work()
            except BaseException as exc:  # noqa: BLE001 - the caller's loop raises it again or takes it as an error
                action.raised = exc
            finally:
                action.ended.set()

        self.actions.append(action)
        threading.Thread(target=body, name=f"act-{what[:40]}", daemon=True).start()
        return action

    # ------------------------------------------------------------------ ending

    def under_way(self) -> bool:
        """Whether an action has not ended yet."""
        return any(not action.ended.is_set() for action in self.actions)

    def finish_actions(self, on_interrupt: Callable[[list[str]], None]) -> FallbacksLeft | None:
        """Ctrl-C: the fallbacks (and stops) under way are carried to their end before the watch ends
        (chains.finish_under_way: `on_interrupt` is told which, `RUN to VARIANT`); a second Ctrl-C leaves them
        half done, their intents open for the next `dfo watch` (returned FallbacksLeft), at once. So does an
        action still under way past its bound (UnderWay.deadline; FallbacksLeft.overdue_s says how long that is):
        a remote call stuck past its own timeout does not keep dfo from ending. Nothing remote is signalled."""
        under_way = [action for action in self.actions if not action.ended.is_set()]
        if not under_way:
            return None
        described = [action.what for action in under_way]
        left = finish_under_way(described, lambda: described, on_interrupt,
                                lambda: [wait_until(action.ended.is_set, action.deadline) for action in under_way])
        overdue = [action for action in under_way if not action.ended.is_set()]
        if left is None and overdue:
            return FallbacksLeft([action.what for action in overdue],
                                 overdue_s=max(action.bound_s for action in overdue))
        return left

    def close(self) -> None:
        """The actions under way get ACTION_JOIN_S to end; then the claims are given up."""
        wait_until(lambda: all(action.ended.is_set() for action in self.actions), time.monotonic() + ACTION_JOIN_S)
        self.claims.release_all()
