"""The router's own tokenizer: prompts, chat templates and token texts stay out of the engine process.

The engine saves its tokenizer (whatever it was loaded from: Hub, directory or GGUF) into a directory
with `save_pretrained`; the router reads it back with the `tokenizers` library and renders chat
templates with transformers' own Jinja renderer. Neither imports torch, which `AutoTokenizer` does:
the router process stays small and starts fast. Token ids and texts are the same as the engine's,
since both use the same tokenizer.json.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tgserve.router.errors import ValidationError


def chat_renderer() -> Any:
    """transformers' Jinja renderer of chat templates. Its first import takes about 0.7 s: it
    imports transformers (not torch)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template


SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja (transformers 5) or the tokenizer config's entry (a string, or named ones)."""
    path = directory / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def iterates_over_content(template: str) -> bool:
    """Whether a chat template loops over a message's content, reading it as OpenAI's list of parts
    (`{"type": "text", "text": ...}`) rather than printing it as a string. Multimodal models'
    templates do; some take only lists and fail on a string, which they would loop over character by
    character (vLLM decides its "content format" the same way). A template that does not parse is
    left to fail when rendered, with its own error."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    for loop in tree.find_all(nodes.For):
        looped = loop.iter
        while isinstance(looped, nodes.Filter):  # message['content'] | selectattr(...), ...
            looped = looped.node
        if (
            isinstance(looped, nodes.Getitem)
            and isinstance(looped.arg, nodes.Const)
            and looped.arg.value == "content"
        ):
            return True
        if isinstance(looped, nodes.Getattr) and looped.attr == "content":
            return True
    return False


def _as_text_parts(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose string content becomes one text part (the router keeps text only)."""
    content = message.get("content")
    if not isinstance(content, str):
        return message
    return {**message, "content": [{"type": "text", "text": content}]}


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization_spaces`, for the tokenizers that enable it."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


class RouterTokenizer:
    """Encode, decode, render chat templates; per-token texts are cached."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        clean_up_spaces: bool = False,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.content_as_parts = bool(chat_template) and iterates_over_content(chat_template)
        self.special_tokens = dict(special_tokens or {})
        self.clean_up_spaces = clean_up_spaces
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(int(i) for i, token in added.items() if token.special)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # Token texts are asked for over and over (logprobs, details): decode each id once.
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    @classmethod
    def from_directory(cls, directory: str | Path) -> RouterTokenizer:
        """Load what `save_pretrained` wrote: tokenizer.json, tokenizer_config.json, chat template."""
        path = Path(directory)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{path} has no tokenizer.json: only fast (tokenizers) tokenizers are supported")
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        specials = {
            key: content for key in SPECIAL_TOKEN_KEYS if (content := _token_content(config.get(key)))
        }
        return cls(
            Tokenizer.from_file(str(tokenizer_file)),
            chat_template=_read_chat_template(path, config),
            special_tokens=specials,
            clean_up_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_spaces else text

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def check_ids(self, token_ids: list[int], param: str) -> None:
        """Reject token ids outside the vocabulary before they reach the engine's embedding lookup."""
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValidationError(
                    f"`{param}` contains token id {token_id}, outside the vocabulary [0, {self.vocab_size})",
                    param=param,
                )

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render messages (and the tools a reply may call, for templates that show them) with the
        model's own Jinja chat template, exactly as transformers does."""
        render_jinja_template = chat_renderer()
        if not self.chat_template:
            raise ValidationError("this model has no chat template; use /v1/completions", param="messages")
        if self.content_as_parts:
            messages = [_as_text_parts(message) for message in messages]
        try:
            rendered, _ = render_jinja_template(
                conversations=[messages],
                tools=tools,
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except Exception as exc:  # noqa: BLE001 - a template error is the messages' fault, e.g. raise_exception()
            raise ValidationError(
                f"the chat template failed on these messages: {exc}", param="messages"
            ) from exc
        return rendered[0]

    def warm_up_chat_template(self) -> None:
        """Render the template once before serving. The first render imports transformers' renderer
        (about 0.7 s) and compiles the template, which the first chat request would otherwise wait
        for. A template that refuses a lone user message has still been compiled by then."""
        if not self.chat_template:
            return
        try:
            self.chat_prompt([{"role": "user", "content": "Hello"}])
        except ValidationError:
            pass

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Template then tokenize; the template already wrote the special tokens it wants."""
        return self.encode(self.chat_prompt(messages, tools=tools), add_special_tokens=False)

    def offsets(self, text: str, add_special_tokens: bool = True) -> list[tuple[int, int, int]]:
        """(id, start, stop) character offsets of each token of text, for TGI's /tokenize."""
        encoding = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return [(int(i), int(s), int(e)) for i, (s, e) in zip(encoding.ids, encoding.offsets)]
