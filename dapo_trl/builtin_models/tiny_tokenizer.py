"""The built-in tiny models' tokenizer: a byte-level BPE trained offline on text like the built-in problems, saved so
that `AutoTokenizer` loads it as it loads Qwen's (`dapo_trl.builtin_models.tiny_model` builds the models around it)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tokenizers/transformers are imported lazily inside functions
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# transformers 5.x loads every ``model_type=qwen2`` folder with ``Qwen2Tokenizer``, which rebuilds the normalizer
# (NFC) and pre-tokenizer (this regex, then ByteLevel) itself and ignores those stored in tokenizer.json. The BPE
# merges must therefore be trained under exactly the same pipeline, or loaded encodings would differ from training.
# Copied from transformers/models/qwen2/tokenization_qwen2.py (PRETOKENIZE_REGEX).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_BPE_VOCAB_SIZE = 768  # target size incl. 256 byte symbols + specials; already a multiple of 64
_CORPUS_LINES = 3000
_MODEL_MAX_LENGTH = 1024

_WORDS = (
    "the a an of to and in is it that for on with as was are be this by at from or have not but what all were "
    "when we there can your which their if do will each about how up out them then she many some so these would "
    "other into has more two like him see time could no make than first been its who now people my made over did "
    "down only way find use may water long little very after words called just where most know number answer "
    "problem solve step total sum difference product how many apples books coins left each has gives buys sells "
    "first second third therefore so we get result equals plus minus times divided system user assistant think "
    "question reasoning final value compute remaining altogether half twice"
).split()
_NAMES = ("Tom", "Anna", "Lily", "Sam", "Maria", "Ben", "Zoe", "Omar")
_ITEMS = ("apples", "books", "coins", "pencils", "cookies", "marbles")
_OPS = (("+", "plus", lambda a, b: a + b), ("-", "minus", lambda a, b: a - b), ("*", "times", lambda a, b: a * b))


def tiny_tokenizer_corpus(seed: int = 0, n_lines: int = _CORPUS_LINES) -> list[str]:
    """Deterministic synthetic text resembling the RL prompts/answers, so common pieces get their own merges.

    Only a pure ``random.Random(seed)`` is used (no global RNG), so the corpus is identical across processes.
    """
    # The real DAPO prompt template, so its pieces get merges; imported here because dapo_trl.data loads `datasets`.
    from ..data import DAPO_PROMPT_TEMPLATE, make_prompt

    rng = random.Random(seed)
    lines: list[str] = DAPO_PROMPT_TEMPLATE.split("\n\n{problem}\n\n")  # its instruction and its reminder
    for _ in range(n_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        sym, word, fn = rng.choice(_OPS)
        kind = rng.randrange(6)
        if kind == 0:
            lines.append(f"What is {a} {sym} {b}?")
        elif kind == 1:
            lines.append(f"Answer: {fn(a, b)}")
        elif kind == 2:
            name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
            lines.append(f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?")
        elif kind == 3:
            lines.append(make_prompt(f"What is {a} {word} {b}?")[0]["content"])
        elif kind == 4:
            lines.append(f"First, {a} {sym} {b} = {fn(a, b)}.\nSo the answer is {fn(a, b)}.\nAnswer: {fn(a, b)}")
        else:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))).capitalize() + ".")
    return lines


def train_tokenizer(seed: int) -> Tokenizer:
    """Train a byte-level BPE with Qwen2's exact normalizer + pre-tokenizer (see QWEN2_PRETOKENIZE_REGEX)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable -> no unk, exact round trip
        show_progress=False,
    )
    tok.train_from_iterator(tiny_tokenizer_corpus(seed), trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out: Path) -> PreTrainedTokenizerBase:
    """Save through ``Qwen2Tokenizer`` so the folder is exactly what AutoTokenizer reconstructs on load."""
    from transformers import Qwen2Tokenizer

    model = json.loads(tok.to_str())["model"]
    hf_tok = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]],
        unk_token=None,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        model_max_length=_MODEL_MAX_LENGTH,
        chat_template=CHAT_TEMPLATE,
    )
    hf_tok.save_pretrained(out)
    return hf_tok
