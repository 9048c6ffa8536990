"""Decode runtime: batcher, runner, sampler, backend dispatch + guards."""
