"""The ddpjob trainer: runs inside pods (or locally) under torchrun."""
