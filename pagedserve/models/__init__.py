"""Model architectures, picked by the config's `architectures` through the registry."""
