"""Causal tracing: noise scale, metrics, and runs of specs on a model."""
