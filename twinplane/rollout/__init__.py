from twinplane.rollout.engine import RolloutEngine, Sample
from twinplane.rollout.sampling import SamplingParams

__all__ = ["RolloutEngine", "Sample", "SamplingParams"]
