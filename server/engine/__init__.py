"""The engine: the continuous-batching loop (`LLMEngine`) and the `Engine` interface it shares with
the optimum-habana fallback, its shards and their workers, and the ways it is reached: the engine
process behind ZMQ (`service`), the offline API (`llm`) and `tgserve generate`.

Importing this package imports nothing: the router imports none of its modules."""
