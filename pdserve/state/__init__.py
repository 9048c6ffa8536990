"""The state contract (docs/design.md §3): layouts, pools, block tables, StateManifest."""
