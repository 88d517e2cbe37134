"""Training: the job handle, the trainer loop, checkpoints, the profiler and metric sinks.

Nothing torch-heavy is imported here on purpose: `import conveyor.train.checkpoint` should cost only
what that module needs.
"""
