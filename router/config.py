"""The router's frozen configuration: admission limits and HTTP settings, built once by the launcher."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class RouterConfig:
    """Limits checked on every request, each named after the launcher flag that sets it.

    max_input_tokens / max_total_tokens of None are derived from the engine's max_model_len once
    it is known (`resolve`): total = max_model_len (or the longest context the KV pool holds, if
    less), input = total - 1.
    """

    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    max_client_batch_size: int = 4
    max_n: int = 16  # OpenAI's `n`, per prompt
    payload_limit: int = 2_000_000  # request body bytes
    api_key: str | None = None
    served_model_name: str | None = None  # what /v1/models reports; the engine's model id by default
    health_timeout_s: float = 5.0  # how long /health waits for the engine loop to answer
    cors_allow_origin: tuple[str, ...] = ()
    compute_type: str | None = None  # TGI's x-compute-type; the engine's device when None

    def resolve(self, max_model_len: int, max_servable_tokens: int | None = None) -> RouterConfig:
        """Fill the token limits from the engine and check them against each other."""
        servable = min(max_model_len, max_servable_tokens or max_model_len)
        total = self.max_total_tokens if self.max_total_tokens is not None else servable
        inputs = self.max_input_tokens if self.max_input_tokens is not None else total - 1
        if total > max_model_len:
            raise ValueError(
                f"--max-total-tokens ({total}) must be <= the model's maximum length ({max_model_len})"
            )
        if not 0 < inputs < total:
            raise ValueError(
                f"--max-input-tokens ({inputs}) must be positive and < --max-total-tokens ({total})"
            )
        for name in ("max_concurrent_requests", "max_best_of", "max_client_batch_size", "payload_limit"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        return replace(self, max_total_tokens=total, max_input_tokens=inputs)

    @property
    def input_limit(self) -> int:
        assert self.max_input_tokens is not None, "RouterConfig.resolve() not called"
        return self.max_input_tokens

    @property
    def total_limit(self) -> int:
        assert self.max_total_tokens is not None, "RouterConfig.resolve() not called"
        return self.max_total_tokens
