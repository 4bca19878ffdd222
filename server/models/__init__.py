"""Model implementations: native families and the transformers fallback, found through a lazy registry."""
