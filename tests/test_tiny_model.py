"""Tests for the offline tiny model factory (dapo_trl.builtin_models.tiny_model)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import multiprocessing.synchronize
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dapo_trl.builtin_models.tiny_model import (
    MARKER_FILE,
    TINY_MODEL_VERSION,
    WARM_START,
    _is_complete,
    build_tiny_model,
    default_tiny_model_dir,
    warm_start_examples,
)
from dapo_trl.builtin_models.tiny_tokenizer import CHAT_TEMPLATE, QWEN2_PRETOKENIZE_REGEX, tiny_tokenizer_corpus

CORPUS_SHA256 = "6d432d3ae3b2e08dee723e423a754857c05a16b7274bc7ee73b41f0acdbaa80c"
ROUND_TRIP_STRINGS = [
    "What is 12 + 7?",
    "Answer: 42",
    "Answer: -1234567890",
    "3.14159 * 2 = 6.28318",
    "line one\nline two\r\n\n\n  indented\tTab",
    "  leading and trailing spaces   ",
    "héllo wörld, café, naïve, 日本語, 🙂👍",
    "It's what we'll do, they've said; I'm sure.",
    'Remember to put your answer on its own line after "Answer:".',
    "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\nAnswer: 2<|im_end|>",
    "",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_default_dir_respects_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DAPO_TRL_CACHE", str(tmp_path))
    assert default_tiny_model_dir() == tmp_path / f"tiny-qwen2-v{TINY_MODEL_VERSION}"
    monkeypatch.delenv("DAPO_TRL_CACHE")
    assert default_tiny_model_dir() == Path.home() / ".cache" / "dapo_trl" / f"tiny-qwen2-v{TINY_MODEL_VERSION}"


def test_default_output_dir_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DAPO_TRL_CACHE", str(tmp_path))
    assert build_tiny_model() == tmp_path / f"tiny-qwen2-v{TINY_MODEL_VERSION}"
    assert (tmp_path / f"tiny-qwen2-v{TINY_MODEL_VERSION}" / MARKER_FILE).is_file()


def test_pretokenize_regex_matches_transformers() -> None:
    # Our BPE is trained with a copy of Qwen2's regex; if transformers changes it, loaded encodings would drift.
    from transformers.models.qwen2 import tokenization_qwen2

    assert QWEN2_PRETOKENIZE_REGEX == tokenization_qwen2.PRETOKENIZE_REGEX


def test_corpus_deterministic() -> None:
    assert tiny_tokenizer_corpus(3) == tiny_tokenizer_corpus(3)
    assert tiny_tokenizer_corpus(3) != tiny_tokenizer_corpus(4)


def test_corpus_pinned_to_model_version() -> None:
    # The corpus embeds dapo_trl.data's prompt template: editing it changes the tokenizer, so cached builds of
    # this TINY_MODEL_VERSION would be stale. Bump TINY_MODEL_VERSION, then update this hash.
    digest = hashlib.sha256("\n".join(tiny_tokenizer_corpus(0)).encode()).hexdigest()
    assert (TINY_MODEL_VERSION, digest) == ("2", CORPUS_SHA256), "tiny corpus changed: bump TINY_MODEL_VERSION"


def test_tokenizer_round_trip_and_matches_raw(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    for text in ROUND_TRIP_STRINGS:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text, text
        assert raw.encode(text).ids == ids, text
    # Qwen2-style pre-tokenization: digits are always single tokens.
    assert tok.tokenize("Answer: 42")[-2:] == ["4", "2"]


def test_special_tokens_and_config(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    config = AutoConfig.from_pretrained(tiny_dir)
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok.model_max_length == 1024
    assert tok.convert_ids_to_tokens(tok.convert_tokens_to_ids("<|im_start|>")) == "<|im_start|>"
    assert config.eos_token_id == tok.eos_token_id
    assert config.pad_token_id == tok.pad_token_id
    assert config.bos_token_id == tok.pad_token_id
    assert config.vocab_size % 64 == 0
    assert config.vocab_size >= len(tok)
    assert 500 <= len(tok) <= 1024
    assert config.tie_word_embeddings is False
    assert config.head_dim == 32
    assert config.hidden_size // config.num_attention_heads == 32
    assert config.num_key_value_heads == 1
    marker = json.loads((tiny_dir / MARKER_FILE).read_text())
    assert marker["version"] == TINY_MODEL_VERSION
    assert marker["seed"] == 0


def test_untied_head(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.dtype == torch.float32
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert emb.data_ptr() != head.data_ptr()
    assert not torch.equal(emb, head)


def test_chat_template_and_generate(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.chat_template == CHAT_TEMPLATE
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    enc = tok(text, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=8, do_sample=True)
    assert out.shape[0] == 1
    assert enc["input_ids"].shape[1] < out.shape[1] <= enc["input_ids"].shape[1] + 8
    assert isinstance(tok.decode(out[0, enc["input_ids"].shape[1] :]), str)


def test_reuse_without_rebuild(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m")
    marker = path / MARKER_FILE
    mtime = marker.stat().st_mtime_ns
    assert build_tiny_model(tmp_path / "m") == path
    assert marker.stat().st_mtime_ns == mtime
    assert build_tiny_model(tmp_path / "m", overwrite=True) == path
    assert (path / MARKER_FILE).is_file()
    assert not [p for p in tmp_path.iterdir() if p.name != "m"], "temp/trash folders left behind"


def test_different_seed_in_existing_dir_is_refused(tmp_path: Path) -> None:
    build_tiny_model(tmp_path / "m", seed=0)
    with pytest.raises(ValueError, match="seed"):
        build_tiny_model(tmp_path / "m", seed=1)
    build_tiny_model(tmp_path / "m", seed=1, overwrite=True)
    assert json.loads((tmp_path / "m" / MARKER_FILE).read_text())["seed"] == 1


def test_incomplete_dir_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / "config.json").write_text("{}")  # e.g. leftovers from an interrupted non-atomic copy
    build_tiny_model(target)
    assert (target / MARKER_FILE).is_file()
    AutoConfig.from_pretrained(target)


def test_same_seed_identical_weights(tmp_path: Path) -> None:
    a = build_tiny_model(tmp_path / "a", seed=7)
    b = build_tiny_model(tmp_path / "b", seed=7)
    c = build_tiny_model(tmp_path / "c", seed=8)
    wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert not all(torch.equal(wa[k], wc[k]) for k in wa if wa[k].shape == wc[k].shape)


def _build_after_barrier(barrier: multiprocessing.synchronize.Barrier, target: str) -> None:
    """Spawn target: both processes start building at the same moment to provoke the rename race."""
    barrier.wait(timeout=120)
    build_tiny_model(target)


def test_concurrent_build(tmp_path: Path) -> None:
    target = tmp_path / "shared"
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_build_after_barrier, args=(barrier, str(target))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    assert [p.exitcode for p in procs] == [0, 0]
    assert (target / MARKER_FILE).is_file()
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (target / name).is_file(), name
    assert [p.name for p in tmp_path.iterdir()] == ["shared"], "temp folders left behind"
    AutoModelForCausalLM.from_pretrained(target)
    AutoTokenizer.from_pretrained(target)


def test_warm_start_targets_are_the_builtin_problems_worked_and_answered() -> None:
    """The supervised pass teaches each built-in problem's sum; about half the targets end in DAPO's Answer line."""
    from dapo_trl.data import make_arithmetic_dataset
    from dapo_trl.rewards import dapo_math_reward

    examples = warm_start_examples()
    problems = make_arithmetic_dataset()
    assert [example["prompt"] for example in examples] == problems["prompt"]
    completions = [example["completion"] for example in examples]
    rewards = dapo_math_reward(completions, solution=problems["solution"])
    answered = sum(reward > 0 for reward in rewards) / len(rewards)
    assert abs(answered - WARM_START.answer_line_share) < 0.1
    assert all(
        reward > 0 or "So the result is" in c[0]["content"] for c, reward in zip(completions, rewards, strict=True)
    )


def test_random_and_warm_builds_are_never_confused(tiny_dir: Path) -> None:
    assert _is_complete(tiny_dir, 0) and not _is_complete(tiny_dir, 0, WARM_START)
    assert default_tiny_model_dir(warm_start=True).name.endswith("-warm")


def _without_writer(path: Path) -> dict:
    """A saved config's fields but `transformers_version`, which names the release that wrote it, not the model."""
    return {key: value for key, value in json.loads(path.read_text()).items() if key != "transformers_version"}


