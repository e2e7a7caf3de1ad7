from twinplane.rollout.engine import RolloutEngine, Sample, engine_options
from twinplane.rollout.multi_turn import MultiTurnRollout, MultiTurnSample, multi_turn_metrics
from twinplane.rollout.sampling import SamplingParams
from twinplane.rollout.stats import Done
from twinplane.rollout.tools import TOOLS, Calculator, PythonTool, Tool, ToolResult, build_tools

__all__ = ["Done", "RolloutEngine", "Sample", "engine_options", "SamplingParams", "MultiTurnRollout", "MultiTurnSample",
           "multi_turn_metrics",
           "TOOLS", "Calculator", "PythonTool", "Tool", "ToolResult", "build_tools"]
