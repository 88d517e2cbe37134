"""Pipeline model parallelism: the model cut into stages, one per process, microbatches flowing through.

``split`` decides where the model is cut; the strategy (``--strategy pipeline``) runs the stages.
"""

from conveyor.strategies.pipeline.split import SplitError, SplitPlan, plan_split

__all__ = ["SplitError", "SplitPlan", "plan_split"]