@pytest.mark.parametrize("architecture", ["dense", "moe"])
def test_the_shipped_builtin_models_are_this_recipes_build(
    architecture: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """builtin:tiny and builtin:tiny-moe load from the package, never build (an empty cache stays empty); the shipped
    files are what the recipe makes, all but the warm start's weights byte for byte (those depend on the CPU)."""
    from dapo_trl.builtin_models.tiny_model import BUILTIN_MODELS, packaged_model_dir, resolve_builtin_model

    monkeypatch.setenv("DAPO_TRL_CACHE", str(tmp_path / "cache"))
    name = next(name for name, built in BUILTIN_MODELS.items() if built == architecture)
    shipped = Path(resolve_builtin_model(name))
    assert shipped == packaged_model_dir(architecture) and not (tmp_path / "cache").exists()
    assert _is_complete(shipped, 0, WARM_START, architecture)
    fresh = build_tiny_model(tmp_path / "fresh", architecture=architecture)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        assert (shipped / file).read_bytes() == (fresh / file).read_bytes(), file
    for file in ("config.json", "generation_config.json"):  # the same but the transformers that wrote them
        assert _without_writer(shipped / file) == _without_writer(fresh / file), file
    trained, initial = load_file(shipped / "model.safetensors"), load_file(fresh / "model.safetensors")
    assert trained.keys() == initial.keys()
    assert all(trained[key].shape == initial[key].shape for key in trained)
    assert any(not torch.equal(trained[key], initial[key]) for key in trained)  # warm-started, not the random init
