"""The crash catalogue: real crash texts are recognised by id, warnings and handled tracebacks are not crashes."""

import pytest
from tracegen import CRASH_TEXTS, HANDLED_TRACEBACK, HEALTHY_NOISE, TRAINER_FRAMES, thread_traceback

from orchestrator.decide import Catalogue, MatchTracker, next_variant
from orchestrator.errors import UsageError

CHAIN = ["trees", "notrees", "nographs", "eager"]


def fatal_matches(lines, catalogue=None):
    tracker = MatchTracker(catalogue or Catalogue())
    return [m for line in lines for m in tracker.feed(line) if m.signature is None or m.signature.fatal]


@pytest.mark.parametrize("signature", sorted(set(CRASH_TEXTS) - {"python_exception"}))
def test_real_crash_texts_are_recognised_by_id(signature):
    frames, exception = CRASH_TEXTS[signature]
    matches = fatal_matches(["ts=2026-11-29T11:40:03Z event=step step=1 tok_s=5"] + thread_traceback(frames, exception, None))
    assert matches and matches[0].signature.id == signature


def test_cudagraph_tls_needs_the_bare_assertion_error_and_keeps_the_thread():
    frames, _ = CRASH_TEXTS["cudagraph_tls"]
    [match] = fatal_matches(thread_traceback(frames, "AssertionError", "Thread-2 (drafter)"))
    assert (match.signature.id, match.thread) == ("cudagraph_tls", "Thread-2 (drafter)")
    [other] = fatal_matches(thread_traceback(frames, "AssertionError: shapes differ", None))
    assert other.signature is None  # a generic traceback: the judge decides whether it ended the run


def test_warnings_are_known_but_not_crashes():
    tracker = MatchTracker(Catalogue())
    seen = [m.signature.id for line in HEALTHY_NOISE for m in tracker.feed(line)]
    assert seen == ["online_softmax_warning", "skipping_cudagraphs"]
    assert not fatal_matches(HEALTHY_NOISE)


def test_a_handled_traceback_is_reported_without_a_signature():
    [match] = fatal_matches(HANDLED_TRACEBACK)
    assert match.signature is None and match.thread is None and match.line.startswith("requests.exceptions")


def test_chained_tracebacks_find_the_signature_in_the_second_part():
    frames, exception = CRASH_TEXTS["cudagraph_pool_untracked"]
    lines = thread_traceback(TRAINER_FRAMES, "KeyError: 'x'", "Thread-3 (drafter)")
    lines += ["", "During handling of the above exception, another exception occurred:", ""]
    lines += thread_traceback(frames, exception, None)
    matches = fatal_matches(lines)
    assert [m.signature and m.signature.id for m in matches] == [None, "cudagraph_pool_untracked"]
    assert matches[1].thread == "Thread-3 (drafter)"


def test_inventory_entries_extend_and_replace_the_catalogue():
    catalogue = Catalogue().extended(
        [
            {"id": "loader_died", "pattern": r"DataLoader worker \(pid \d+\) is killed", "meaning": "loader", "next": "eager"},
            {"id": "cuda_oom", "pattern": r"CUDA out of memory", "meaning": "mine", "next": "stop"},
        ]
    )
    [match] = fatal_matches(["RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed."], catalogue)
    assert match.signature.id == "loader_died"
    assert next_variant(CHAIN, "trees", match.signature) == "eager"
    oom = catalogue.by_id("cuda_oom")
    assert oom.meaning == "mine" and next_variant(CHAIN, "trees", oom) is None


def test_bad_inventory_entries_are_usage_errors():
    with pytest.raises(UsageError, match="pattern"):
        Catalogue().extended([{"id": "x", "pattern": "("}])
    with pytest.raises(UsageError, match="pattern"):
        Catalogue().extended([{"id": "x"}])


def test_next_variant_follows_signature_preferences_then_the_chain():
    catalogue = Catalogue()
    assert next_variant(CHAIN, "trees", catalogue.by_id("cudagraph_tls")) == "notrees"
    assert next_variant(CHAIN, "notrees", catalogue.by_id("cudagraph_tls")) == "nographs"
    assert next_variant(CHAIN, "nographs", catalogue.by_id("cudagraph_tls")) == "eager"  # no preference left
    assert next_variant(CHAIN, "trees", catalogue.by_id("cuda_capture_unsupported")) == "nographs"
    assert next_variant(CHAIN, "trees", catalogue.by_id("nccl")) is None
    assert next_variant(CHAIN, "eager", None) is None
    assert next_variant(CHAIN, "not-in-chain", None) is None


def test_a_thread_bound_crash_falls_back_to_the_next_topology_before_the_preferred_strategy():
    """Issue 7's chain: the user's order wins over the signature's preference when the next variant runs in
    its own process (the thread-bound failure cannot recur there); within a topology the preference skips."""
    tls = Catalogue().by_id("cuda_capture_unsupported")
    topologies = {"trees": "threaded", "ps-trees": "procsplit", "notrees": "threaded", "nographs": "threaded"}
    assert next_variant(["trees", "ps-trees", "nographs"], "trees", tls, topologies) == "ps-trees"
    assert next_variant(["trees", "notrees", "ps-trees", "nographs"], "trees", tls, topologies) == "ps-trees"
    assert next_variant(["trees", "notrees", "nographs"], "trees", tls, topologies) == "nographs"
    assert next_variant(["trees", "ps-trees", "nographs"], "trees", tls) == "nographs"  # topology unknown: same


def test_a_chain_recorded_with_a_repeat_runs_each_variant_once_in_order():
    chain = ["qa", "qb", "qa", "qb", "ok"]  # a registry row from before the loaders refused repeats
    walked, current = [], "qa"
    while current is not None and len(walked) < 10:
        walked.append(current)
        current = next_variant(chain, current, None)
    assert walked == ["qa", "qb", "ok"]
