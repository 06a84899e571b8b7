"""A simulated cluster of real schedulers on a discrete-event clock: routing policies, the step cost model and its
fit, the hit-rate bounds of a workload."""
