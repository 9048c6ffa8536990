"""Model core: config parsing, weights, reference layers and forward."""
