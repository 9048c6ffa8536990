"""pdserve.cluster — see docs/design.md §7."""
