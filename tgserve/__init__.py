"""tgserve: a text-generation inference server.

`from tgserve import LLM, SamplingParams, GuidedDecoding` is the offline API. The names are resolved lazily so that
`import tgserve` stays cheap (no torch) for the router process.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "GuidedDecoding", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from tgserve.server.engine.llm import LLM
    from tgserve.server.protocol.params import GuidedDecoding, SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tgserve.server.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tgserve.server.protocol.params import SamplingParams

        return SamplingParams
    if name == "GuidedDecoding":
        from tgserve.server.protocol.params import GuidedDecoding

        return GuidedDecoding
    raise AttributeError(f"module 'tgserve' has no attribute {name!r}")
