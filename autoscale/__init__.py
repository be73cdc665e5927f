"""Drafter autoscaling (SmartSpec's goodput model applied to replicas): the offline step-latency profiling that
seeds the goodput model, and (next) the Ray Serve autoscaling policy for the drafter deployments."""
