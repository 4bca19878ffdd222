"""tgserve.server: the engine — scheduler, block manager, model runner, models and backends.

Importable without the router's packages (fastapi, pydantic, msgspec, pyzmq).
"""
