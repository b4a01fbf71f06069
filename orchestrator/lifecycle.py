"""The lifecycle controller: what is done about a watched run's decisions, and the one executor that does it.

    follower (watch.Watcher: observe, parse, judge, store, emit)  --each decision of a run it follows-->  Lifecycle
                                                                                                        policy: act?
        <--ActionDone / GroupDone on the follower's queue: read the stopped runs to their end, follow    executor
           the successors--                                                                             (worker threads)

The Watcher hands every decision it reaches (Lifecycle.decided, with the run it follows) to its Lifecycle and acts on
none: the Lifecycle owns the policy (which verdicts are answered with the chain's next variant: chains.WATCH_POLICY
or BATCH_POLICY), the chain claims (chains.Claims: only the holder of a chain's claim acts, and only it stores),
the fallback intents a dead dfo left open, and the executor: chains.Supervisor (intent, identity-checked stop,
GPU release, launch) on worker threads, each bounded (UnderWay), their outcomes handed back to the follower's
loop through its queue (ActionDone), and the Ctrl-C path (finish_actions: what is under way is finished, a second
Ctrl-C leaves it half done with its intent open; nothing remote is signalled by either).

A multi-node run (a group: multinode.py) is acted on here too, while the watch goes on: its nodes never fall back on
their own (their chains are empty), so after each judgement (judged) the group whose nodes all have a verdict gets
its combined decision (multinode.group_fallback) and, when that calls for a fallback, it is carried out once, on the
same executor with the same bound, claims, intent and Ctrl-C path as a single run's (multinode.fall_back: its intent
recorded once, carried out by chains.carry_out_fallback); its outcome (GroupDone) has the watch follow the successor's
nodes, each in its predecessor node's chain.

A fallback a dfo that died left half done (an open intent in the registry: a single run's, or a group's) is finished
here too, by the lifecycle of the watch that holds the chain's claim (node 0's chain, for a group), when it attaches
the chain or takes it over (finish_open_intents), on the same executor, with the same bound and Ctrl-C path; its
outcome (IntentDone) is taken as the action's it finishes (ActionDone, GroupDone). A watch that only observes the chain
holds its runs meanwhile and, once the holder has closed the intent, says and follows what it launched
(await_open_intents, look_at_awaited). A batch cell's is left to `dfo batch` (left_to_batch).

A batch's own Lifecycle (its Watcher's, act_for_batch) acts the same way on its cells' runs, under BATCH_POLICY: the
verdict's fallback carried out on the cell's GPUs with its first launch's settings (chains.next_spec), at most
`at_once` at a time, its successor followed (ActionDone); the scheduler keeps only its GPU ledger and stop_when, and
reads what the fallback left from the cell's chain (handled, busy; finish_fallbacks carries out again a cell's
fallback left open). A plain watch leaves a batch cell's verdict to `dfo batch` (LeftToBatch).

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
from .chains import (FALLBACK, GPU_RELEASE_S, MULTINODE_FALLBACK, WATCH_POLICY, Claims, FallbacksLeft, Outcome, Policy,
                     Supervisor, batch_command, chain_key, fallback_text, finish_under_way, outcome_of, wait_until)
from .decide import Decision, verdict_key
from .errors import DfoError
from .logfmt import format_ts
from .states import Action
from .store import Intent, Run, Store, utc_now

if TYPE_CHECKING:  # the follower; imported only for its types (watch.py imports this module)
    from .watch import Watcher, WatchedRun

ACTION_JOIN_S = 5.0  # on close: how long the actions under way get to end before the claims are given up

ActionDone = Outcome  # what an action thread did, handed back to the follower's loop through its queue


@dataclass(frozen=True)
class GroupDone:
    """What a multi-node group's fallback did, handed back to the follower's loop through its queue: the closed
    intent's data (`next_run` and `nodes`, or `error` when its launch failed: closed, not tried again), or `error`
    alone when the fallback stays open (a stop that failed, a start that got no answer: the next `dfo watch`
    finishes it)."""

    group: str
    data: dict | None = None
    error: str | None = None


@dataclass(frozen=True)
class IntentDone:
    """What finishing a fallback a dfo that died left open (intent `intent`) did: a single run's ActionDone, or a
    group's GroupDone; handed back to the follower's loop through its queue (or taken there at once, by a watch that
    saw the chain's holder close it: Lifecycle.look_at_awaited)."""

    intent: int
    done: "ActionDone | GroupDone"


OUTCOMES = (ActionDone, GroupDone, IntentDone)  # what the executor hands back to the follower's loop (Lifecycle.done)
AWAIT_LOOK_S = 1.0  # how often a watch looks whether an open intent the chain's holder finishes was closed


@dataclass
class OpenIntent:
    """A fallback a dfo that died left open, as this lifecycle knows it: finished here (the chain's claim is held
    here) or `awaited` (the holder, another dfo, finishes it; this watch says and follows what it launched). `runs`:
    the run it falls back from (a group: every node of it); `passed`: the runs the dead dfo put after them in their
    chains (a successor half launched: adopted, or passed by for the next name). The followed ones of both are held
    (acted on: their verdicts start nothing) until it is finished."""

    intent: Intent
    runs: frozenset[str]
    passed: frozenset[str]
    awaited: bool

    @property
    def group(self) -> str | None:
        """The multi-node run it falls back from (None: a single run's)."""
        return self.intent.data["run"] if self.intent.kind == MULTINODE_FALLBACK else None


@dataclass(frozen=True)
class BatchActing:
    """What a batch's own lifecycle acts with (Lifecycle.act_for_batch): the batch whose cells' verdicts it acts on, how
    many cell fallbacks run at once (the rest wait their turn, inside their bound) and a chain's cell, in Ctrl-C's
    words (` (cell CELL)`)."""

    batch: str
    turns: threading.BoundedSemaphore
    cell_of: Callable[[str], str | None]


@dataclass
class UnderWay:
    """A fallback or a stop carried out on a worker thread: what it does, in words, and how long it takes at the
    most, every remote call of it at its timeout (Supervisor.bound_s)."""

    what: str
    bound_s: float
    started: float = field(default_factory=time.monotonic)
    ended: threading.Event = field(default_factory=threading.Event)  # set by its thread, whatever it did
    about: str | None = None  # the run (or group) it acts on

    @property
    def deadline(self) -> float:
        return self.started + self.bound_s


class Lifecycle:
    """The policy, the claims and the one executor of actions of one follower (a Watcher): see the module
    docstring. `fallback` False: verdicts are reported, never acted on (--no-fallback)."""

    def __init__(self, follower: "Watcher", store: Store, supervisor: Supervisor, *, fallback: bool = True,
                 policy: Policy = WATCH_POLICY, claims: Claims | None = None, began: str | None = None) -> None:
        self.follower, self.store, self.supervisor = follower, store, supervisor
        self.fallback = fallback
        self.policy = policy  # the verdicts answered with the chain's next variant
        self.claims = claims or Claims(store)
        self.owned: set[str] = set()  # chain roots whose claim is held here (the follower stores, this acts for them)
        self.actions: list[UnderWay] = []  # those under way (an ended one is dropped when the next starts)
        self._left_to_batch: set[int] = set()  # the open batch fallbacks (intent ids) said to be left to dfo batch
        self._groups: dict[str, str | None] = {}  # followed run -> its multi-node group (None: a single run)
        self._nodes: dict[str, list[str]] = {}  # group -> its node runs, node 0 first
        self._asked: dict[str, tuple] = {}  # group -> its nodes' verdicts when group_fallback was last asked
        self._groups_acted: set[str] = set()  # groups whose fallback this lifecycle has carried out (or tried)
        self._open: dict[int, OpenIntent] = {}  # open intents a dead dfo left, finished here or awaited (by id)
        self._tried: set[int] = set()  # those this lifecycle finished (or tried: one left open is the next watch's)
        self._looked_at = 0.0  # when the awaited intents were last looked at (look_at_awaited)
        self._began = began or utc_now()  # a group fallback another dfo closed since then is said here too
        self._said_groups: set[str] = set()  # groups whose fallback this lifecycle said (multinode_fell_back)
        self._newer_looked_at: dict[str, float] = {}  # chain root -> when its holder's new runs were looked up
        self._said_held: dict[str, str] = {}  # chain root -> the owner of another workstation said to hold it
        self.batch: BatchActing | None = None  # a batch's own lifecycle: its cells' verdicts are acted on here

    @classmethod
    def for_watch(cls, follower: "Watcher", inventory, connections, store: Store, *, stop_grace_s: float | None,
                  gpu_release_s: float = GPU_RELEASE_S, fallback: bool = True, policy: Policy = WATCH_POLICY,
                  claims: Claims | None = None, began: str | None = None) -> "Lifecycle":
        """The lifecycle of a watch: its Supervisor's stops tell the follower while they wait for a run to exit.
        `began`: when the watch began (before it listed its runs; default now)."""
        supervisor = Supervisor(inventory, connections, store, stop_grace_s=stop_grace_s, gpu_release_s=gpu_release_s,
                                on_wait=follower.stop_waiting)
        return cls(follower, store, supervisor, fallback=fallback, policy=policy, claims=claims, began=began)

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

    def holder_of(self, root: str) -> str | None:
        """Who holds chain `root`'s claim, as `host:pid` (None: nobody)."""
        claim = self.claims.holder(chain_key(root))
        return None if claim is None else f"{claim.host}:{claim.pid}"

    def attached(self, root: str) -> None:
        """The follower attached a run of chain `root`: the fallbacks a dead dfo left open in it finished here when this
        dfo holds the chain (finish_open_intents), else awaited from its holder (await_open_intents), who is said."""
        if self.stores_for(root):
            self.finish_open_intents(root)
            return
        self.await_open_intents(root)
        self._say_held_elsewhere(root)

    def renew_claims(self) -> None:
        """On the follower's loop: the claims held renewed; a chain whose holder's lease ran out taken over (the
        follower stores what it kept, took_over; what its holder left half done finished here); while only observing
        one, its holder said once per holder, and the runs it adds (its fallbacks) followed, looked up every second."""
        now = time.monotonic()
        for root in self.follower.chain_roots():
            had = self.stores_for(root)
            held = self.claim(root)
            if held and not had:
                self.follower.took_over(root)
                self.finish_open_intents(root)
            elif not held:
                self._say_held_elsewhere(root)
                if now - self._newer_looked_at.get(root, 0.0) >= 1.0:
                    self._newer_looked_at[root] = now
                    self.follower.follow_newer(root)

    def _say_held_elsewhere(self, root: str) -> None:
        """Say once per holder (not at each renewal) that `root`'s chain is held by a dfo of another workstation,
        whose lease this watch waits on: who (host, pid, since when, as the registry records it), and how to take
        it over."""
        claim = self.claims.held_elsewhere(chain_key(root))
        watched = self.follower.watched.get(self.follower.chain_runs(root)[-1])
        if claim is None or watched is None or self._said_held.get(root) == claim.owner:
            return
        self._said_held[root] = claim.owner
        self.follower.emit(watched, ev.LeaseHeld, host=claim.host, pid=claim.pid, since=format_ts(claim.since),
                           lease_s=round(claim.expires_at - claim.renewed_at, 3))

    # ------------------------------------------------------------------ policy

    def acts_on(self, verdict: str | None) -> bool:
        """Whether `verdict` is one this lifecycle answers with the chain's next variant (a final one to act on)."""
        return self.policy.falls_back(verdict)

    def act_for_batch(self, batch: str, *, at_once: int, cell_of: Callable[[str], str | None]) -> None:
        """Make this the lifecycle of `dfo batch` `batch` (its scheduler's): the verdicts of its cells' runs are acted
        on here (a plain watch leaves them to `dfo batch`), at most `at_once` fallbacks at a time; `cell_of(root)`
        names a chain's cell for Ctrl-C's words."""
        self.batch = BatchActing(batch, threading.BoundedSemaphore(at_once), cell_of)

    def acts_for(self, batch: str | None) -> bool:
        """Whether a run of `batch` (None: of none) is acted on here: any plain run; a batch cell's only by its batch's
        own lifecycle (its GPU ledger is the batch's)."""
        return not batch or (self.batch is not None and self.batch.batch == batch)

    def acted_before(self, run: Run, root: str, earlier: Decision | None) -> bool:
        """Whether an earlier dfo acted on the final verdict `earlier` it recorded for `run` (of chain `root`), which is
        then restored, not acted on again: a verdict this lifecycle acts on, and its successor exists, or the run has
        ended; a run of this batch's own cells only once its fallback (an intent about it) or a stop of it
        (stop_requested_at, an `acting` event) was recorded: a `dfo watch` leaves a cell's verdict to `dfo batch`,
        recorded and not acted on."""
        if earlier is None or not self.acts_on(earlier.decision):
            return False
        if self.store.children(run.name):
            return True
        if not (run.batch and self.acts_for(run.batch)):
            return not run.active
        return (bool(self.store.intents_about(root, run.name)) or run.stop_requested_at is not None
                or bool(self.store.events(run.name, kind=ev.Acting.kind)))

    def settled(self, watched: "WatchedRun") -> bool:
        """Whether nothing is left to do about followed run `watched`: no action of it under way, and it was stopped
        for a reason of its own, given up on, or holds a final verdict acted on or not one this lifecycle acts on."""
        if watched.acting:
            return False
        if watched.nothing_ran:  # settled, unless a fallback of its chain is being finished: its successor comes
            return not any(known.intent.subject == watched.root or watched.root in known.runs
                           for known in self._open.values())
        if watched.stopped_reason is not None or watched.lost:
            return True
        return watched.decision.final and (watched.handled or not self.acts_on(watched.decision.decision))

    def handled(self, name: str) -> bool | None:
        """Whether this lifecycle is done with followed run `name`'s final verdict (acted on, or reported) and has no
        action of it under way: False while it is not, None when it does not follow `name`."""
        watched = self.follower.watched.get(name)
        return None if watched is None else watched.handled and not watched.acting

    def busy(self, name: str) -> bool:
        """Whether an action on run `name` (a fallback, a stop, an open fallback carried out again) is under way."""
        watched = self.follower.watched.get(name)
        return (watched is not None and watched.acting) or any(
            action.about == name and not action.ended.is_set() for action in self.actions)

    def decided(self, watched: "WatchedRun") -> None:
        """The follower's decision about `watched` (watched.decision): acted on once, by the chain's owner, when the
        policy says so."""
        if watched.handled or not self.stores_for(watched.root) or not self.acts_on(watched.decision.decision):
            return
        self._act(watched)

    def acted_on(self, watched: "WatchedRun") -> bool:
        """Whether the chain's former owner acted on the run's verdict already, so that a take-over does not act
        (nor record the action) again: a fallback it recorded (its intent, open or done: an open one is finished
        here by finish_open_intents) or whose successor it launched; a stop it asked for (stop_requested_at, set
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
        if not self.acts_for(watched.run.batch):  # another batch's cell: `dfo batch` acts (the cell's GPUs, its ledger)
            self.follower.emit(watched, ev.LeftToBatch, batch=watched.run.batch,
                               command=batch_command(self.store, watched.run.batch))
            return
        watched.stopping = watched.acting = True
        self.follower.emit(watched, ev.Acting, action=decision.action, next_variant=decision.next_variant)
        if self.batch is not None:  # a cell's: said as the batch says it
            reason = f"batch {self.batch.batch}: " + f"{decision.decision}: {decision.reason or ''}".strip(": ")
        else:
            reason = decision.decision + (f" [{decision.signature}]" if decision.signature else "")
        self._start_action(watched, launch_next=decision.next_variant if decision.action is Action.FALLBACK else None,
                           reason=reason)

    def _start_action(self, watched: "WatchedRun", *, launch_next: str | None, reason: str) -> None:
        """Hand the run to the supervisor on a worker thread: a fallback (intent, stop, GPUs, launch), or a stop."""
        bound_s = self.supervisor.bound_s(watched.run, launches=bool(launch_next))
        if launch_next:
            what = fallback_text({"run": watched.name, "variant": launch_next}) + self._cell(watched.root)
            fall_back = self._in_turn(lambda: self.supervisor.fall_back(watched.run, launch_next, watched.chain, reason))
            self._start_worker(watched.name, fall_back, UnderWay(what, bound_s))
        elif watched.alive is not False and watched.run.active:
            self._start_worker(watched.name, lambda: self.supervisor.stop(watched.name, reason),
                               UnderWay(f"{watched.name} (a stop only: {reason})", bound_s))
        else:
            self.follower.queue.put(ActionDone(watched.name, reason=reason))

    def _start_worker(self, name: str, work: Callable[[], Any], action: UnderWay,
                      failed: Callable[[str], Any] | None = None) -> None:
        """Run `work` (`action`, about run or group `name`) on its own thread; what it did comes back to the
        follower's loop on its queue (ActionDone(s), GroupDone), and so does what it raised (`failed(why)`, an
        ActionDone of `name` with that error by default): a bug in an action is said as its error, and the run is
        not left `acting`, with the watch waiting on it for ever."""
        failed = failed or (lambda why: ActionDone(name, error=why))
        action.about = name

        def body() -> None:
            try:
                try:
                    done = work()
                except DfoError as exc:
                    done = failed(str(exc))
                except Exception as exc:  # noqa: BLE001 - a bug: said as the action's error (a Ctrl-C still ends it)
                    done = failed(f"internal error: {type(exc).__name__}: {exc}")
                for item in done if isinstance(done, list) else [done]:
                    self.follower.queue.put(item)
            finally:
                action.ended.set()

        # the ended ones go: only those under way are asked about, and a batch of many cells runs for days
        self.actions = [under_way for under_way in self.actions if not under_way.ended.is_set()] + [action]
        threading.Thread(target=body, name=f"act-{name}", daemon=True).start()

    def finish_fallbacks(self, root: str) -> None:
        """Carry out again, on a worker, the fallbacks of chain `root` recorded and left open (their stop failed, or a
        dfo that died left them half done), for a caller that keeps what they run on (`dfo batch`: the cell's GPUs,
        whose scheduler asks once nothing is under way about them): bounded, in turn, finished on Ctrl-C as any
        action; their outcomes are taken as a fallback's (done: the successor followed)."""
        intents = [intent for intent in self.store.open_intents(root) if intent.kind == FALLBACK]
        if not intents:
            return
        runs = [self.store.find_run(intent.data["run"]) or self.store.get_run(root) for intent in intents]
        bound_s = sum(self.supervisor.bound_s(run, launches=True) for run in runs)
        what = "; ".join(fallback_text(intent.data) for intent in intents) + self._cell(root)
        self._start_worker(intents[0].data["run"], self._in_turn(lambda: self.supervisor.finish_open(root)),
                           UnderWay(what, bound_s))

    def _in_turn(self, work: Callable[[], Any]) -> Callable[[], Any]:
        """`work` (a fallback) waiting its turn first when a batch's lifecycle has `at_once` of them under way."""
        if self.batch is None:
            return work

        def in_turn() -> Any:
            with self.batch.turns:
                return work()

        return in_turn

    def _cell(self, root: str) -> str:
        """` (cell CELL)` for a chain of the batch's own cells (Ctrl-C's words for its actions), else nothing."""
        cell = self.batch.cell_of(root) if self.batch is not None else None
        return f" (cell {cell})" if cell else ""

    def done(self, done: ActionDone | GroupDone | IntentDone) -> None:
        """What an action did, on the follower's loop: the stopped run read to its end and no longer followed, the
        stop and the fallback said (and the decision's next_run recorded), the successor followed (a group's:
        _group_done; an open intent's: _intent_done)."""
        if isinstance(done, IntentDone):
            self._intent_done(done)
        elif isinstance(done, GroupDone):
            self._group_done(done)
        else:
            self._run_done(done)

    def _run_done(self, done: ActionDone) -> None:
        """What a single run's stop or fallback did (done)."""
        follower = self.follower
        watched = follower.watched.get(done.run)
        if watched is None:  # an open intent's run this watch does not follow: it follows what a dead dfo launched after
            self._unfollowed_done(done)
            return
        self._action_ended(watched)
        if done.stopped:
            follower.emit(watched, ev.Stopped, signal=done.signal, reason=done.reason)
        if done.note:
            follower.emit(watched, ev.NotSignalled, why=done.note)
        if done.error:
            follower.emit(watched, ev.ActionError, error=done.error)
        if done.launched is not None:
            watched.decision = replace(watched.decision, next_run=done.launched.name)
            follower.record_decision(watched, said=False)  # the crash was said; fell_back names its successor
            follower.emit(watched, ev.FellBack, next_run=done.launched.name, variant=done.launched.variant)
            self._follow(watched.root, done.launched.name, watched.name)

    def _unfollowed_done(self, done: ActionDone) -> None:
        """What finishing an open intent did about a run this watch does not follow (it follows the successor a dead dfo
        left half launched after it, which the intent's finish adopted or passed by): said as of that run, and the
        successor followed in its chain."""
        root = self.store.lineage(done.run)[0]
        if done.error:
            self._say(ev.ActionError(at=utc_now(), run=done.run, chain=root, error=done.error), root)
        if done.launched is not None:
            self._say(ev.FellBack(at=utc_now(), run=done.run, chain=root, next_run=done.launched.name,
                                  variant=done.launched.variant), root)
            self._follow(root, done.launched.name, done.run)

    def _say(self, event: ev.RunEvent, root: str) -> None:
        """An event of this lifecycle's about a run it may not follow: shown, and stored by the chain's owner."""
        self.follower.publish(event, event.run, event.stored and self.stores_for(root))

    def _action_ended(self, watched: "WatchedRun") -> None:
        """An action on `watched` ended: what it logged is read to its end (Watcher.read_to_end) and, ended, it is no
        longer followed (its end is what the stop recorded)."""
        watched.acting, watched.exit_wait = False, None
        self.follower.read_to_end(watched)
        watched.run = self.store.find_run(watched.name) or watched.run
        if not watched.run.active:
            watched.alive = False

    def _follow(self, root: str, successor: str, after: str) -> None:
        """Follow `successor`, the run launched after run `after` in chain `root` (the chain's current run from here on,
        even if it cannot be followed); one whose target does not answer runs on, said (`dfo watch` picks it up once
        the target answers)."""
        runs = self.follower.chain_runs(root) if self.follower.follows_chain(root) else None
        if runs is not None and successor not in runs:
            runs.append(successor)
        try:
            self.follower.attach(successor)
        except DfoError as exc:
            self._say(ev.ActionError(at=utc_now(), run=after, chain=root, error=f"cannot follow {successor}: {exc}"), root)

    # ------------------------------------------------------------------ multi-node groups

    def judged(self) -> None:
        """After a judgement of the follower's runs: each multi-node group whose nodes it all follows, and whose node
        0's chain this lifecycle holds (a second watch of the group only shows it), is decided as one once every node
        has a verdict (or was given up on) and no node's own stop is under way: multinode.group_fallback under this
        lifecycle's policy, asked again only when a node's verdict moved; a fallback it calls for is carried out
        once (_fall_back_group)."""
        if not self.fallback:
            return
        for group in dict.fromkeys(filter(None, map(self._group_of, list(self.follower.watched)))):
            nodes = self._followed_nodes(group)
            if group in self._groups_acted or nodes is None or not self.stores_for(nodes[0].root):
                continue
            verdicts = tuple((verdict_key(node.decision), node.given_up) for node in nodes)
            if (any(node.acting or not (node.given_up or node.decision.final) for node in nodes)
                    or self._asked.get(group) == verdicts):
                continue
            self._asked[group] = verdicts
            from .multinode import group_fallback  # here: multinode -> report -> batch -> this module
            data = group_fallback(self.supervisor.inventory, self.store, group, policy=self.policy)
            if data is not None:
                self._fall_back_group(group, data, nodes)

    def _group_of(self, name: str) -> str | None:
        """The multi-node group followed run `name` is a node of (None: a single run), looked up once."""
        if name not in self._groups:
            group = self.store.node_group(name)
            self._groups[name] = group[0] if group else None
        return self._groups[name]

    def _followed_nodes(self, group: str) -> list["WatchedRun"] | None:
        """`group`'s nodes as the follower follows them, node 0 first; None when it does not follow every one."""
        if group not in self._nodes:
            self._nodes[group] = self.store.nodes_of(group)
        nodes = [self.follower.watched.get(name) for name in self._nodes[group]]
        return None if None in nodes else nodes

    def _fall_back_group(self, group: str, data: dict, nodes: list["WatchedRun"]) -> None:
        """Carry out `group`'s fallback (group_fallback's `data`) on a worker (multinode.fall_back: its intent recorded
        once, then stop and launch through chains.carry_out_fallback), bounded as its nodes' fallbacks one after the
        other plus the rendezvous check; every node is acted on meanwhile (its own verdict starts nothing more, and its
        exit is no verdict: the fallback stops it). The outcome comes back as GroupDone."""
        from .multinode import fall_back

        self._groups_acted.add(group)
        for node in nodes:
            node.handled = node.acting = node.stopping = True
        self._start_group(group, fallback_text(data), [node.run for node in nodes],
                          lambda *args, **waits: fall_back(*args, data, **waits))

    def _start_group(self, group: str, what: str, nodes: list[Run], carry: Callable[..., dict],
                     tag: Callable[[GroupDone], Any] = lambda done: done) -> None:
        """Carry out a fallback of `group` (`what`, in Ctrl-C's words) on a worker: `carry(inventory, connections,
        store, gpu_release_s=, on_wait=)` (multinode.fall_back, or finish_fallback for an intent a dead dfo left),
        bounded as its `nodes`' fallbacks one after the other plus the rendezvous check. What it did comes back as
        GroupDone (`tag`ged: an open intent's IntentDone); a DfoError leaves its intent open (the next `dfo watch`)."""
        from .multinode import RENDEZVOUS_TIMEOUT

        supervisor = self.supervisor
        bound_s = sum(supervisor.bound_s(node, launches=True) for node in nodes) + RENDEZVOUS_TIMEOUT

        def work() -> Any:
            try:
                return tag(GroupDone(group, data=carry(supervisor.inventory, supervisor.connections, self.store,
                                                       gpu_release_s=supervisor.gpu_release_s, on_wait=supervisor.on_wait)))
            except DfoError as exc:  # its intent stays open: the next `dfo watch` finishes it
                return tag(GroupDone(group, error=str(exc)))

        self._start_worker(group, work, UnderWay(what, bound_s), lambda why: tag(GroupDone(group, error=why)))

    def _group_done(self, done: GroupDone) -> None:
        """What a group's fallback did, on the follower's loop: its nodes this watch follows read to their end and no
        longer followed, the fallback said once for the group (MultinodeFellBack; the registry's fell_back is
        multinode.finish_fallback's), and each node of the successor followed in its predecessor node's chain; or why
        it failed, said of the group."""
        from .multinode import root_of

        names = self.store.nodes_of(done.group)
        roots = []
        for name in names:
            node = self.follower.watched.get(name)
            if node is not None:
                self._action_ended(node)
            roots.append(node.root if node is not None else self.store.lineage(name)[0])
        chain, data = root_of(self.store, done.group), done.data or {}
        error = done.error or data.get("error")
        if error:
            self._say(ev.ActionError(at=utc_now(), run=done.group, chain=chain, error=f"falling back failed: {error}"),
                      roots[0])
            return
        self._said_groups.add(done.group)
        self.follower.publish(ev.MultinodeFellBack(at=utc_now(), run=done.group, chain=chain, next_run=data["next_run"],
                                                   nodes=data["nodes"]), done.group, False)
        for name, root, successor in zip(names, roots, data["nodes"]):  # node K's successor is node K of the successor
            self._follow(root, successor, name)

    # ------------------------------------------------------------------ intents a dead dfo left open

    def finish_open_intents(self, root: str) -> None:
        """The fallbacks a dfo that died left half done in chain `root`, whose claim this lifecycle holds (on attach and
        on take-over): a single run's, and, `root` being node 0's chain of a multi-node run, its group's; each finished
        once (_finish) on the executor, with its bound and Ctrl-C's path, the runs it is about held meanwhile
        (OpenIntent). A batch cell's is left to `dfo batch` (its GPU ledger)."""
        self._open_intents(root, awaited=False)

    def await_open_intents(self, root: str) -> None:
        """The same in chain `root`, whose claim another dfo holds (on attach): that one finishes them; this one holds
        their runs meanwhile and, once one is closed (look_at_awaited), says what it did and follows its successor, as
        the dfo that finished it does. Taking the chain over finishes it here (finish_open_intents)."""
        self._open_intents(root, awaited=True)

    def _open_intents(self, root: str, *, awaited: bool) -> None:
        if not self.fallback:
            return
        self._hold()  # a run attached since an intent was found that the intent is about: held too
        batch = None
        for intent in self._intents_in(root):
            batch = batch or self.store.get_run(root).batch
            if batch:  # a batch cell's: `dfo batch` finishes it (its GPU ledger), never a watch
                if not awaited:
                    self._leave_to_batch(root, intent, batch)
                continue
            known = self._open.get(intent.id)
            if known is None and intent.id not in self._tried:
                known = self._open[intent.id] = OpenIntent(intent, *self._runs_of(intent), awaited=awaited)
                self._hold()
            elif known is None or awaited or not known.awaited:
                continue  # tried here already, awaited already, or being finished here
            known.awaited = awaited
            if not awaited:
                self._finish(known)
        self._closed_since_began(root)

    def _closed_since_began(self, root: str) -> None:
        """A group fallback in chain `root` that another dfo finished after this watch began, but before this watch
        found it open (two watches started at once: the other one's finish came between this one's listing of the
        runs and its attaching them): awaited as if found open, so that it is said here too and its successor
        followed (look_at_awaited takes it at once, it being closed), as a watch that found it open says it."""
        group = self.store.node_group(root)
        if not (group and group[1] == 0) or group[0] in self._said_groups:
            return
        for intent in self.store.intents_about(group[0], group[0]):
            if (intent.kind == MULTINODE_FALLBACK and intent.done_at is not None and intent.done_at >= self._began
                    and intent.id not in self._open and intent.id not in self._tried):
                self._tried.add(intent.id)  # looked at once
                self._open[intent.id] = OpenIntent(intent, *self._runs_of(intent), awaited=True)
                self._hold()

    def _intents_in(self, root: str) -> list[Intent]:
        """The open fallback intents of chain `root`: a single run's (subject: the chain's root), or a multi-node run's
        when `root` is node 0's chain of one (subject: the multi-node run it started from, multinode.root_of)."""
        group = self.store.node_group(root)
        subject, kind = (group[0], MULTINODE_FALLBACK) if group and group[1] == 0 else (root, FALLBACK)
        return [intent for intent in self.store.open_intents(subject) if intent.kind == kind]

    def _runs_of(self, intent: Intent) -> tuple[frozenset[str], frozenset[str]]:
        """The runs an open intent is about (OpenIntent.runs) and those a dead dfo put after them (OpenIntent.passed)."""
        run = intent.data["run"]
        runs = (self.store.nodes_of(run) if intent.kind == MULTINODE_FALLBACK else []) or [run]
        return frozenset(runs), frozenset(after for name in runs for after in self.store.chain_runs(name)[1:])

    def _hold(self) -> None:
        """Hold the followed runs of every open intent known here (acted on: their verdicts start nothing, and their
        chains are not settled, even those that had ended before the watch); the runs it falls back from are stopped by
        it (their exit is no verdict), and a group of theirs is not decided again."""
        for known in self._open.values():
            for name in known.runs | known.passed:
                watched = self.follower.watched.get(name)
                if watched is not None:
                    watched.handled = watched.acting = True
                    watched.stopping = watched.stopping or name in known.runs
            if known.group is not None:
                self._groups_acted.add(known.group)  # decided already: not again when its nodes are let go

    def _finish(self, known: OpenIntent) -> None:
        """Finish an open intent on a worker, as the fallback was meant to be carried out: a single run's by the
        Supervisor (chains.Supervisor.carry_out), a group's by multinode.finish_fallback (_start_group); its outcome
        comes back as IntentDone."""
        intent, supervisor = known.intent, self.supervisor
        self._tried.add(intent.id)
        what = fallback_text(intent.data)
        if known.group is not None:
            from .multinode import finish_fallback

            self._start_group(known.group, what, [self.store.get_run(name) for name in self.store.nodes_of(known.group)],
                              lambda *args, **waits: finish_fallback(*args, intent, **waits),
                              tag=lambda done: IntentDone(intent.id, done))
            return
        run = intent.data["run"]
        self._start_worker(run, lambda: IntentDone(intent.id, supervisor.carry_out(intent)),
                           UnderWay(what, supervisor.bound_s(self.store.get_run(run), launches=True)),
                           lambda why: IntentDone(intent.id, ActionDone(run, error=why)))

    def look_at_awaited(self) -> None:
        """On the follower's loop, about every AWAIT_LOOK_S: an awaited intent that the chain's holder closed is taken
        as if it had been finished here (_intent_done: said, its successor followed). One it left open (it failed)
        stays awaited: the holder's end lets this watch take the chain over and finish it."""
        now = time.monotonic()
        if not any(known.awaited for known in self._open.values()) or now - self._looked_at < AWAIT_LOOK_S:
            return
        self._looked_at = now
        for known in [known for known in self._open.values() if known.awaited]:
            intent = self.store.get_intent(known.intent.id)
            if intent.done_at is None:
                continue
            done = (GroupDone(known.group, data=intent.data) if known.group is not None
                    else outcome_of(self.store, intent.data))
            self._intent_done(IntentDone(intent.id, done))

    def _intent_done(self, done: IntentDone) -> None:
        """What finishing an open intent did (here, or by the chain's holder): the runs a dead dfo left after its runs
        let go (the successor it adopted followed on as any run; one it passed by no longer followed; all of them
        followed on when no successor came), then what it did said and its successor followed as an action's
        (_group_done, _run_done)."""
        known = self._open.pop(done.intent)
        outcome = done.done
        if isinstance(outcome, GroupDone):
            successors = set((outcome.data or {}).get("nodes") or [])
        else:
            successors = {outcome.launched.name} if outcome.launched is not None else set()
        for name in known.passed:
            watched = self.follower.watched.get(name)
            if watched is None:
                continue
            if name in successors or not successors:
                watched.handled = watched.acting = False
                watched.dirty = True
            else:  # passed by: stopped or never started, and no group to decide (its successor is)
                self._groups_acted.update(filter(None, [self._group_of(name)]))
                self._action_ended(watched)
        self.done(outcome)

    def _leave_to_batch(self, root: str, intent, batch: str) -> None:
        """Say once (however often the chain is attached or taken over) that the open fallback `intent` of batch
        cell chain `root` is left to `dfo batch`, which this watch names; its run is acted on already. (The batch's
        own lifecycle says nothing: its scheduler has it carried out, finish_fallbacks.)"""
        if self.acts_for(batch):
            return
        watched = self.follower.watched.get(intent.data["run"])
        if watched is not None:
            watched.handled = True
        if intent.id in self._left_to_batch:
            return
        self._left_to_batch.add(intent.id)
        event = ev.LeftToBatch(at=utc_now(), run=intent.data["run"], chain=root, batch=batch,
                               command=batch_command(self.store, batch))
        self.follower.publish(event, intent.data["run"], event.stored and self.stores_for(root))

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
