"""The one tokenizer every tiny fixture model shares: byte-level BPE trained offline on a built-in corpus.

Byte-level, so any text (code, emoji, stray bytes) encodes without an unknown token and decoding is
lossless, as with GPT-2, Llama 3, Qwen and SmolLM2. No BOS is added on encode (like Qwen and SmolLM2);
chat turns use ChatML and `<|im_end|>` is the end-of-sequence token, so a chat reply stops on it.
Training is deterministic: the same corpus and settings give the same vocabulary and merges.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TARGET_VOCAB_SIZE = 768

UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
PAD_TOKEN = "<pad>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A server reads a request, tokenizes the prompt, and
streams the answer back one token at a time. When the queue is full, new requests wait their turn;
when memory runs short, the newest request is paused and resumed later.

Once upon a time there was a small village at the edge of a great forest. Every morning the baker
opened his shop at six o'clock, and the smell of fresh bread filled the street. Children ran to
school, farmers drove their carts to the market, and the old clock on the tower struck the hours.

What is the capital of France? The capital of France is Paris. What is two plus two? Two plus two
is four. How many days are in a week? There are seven days in a week: Monday, Tuesday, Wednesday,
Thursday, Friday, Saturday and Sunday. The year has twelve months and about 365 days.

In the beginning of the project, the team wrote a short plan. They wanted a fast engine, a simple
interface, and tests that run on a laptop. Each model has layers; each layer has attention and a
feed-forward block. The cache keeps the keys and values of every token so that the next step is cheap.

Hello! How are you today? I am fine, thank you. Could you please tell me a story about a dragon who
learned to read? Of course. There once was a dragon named Ember who lived in a cave full of books.
She could not read them, so she asked a little girl from the village to teach her the letters.

Water boils at 100 degrees Celsius and freezes at 0 degrees. The sun is a star, and the earth goes
around it once a year. Light travels very fast, about 300,000 kilometres per second. Plants use light,
water and air to make their food, and animals eat the plants or each other.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))
"""


def train_tokenizer(vocab_size: int = TARGET_VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE `tokenizers.Tokenizer` on `CORPUS`; special tokens get ids 0..4."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,  # the corpus is small: merges seen once are needed to reach the target size
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json for `PreTrainedTokenizerFast`, readable by transformers 4.x and 5.x alike.

    Written by hand rather than by `save_pretrained`: transformers 5 would record its own
    `TokenizersBackend` class and a list-valued `extra_special_tokens`, which 4.x (the Gaudi image)
    cannot load.
    """
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN],
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_fast_tokenizer(directory: Path) -> None:
    """Train the tokenizer and save tokenizer.json plus tokenizer_config.json into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    train_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
