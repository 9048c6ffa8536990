"""pdserve.cluster — see DESIGN.md."""
