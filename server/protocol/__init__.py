"""The engine's vocabulary and its one contract with the router: sampling parameters, per-step
outputs and stats, and the ZMQ messages that carry them. Never imports torch; only `messages`
imports msgspec."""
