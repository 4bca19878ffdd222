"""Test support that ships with the engine: tiny random-weight model fixtures built fully offline.

`tgserve.server.testing.fixtures` is the entry point (`fixture_path`, `build_fixture`,
`FIXTURE_ARCHITECTURES`, `write_corrupt_copy`). Nothing here is imported by the serving path, and
importing this package itself pulls in nothing heavy: transformers is only imported by its modules.
"""
