"""conveyor: train PyTorch models across processes, GPUs and machines."""
