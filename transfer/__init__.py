"""pdserve.transfer — see docs/design.md §4."""
