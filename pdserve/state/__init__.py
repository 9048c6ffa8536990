"""The state contract (DESIGN.md §3): layouts, pools, block tables, StateManifest."""
