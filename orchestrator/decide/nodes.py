"""A multi-node run's verdict from its nodes' own: which node failed first, which failures were consequences.

When one node of a multi-node run crashes or is killed, the others' collectives fail soon after: their
trainers end with `cause=peer_lost` (signature `peer_lost`). Those are consequences; the run's failure is
the node that failed without that signature, the earliest if several. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

CONSEQUENCES = ("peer_lost",)
"""Signatures of a node's crash that another node's failure causes."""
FAILED = ("crash", "stall", "too_slow")


@dataclass(frozen=True)
class NodeOutcome:
    """One node's decision as the registry holds it (the docs/design.md decision shape, fields that matter here)."""

    rank: int
    target: str
    decision: str | None
    signature: str | None = None
    at_ts: str | None = None  # RFC 3339 UTC: sorts as text
    exit_code: int | None = None

    @property
    def failed(self) -> bool:
        return self.decision in FAILED

    @property
    def consequence(self) -> bool:
        return self.failed and self.signature in CONSEQUENCES


def first_failure(nodes: list[NodeOutcome]) -> NodeOutcome | None:
    """The node whose failure is the run's: the earliest failure that is not a consequence (else the earliest
    failure at all); None when no node failed."""
    failed = [node for node in nodes if node.failed]
    causes = [node for node in failed if not node.consequence] or failed
    return min(causes, key=lambda node: (node.at_ts or "~", node.rank)) if causes else None


def describe(run: str, nodes: list[NodeOutcome]) -> str:
    """One line: `RUN: crash on node 1 (ct201) first (exit_nonzero); node 0 (ct200): peer_lost, a consequence`,
    or the nodes' common decision when none failed."""
    culprit = first_failure(nodes)
    if culprit is None:
        decisions = sorted({node.decision or "undecided" for node in nodes})
        return f"{run}: {', '.join(decisions)} on all {len(nodes)} nodes"
    why = f" ({culprit.signature})" if culprit.signature else ""
    others = [f"node {n.rank} ({n.target}): {n.signature or n.decision}" + (", a consequence" if n.consequence else "")
              for n in nodes if n is not culprit and n.failed]
    return f"{run}: {culprit.decision} on node {culprit.rank} ({culprit.target}) first{why}" + (
        "; " + "; ".join(others) if others else "")
