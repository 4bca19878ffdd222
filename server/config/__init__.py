"""Frozen configuration, built once by the CLI or the offline API: the engine's arguments, the
scheduler's limits, the static-shape buckets. Plain Python, no torch."""
