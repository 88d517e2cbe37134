"""Pipeline model parallelism: the model cut into stages, one per process, microbatches flowing through.

``split`` decides where the model is cut (``traced`` cuts a model that is not an nn.Sequential from a
trace of its forward); the strategy (``--strategy pipeline``) runs the stages.
"""

from conveyor.strategies.pipeline.split import SplitError, SplitPlan, TracedPlan, plan_split

__all__ = ["SplitError", "SplitPlan", "TracedPlan", "plan_split"]
