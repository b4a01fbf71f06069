"""What to do about a verdict: keep, fall back to the next variant of the chain, or stop.

next_variant() picks the variant; naming the next RUN is the caller's business. Pure: no I/O.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..states import Action, Verdict
from .signatures import Signature


def rest_of_chain(chain: Sequence[str], variant: str | None) -> tuple[str, ...]:
    """What is left of `chain` after `variant` (empty: it was the last one, or is not in the chain). Each entry
    counts once, at its first place: a chain recorded with a repeat ([qa, qb, qa, ok], before the loaders refused
    one) goes qa, qb, ok, never back to qa."""
    once = tuple(dict.fromkeys(chain))
    return once[once.index(variant) + 1:] if variant in once else ()


def next_variant(
    chain: Sequence[str],
    current: str | None,
    signature: Signature | None = None,
    topologies: Mapping[str, str] | None = None,
) -> str | None:
    """The variant to try after `current` in `chain`, or None (end of chain, or the signature says stop).

    The chain is the user's order. A signature's `next` preferences may only skip chain entries that would
    meet the same failure: those of the crashed variant's own topology (`topologies` maps variant ->
    threaded|procsplit; unknown = same). So after a thread-bound CUDA-graph crash in [trees, ps-trees,
    nographs], ps-trees (its own process) is next, while in [trees, notrees, nographs] notrees is skipped.
    When no preference is in the rest of the chain, the plain next one is used.
    """
    if signature is not None and signature.next is None:
        return None
    rest = rest_of_chain(chain, current)
    if not rest:
        return None
    prefs = tuple(signature.next) if signature else ()
    if not any(name in rest for name in prefs):
        return rest[0]
    topo = topologies or {}
    for name in rest:
        if name in prefs or topo.get(name, topo.get(current or "")) != topo.get(current or ""):
            return name
    return rest[0]


def action_for(verdict: str, next_name: str | None, *, fallback_enabled: bool) -> Action:
    """keep | fallback | stop | none for a verdict: steady keeps its variant (also once the run ended: the
    verdict stays steady); crash/stall/too_slow fall back or stop; drifting, stopped, exited, undecided: none."""
    verdict = Verdict(verdict)
    if verdict is Verdict.STEADY:
        return Action.KEEP
    if verdict.falls_back():
        return Action.FALLBACK if fallback_enabled and next_name else Action.STOP
    return Action.NONE
