"""Decode kernels (CuTe DSL, Hopper sm_90a first), their torch references and guards.

Every kernel registers itself per op with `pdserve.kernels.registry`; the decode runtime asks the
registry which implementation serves a step and falls back to the torch reference otherwise.
"""
