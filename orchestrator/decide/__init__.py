"""decide/: pure decisions about a training run. Observations in, Decision out; no I/O, no clock.

    from orchestrator.decide import RunJudge, DecideConfig, StepObs, TickObs, StopRequested, Verdict, replay
"""

from ..states import Verdict
from .config import DecideConfig
from .judge import Decision, RunJudge, describe_gpus, read_stored
from .observations import (
    EventObs, ExitObs, GpuObs, LineObs, Observation, StepObs, StopRequested, TickObs, observation_from_record,
)
from .policy import action_for, next_variant, rest_of_chain
from .replay import decision_key, held_state, replay, replay_timeline, verdict_key
from .signatures import BUILTIN, Catalogue, MatchTracker, Signature
from .steady import SteadyDetector, SteadyEstimate, figure_span

__all__ = [
    "BUILTIN", "Catalogue", "DecideConfig", "Decision", "read_stored", "EventObs", "ExitObs", "GpuObs", "LineObs", "MatchTracker",
    "Observation", "RunJudge", "Signature", "SteadyDetector", "SteadyEstimate", "StepObs", "StopRequested", "TickObs", "Verdict",
    "action_for", "describe_gpus", "figure_span", "held_state", "next_variant", "observation_from_record", "replay",
    "replay_timeline", "rest_of_chain", "verdict_key", "decision_key",
]
