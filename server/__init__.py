"""tgserve.server: the engine, one package per concern (docs/STRUCTURE.md lists them, lowest first).

Importable without the router's packages (fastapi, pydantic, msgspec, pyzmq): only
`protocol.messages` and `engine.service`, the two ends of the ZMQ link, import msgspec and pyzmq.
"""
