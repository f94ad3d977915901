"""Every launch line the docs give runs as written, and every batch product they state holds.

The launch lines are the commands of README.md's and docs/*.md's bash blocks and inline code, and of the example
scripts (examples/), that run train_dapo.py, run_dapo.sh, test_dapo.sh, an example's train.sh or serve.sh, a vLLM
server script, `accelerate launch` or `python -m dapo_trl.<module>`. Each names only flags that exist: train_dapo.py's
from its own parser (DAPOParser: the script's, DAPOConfig's and ModelConfig's), accelerate's before the script,
the module's own, vLLM's after a server script; and only environment knobs its script reads. A training line whose
recipe or flags generate on a vLLM server names the server's host, one for long responses on a real model sets a
token budget, and the verl launch is the same two steps on both pages that give it. The arithmetic (`16 x 8 GPUs x 4
= 512`, `64 / 4 = 16`) is checked wherever a page, a recipe's comment or a script's header states it; the README's
8-GPU script is built as DAPOConfig builds it on 8 processes. The recipes' own batch tables are
tests/test_cluster_recipes.py's, run_dapo.sh's dry runs tests/test_launch_configs.py's. No training: about 5 s."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import shlex
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import launch_command_parser

from dapo_trl import DAPOConfig
from dapo_trl.cli import DAPOParser

from .helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPTS = sorted({*(REPO / "examples").rglob("*.sh"), *(REPO / "examples").rglob("*.sbatch")})
LAUNCH = re.compile(
    r"train_dapo\.py|run_dapo\.sh|test_dapo\.sh|accelerate launch|python -m dapo_trl\.|start_vllm_server\.sh"
    r"|/(?:serve|train|vllm_server)\.sh"
)
# Scripts whose extra arguments go to train_dapo.py, and those whose extra arguments go to `vllm serve`.
TRAINING_SCRIPTS = ("run_dapo.sh", "test_dapo.sh", "train.sh")
SERVER_SCRIPTS = ("start_vllm_server.sh", "serve.sh", "vllm_server.sh")
# The `vllm serve` flags the docs and scripts pass, each checked against vLLM 0.31.0's `vllm serve --help=all` (the
# version the project installs, docs/cluster-recipes.md); `--no-X` is accepted where `--X` is. A flag added to the
# docs is added here after the same check (vLLM is not installed beside the tests).
VLLM_SERVE_FLAGS = frozenset(
    "--host --port --tensor-parallel-size --data-parallel-size --data-parallel-size-local --data-parallel-address "
    "--data-parallel-rpc-port --data-parallel-start-rank --headless --dtype --max-model-len --gpu-memory-utilization "
    "--logprobs-mode --max-logprobs --enforce-eager --enable-chunked-prefill --enable-prefix-caching "
    "--max-num-batched-tokens --max-num-seqs --weight-transfer-config --enable-return-routed-experts "
    "--enable-expert-parallel".split()
)
# Environment variables a command may set besides its script's knobs: the shell's, CUDA's and vLLM's own.
GENERAL_VARIABLES = {"PATH", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "VLLM_USE_V2_MODEL_RUNNER", "VLLM_SERVER_DEV_MODE"}


@dataclass(frozen=True)
class Line:
    where: str  # page:line
    words: tuple[str, ...]
    block: str  # the whole block (or inline span) the command is in


# ------------------------------------------------------------------------------------------- finding the lines
def logical_lines(text: str) -> list[tuple[int, str]]:
    """(index of the first line, text) of each command line: continuations joined, and a quote left open (`bash -c
    "` ... `"`) carried over the following lines."""
    lines, found, index = text.split("\n"), [], 0
    while index < len(lines):
        first, logical = index, lines[index]
        while True:
            while logical.endswith("\\") and index + 1 < len(lines):
                index += 1
                logical = logical[:-1] + " " + lines[index]
            try:
                words(logical)
            except ValueError:  # an open quote
                if index + 1 < len(lines):
                    index += 1
                    logical += "\n" + lines[index]
                    continue
            break
        found.append((first, logical))
        index += 1
    return found


def words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split, lexer.commenters = True, "#"
    return list(lexer)


def simple_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell text, as words: comments dropped, split at `;`, `&&`, `||`, `|`, `&` and
    redirections. A word that is itself a command line (`bash -c "..."`) is split in turn."""
    commands = []
    for _, line in logical_lines(text):
        try:
            tokens = words(line)
        except ValueError:  # an unbalanced quote (an inline span cut short): plain words
            tokens = line.split()
        command: list[str] = []
        for token in [*tokens, ";"]:
            if token and set(token) <= set(";&|<>"):
                if command:
                    commands.append(command)
                command = []
            elif "\n" in token or (" " in token and LAUNCH.search(token)):
                commands.extend(simple_commands(token))
            else:
                command.append(token)
    return commands


def bash_blocks(page: Path) -> list[tuple[int, str]]:
    """(first line, code) of every ```bash block of `page`, indented ones (in a list item) included."""
    lines, blocks, index = page.read_text().splitlines(), [], 0
    while index < len(lines):
        if lines[index].lstrip().startswith("```"):
            end = next((j for j in range(index + 1, len(lines)) if lines[j].lstrip().startswith("```")), len(lines))
            if lines[index].lstrip()[3:].strip() in ("bash", "sh", "shell", "console"):
                blocks.append((index + 2, "\n".join(lines[index + 1 : end])))
            index = end
        index += 1
    return blocks


def inline_spans(page: Path) -> list[tuple[int, str]]:
    """(line, code) of every inline code span outside the fenced blocks; a span may run over a line break."""
    text = re.sub(r"^\s*```.*?^\s*```", lambda m: "\n" * m.group(0).count("\n"), page.read_text(), flags=re.S | re.M)
    return [
        (text.count("\n", 0, match.start()) + 1, " ".join(match.group(1).split()))
        for match in re.finditer(r"`([^`]+)`", text)
    ]


def lines_of(text: str, where: str, block: str | None = None) -> list[Line]:
    return [Line(where, tuple(c), block or text) for c in simple_commands(text) if LAUNCH.search(" ".join(c))]


@cache
def launch_lines() -> tuple[Line, ...]:
    found = []
    for page in PAGES:
        name = page.relative_to(REPO)
        for first, code in bash_blocks(page):
            for index, line in logical_lines(code):
                found += lines_of(line, f"{name}:{first + index}", code)
        for number, code in inline_spans(page):
            if " " in code:
                found += lines_of(code, f"{name}:{number}")
    for script in SCRIPTS:
        text = script.read_text()
        here = re.search(r"^here=(\S+)$", text, flags=re.M)  # the script's own folder, as `$here/train.sh` names it
        text = text.replace("$here", here.group(1)) if here else text
        for index, line in logical_lines(text):
            found += lines_of(line, f"{script.relative_to(REPO)}:{index + 1}", text)
    return tuple(found)


# ---------------------------------------------------------------------------------------------- the flag sets
def option_strings(parser: argparse.ArgumentParser) -> frozenset[str]:
    return frozenset(parser._option_string_actions)


@cache
def training_flags() -> frozenset[str]:
    return option_strings(DAPOParser()) | {"--config"}


@cache
def accelerate_flags() -> frozenset[str]:
    return option_strings(launch_command_parser())


class _Parser(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


@cache
def module_flags(module: str) -> frozenset[str] | None:
    """The flags of `python -m module`, from the parser its main() builds (caught before it parses anything); None if
    there is no such module."""

    def caught(self, *args, **kwargs):
        raise _Parser(self)

    names = ("parse_args", "parse_known_args", "parse_intermixed_args", "parse_known_intermixed_args")
    saved = {name: getattr(argparse.ArgumentParser, name) for name in names}
    for name in names:
        setattr(argparse.ArgumentParser, name, caught)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a moved module's FutureWarning
            try:
                loaded = importlib.import_module(module)
                if not hasattr(loaded, "main"):  # a package: its __main__
                    loaded = importlib.import_module(f"{module}.__main__")
            except ModuleNotFoundError:
                return None
            loaded.main()
    except _Parser as found:
        return option_strings(found.parser)
    finally:
        for name, method in saved.items():
            setattr(argparse.ArgumentParser, name, method)
    raise AssertionError(f"python -m {module}: main() parsed no arguments")


def unknown(words: list[str], known: frozenset[str]) -> list[str]:
    flags = [word.split("=", 1)[0] for word in words if re.match(r"--?[A-Za-z]", word)]
    return [flag for flag in flags if flag not in known and flag.replace("--no-", "--", 1) not in known]


def script_knobs(path: Path) -> set[str]:
    """The environment variables a repository script reads, with those of the repository scripts it runs."""
    text = path.read_text()
    knobs = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", text))
    for called in re.findall(r"\b(scripts/[\w.-]+\.sh|run_dapo\.sh)\b", text):
        if (REPO / called).exists() and (REPO / called) != path:
            knobs |= script_knobs(REPO / called)
    return knobs


def program_at(words: list[str]) -> int | None:
    """Where the launched program starts in a command's words (after env assignments, srun, exec ...)."""
    for index, word in enumerate(words):
        following = words[index + 1] if index + 1 < len(words) else ""
        if word == "accelerate" and following == "launch":
            return index
        if re.search(r"(^|/)python3?$", word) and (following == "-m" or following.endswith("train_dapo.py")):
            return index
        if word.endswith(("train_dapo.py", ".sh")) and "=" not in word:
            return index
    return None


def problems(line: Line) -> list[str]:
    """What is wrong with one launch line: flags that do not exist, knobs its script does not read."""
    words = list(line.words)
    start = program_at(words)
    if start is None:
        return []
    found = []
    program, rest = words[start], words[start + 1 :]
    if program == "accelerate":
        script = next((i for i, word in enumerate(rest) if word.endswith(".py") or word == "-m"), len(rest))
        found += [f"accelerate launch {flag}" for flag in unknown(rest[1:script], accelerate_flags())]
        if script < len(rest) and rest[script].endswith("train_dapo.py"):
            found += [f"train_dapo.py {flag}" for flag in unknown(rest[script + 1 :], training_flags())]
    elif program.endswith(("python", "python3")) and rest[:1] == ["-m"] and len(rest) > 1:
        module = rest[1]
        flags = module_flags(module)
        if flags is None:
            found.append(f"python -m {module}: no such module")
        else:
            found += [f"python -m {module} {flag}" for flag in unknown(rest[2:], flags)]
    elif program.endswith(("python", "python3")) or program.endswith("train_dapo.py"):
        arguments = rest[1:] if program.endswith(("python", "python3")) else rest
        found += [f"train_dapo.py {flag}" for flag in unknown(arguments, training_flags())]
    else:
        name = Path(program).name
        if name in TRAINING_SCRIPTS:
            found += [f"{name} (train_dapo.py) {flag}" for flag in unknown(rest, training_flags())]
        elif name in SERVER_SCRIPTS:
            found += [f"{name} (vllm serve) {flag}" for flag in unknown(rest, VLLM_SERVE_FLAGS)]
        path = REPO / program.removeprefix("./")
        if path.is_file():  # a repository script: the variables set for it are knobs it reads
            knobs = script_knobs(path) | GENERAL_VARIABLES
            assigned = [w.split("=", 1)[0] for w in words[:start] if re.match(r"[A-Z][A-Z0-9_]*=", w)]
            found += [f"{name}: {knob}= is read by no script" for knob in assigned if knob not in knobs]
    return found


def test_the_docs_have_launch_lines_of_every_kind():
    starts = [(line, program_at(list(line.words))) for line in launch_lines()]
    programs = {line.words[start] for line, start in starts if start is not None}
    for expected in ("accelerate", "./run_dapo.sh", "scripts/start_vllm_server.sh", "my_run/vllm_server.sh"):
        assert expected in programs, f"no launch line runs {expected}: is the extraction broken?"
    assert len(launch_lines()) > 60


def test_every_launch_line_names_flags_and_knobs_that_exist():
    wrong = [f"{line.where}: {problem}" for line in launch_lines() for problem in problems(line)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("accelerate launch train_dapo.py --max_tokens_per_micro_batch 18432", "--max_tokens_per_micro_batch"),
        ("accelerate launch --num_process 8 train_dapo.py --loss_type dapo", "accelerate launch --num_process"),
        ("VLLM_MODE=colocate VLLM_HOSTNAME=gen ./run_dapo.sh --max_steps 3", "VLLM_HOSTNAME="),
        ("TP=8 scripts/start_vllm_server.sh --max-num-batched-token 2048", "--max-num-batched-token"),
        ("python -m dapo_trl.from_verl run.sh --outptu my_run", "--outptu"),
        ("python -m dapo_trl.no_such_command --help", "no such module"),
        ('srun bash -c "NNODES=2 exec ./run_dapo.sh --sequence_paralel_size 2"', "--sequence_paralel_size"),
    ],
)
def test_the_check_finds_a_misspelled_flag_or_knob(text, problem):
    (line,) = lines_of(text, "example")
    assert any(problem in found for found in problems(line)), problems(line)


def test_the_check_passes_real_flags():
    text = (
        "VLLM_MODE=colocate MAX_TOKENS_PER_MICROBATCH=18432 ./run_dapo.sh --sequence_parallel_size 2 --bf16 true\n"
        "accelerate launch --config_file c.yaml --machine_rank 1 train_dapo.py --config r.yaml --vllm_server_host h\n"
        "python -m dapo_trl.from_verl run.sh -o my_run --env A=1\n"
        "scripts/start_vllm_server.sh --no-enable-chunked-prefill\n"
    )
    assert [problems(line) for line in lines_of(text, "example")] == [[], [], [], []]


# -------------------------------------------------------------------------------------- vLLM server launches
@pytest.fixture(scope="module")
def translated(tmp_path_factory) -> Path:
    """What the README's `python -m dapo_trl.from_verl tests/data/verl/dapo_recipe.sh --output my_run` writes."""
    from dapo_trl.from_verl import main

    folder = tmp_path_factory.mktemp("from_verl") / "my_run"
    assert main([str(REPO / "tests" / "data" / "verl" / "dapo_recipe.sh"), "--output", str(folder)]) == 0
    return folder


def settings(line: Line, my_run: Path) -> dict:
    """What a training line sets: the recipe `--config` names (a repository file, or from_verl's
    `my_run/recipe.yaml`), then its `--flag value` pairs; for a script (run_dapo.sh), its environment knobs too."""
    words = list(line.words)
    found: dict = {}
    if "--config" in words[:-1]:
        name = words[words.index("--config") + 1]
        recipe = my_run / name.removeprefix("my_run/") if name.startswith("my_run/") else REPO / name
        if recipe.is_file():
            found = yaml.safe_load(recipe.read_text()) or {}
    for index, word in enumerate(words[:-1]):
        if word.startswith("--") and not words[index + 1].startswith("--"):
            found[word[2:]] = words[index + 1]
    found.update(re.findall(r"^([A-Z][A-Z0-9_]*)=(.*)$", "\n".join(words), flags=re.M))
    return found


def training_lines() -> list[Line]:
    """The lines that train: train_dapo.py, run_dapo.sh, test_dapo.sh, an example's train.sh."""
    programs = ("train_dapo.py", *TRAINING_SCRIPTS)
    return [line for line in launch_lines() if any(word.endswith(programs) for word in line.words)]


def generation(line: Line, my_run: Path) -> tuple[bool, str | None, bool]:
    """(use_vllm, vllm_mode, names the host) of a training line."""
    found = settings(line, my_run)
    host = any(key in found for key in ("vllm_server_host", "vllm_server_base_url", "VLLM_SERVER_HOST"))
    return str(found.get("use_vllm", False)).lower() == "true", found.get("vllm_mode"), host


def unbounded(line: Line, my_run: Path) -> bool:
    """Whether a training line asks for responses of 8k tokens or more on a real model (a hub id or a folder) with no
    bound on the tokens of a forward (`max_tokens_per_microbatch`, run_dapo.sh's MAX_TOKENS_PER_MICROBATCH)."""
    found = settings(line, my_run)
    run_dapo = any(word.endswith("run_dapo.sh") for word in line.words)  # its defaults: 32B, 20480 tokens
    length = found.get("max_completion_length", found.get("MAX_COMPLETION_LENGTH", 20480 if run_dapo else 0))
    model = found.get("model_name_or_path", found.get("MODEL_PATH", "Qwen/Qwen2.5-32B" if run_dapo else ""))
    budget = "max_tokens_per_microbatch" in found or "MAX_TOKENS_PER_MICROBATCH" in found
    return str(length).isdigit() and int(length) >= 8192 and "/" in str(model) and not budget


def test_long_responses_on_a_real_model_set_a_token_budget(translated):
    """Without a token budget a micro-batch of 16 rows of 22.5k tokens is one forward of 360k tokens
    (docs/long-context.md)."""
    found = [f"{line.where}: {' '.join(line.words)[:100]}" for line in training_lines() if unbounded(line, translated)]
    assert not found, "long responses with no token budget:\n" + "\n".join(found)
    (line,) = lines_of("accelerate launch train_dapo.py --model_name_or_path Qwen/Qwen2.5-7B --max_completion_length "
                       "20480", "example")  # fmt: skip
    assert unbounded(line, translated)
    (line,) = lines_of("VLLM_SERVER_HOST=gen ./run_dapo.sh", "example")  # the defaults: 32B at 20480 tokens
    assert unbounded(line, translated)
    (line,) = lines_of("MODEL_PATH=Qwen/Qwen2.5-7B MAX_TOKENS_PER_MICROBATCH=18432 ./run_dapo.sh", "example")
    assert not unbounded(line, translated)


def test_training_on_a_vllm_server_names_its_host(translated):
    """A server on another machine must be named; one the same block starts on this machine (in the background) is
    found at TRL's default address."""
    missing = []
    for line in training_lines():
        use_vllm, mode, host = generation(line, translated)
        local = re.search(r"start_vllm_server\.sh[^\n]*&\s*$", line.block, flags=re.M)  # in the background, here
        if use_vllm and mode == "server" and not host and not local:
            missing.append(line.where)
    assert not missing, f"training on a vLLM server without --vllm_server_host: {missing}"


def test_the_verl_launch_is_the_same_two_steps_on_both_pages(translated):
    """README.md and docs/coming-from-verl.md start the server from_verl writes, then train with its host."""
    assert (translated / "vllm_server.sh").is_file()
    launches = []
    for page in (REPO / "README.md", REPO / "docs" / "coming-from-verl.md"):
        block = next(code for _, code in bash_blocks(page) if "--config my_run/recipe.yaml" in code)
        commands = [words for words in simple_commands(block) if LAUNCH.search(" ".join(words))]
        launches.append([words for words in commands if "dapo_trl.from_verl" not in words])
    readme, verl_page = launches
    assert readme == verl_page
    assert readme[0] == ["my_run/vllm_server.sh"]
    assert "train_dapo.py" in readme[1] and "--vllm_server_host" in readme[1]
    assert "--machine_rank" in readme[1] and "--main_process_ip" in readme[1]  # the recipe spans several nodes


# ------------------------------------------------------------------------------------------ batch arithmetic
NUMBER = r"\d{1,3}(?:,\d{3})+(?![\d,])|\d+(?:\.\d+)?"
TOKEN = re.compile(
    rf"(?P<op>\s+x\s+|\s*[/+*]\s*|\s+-\s+)|(?P<number>\s*(?:{NUMBER})(?![\w.%-]))|(?P<eq>\s+=\s+)"
    r"|(?P<word>\s*`?[A-Za-z_][\w.]*`?)|(?P<other>.)",
    re.S,
)


def expression(tokens: list[tuple[str, str]]) -> tuple[str, float] | None:
    """`[number (op number)*]` with words between (dropped), as (text, value); None if not one."""
    kept = [(kind, text) for kind, text in tokens if kind != "word"]
    if not kept or len(kept) % 2 == 0:
        return None
    if any(kind != ("number" if index % 2 == 0 else "op") for index, (kind, _) in enumerate(kept)):
        return None
    text = " ".join(value.strip() for _, value in kept)
    python = " ".join("*" if v.strip() == "x" else v.strip().replace(",", "") for _, v in kept)
    return text, eval(python)  # numbers and + - * / only


def arithmetic_claims(text: str) -> list[tuple[str, float, str, float]]:
    """Every `left = right` of `text` where one side is a product, quotient or sum of numbers (words between the
    numbers are names: `16 x 8 GPUs x 4 = 512`, `per_device_train_batch_size 16 x 8 processes`): (left, its value,
    right, its value). The longest expression on each side is taken; a side that is no expression is skipped."""
    tokens = [(match.lastgroup, match.group()) for match in TOKEN.finditer(text)]
    claims = []
    for index, (kind, _) in enumerate(tokens):
        if kind != "eq":
            continue
        start = index
        while start > 0 and tokens[start - 1][0] in ("number", "op", "word"):
            start -= 1
        end = index + 1
        while end < len(tokens) and tokens[end][0] in ("number", "op", "word"):
            end += 1
        left = next(filter(None, (expression(tokens[i:index]) for i in range(start, index))), None)
        right = next(filter(None, (expression(tokens[index + 1 : j]) for j in range(end, index + 1, -1))), None)
        if left and right and (" " in left[0] or " " in right[0]):  # one side has an operator
            claims.append((left[0], left[1], right[0], right[1]))
    return claims


def arithmetic_sources() -> list[Path]:
    return [*PAGES, *sorted((REPO / "examples").rglob("*.yaml")), *SCRIPTS, REPO / "run_dapo.sh"]


def comments(code: str) -> str:
    """Only the comments of code (a string's `7 + 5 = 14` is an example, not a claim)."""
    return "\n".join(match.group(1) for match in re.finditer(r"(?:^|\s)#(.*)$", code, flags=re.M))


def stated_text(path: Path) -> str:
    """What a file states in prose: a page's text with its Python and bash blocks cut to their comments; a recipe's
    or script's comments."""
    if path.suffix != ".md":
        return comments(path.read_text())
    code = re.compile(r"^```(python|bash)\n(.*?)^```", flags=re.S | re.M)
    return code.sub(lambda match: comments(match.group(2)), path.read_text())


def test_every_stated_product_holds():
    wrong, checked = [], 0
    for path in arithmetic_sources():
        for left, left_value, right, right_value in arithmetic_claims(stated_text(path)):
            checked += 1
            if abs(left_value - right_value) > 1e-9 * max(abs(left_value), 1):
                wrong.append(f"{path.relative_to(REPO)}: {left} = {right}, but {left_value:g} != {right_value:g}")
    assert not wrong, "\n".join(wrong)
    assert checked > 20, "the arithmetic check found almost nothing: is the pattern broken?"


@pytest.mark.parametrize(
    ("text", "claims"),
    [
        ("16 x 8 GPUs x 4 = 512 responses", [("16 x 8 x 4", 512, "512", 512)]),
        ("16 x 8 x 64 = 8192 responses = 512 prompts x 16 per rollout: 64 / 4 = 16 updates",
         [("16 x 8 x 64", 8192, "8192", 8192), ("8192", 8192, "512 x 16", 8192), ("64 / 4", 16, "16", 16)]),
        ("`per_device_train_batch_size` 4 x 128 x `steps_per_generation` 16 = 8192",
         [("4 x 128 x 16", 8192, "8192", 8192)]),
        ("MAX_MODEL_LEN (22,528 = 2048 + 20480)", [("22,528", 22528, "2048 + 20480", 22528)]),
        ("k = 1, P = 8, ceil(22528 / 18432) = 2, a 4096-token buffer = 16384", []),
    ],
)  # fmt: skip
def test_the_arithmetic_pattern(text, claims):
    assert arithmetic_claims(text) == claims


def test_the_arithmetic_check_finds_a_wrong_product():
    (claim,) = arithmetic_claims("per_device_train_batch_size=16,  # 16 x 8 GPUs x 4 = 256 responses")
    assert claim[1] == 512 and claim[3] == 256


# ------------------------------------------------------------------------------- the README's 8-GPU script
def test_the_readme_8_gpu_script_is_the_7b_recipes_layout(monkeypatch):
    """The README's script for `accelerate launch` on 8 GPUs: complete (its imports), the paper's batch as
    DAPOConfig builds it on the accelerate config's processes, and the token budget, sequence parallelism and
    lengths of examples/qwen2.5-7b-2x8, the recipe for the same model on the same 8 training GPUs."""
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    code = next(block for block in blocks if 'DAPOTrainer(model="Qwen/Qwen2.5-7B"' in block)
    before = readme[: readme.index(code)]
    launcher = re.findall(r"accelerate launch --config_file ([\w./-]+)", before)[-1]
    processes = load_config_from_file(str(REPO / launcher)).num_processes
    tree = ast.parse(code)
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert {"DAPOConfig", "DAPOTrainer", "load_prompt_dataset"} <= imported, "the script is missing its imports"
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "DAPOConfig")
    kwargs = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(DAPOConfig, "world_size", property(lambda self: processes))
    config = DAPOConfig(**kwargs)
    per_update = config.per_device_train_batch_size * processes * config.gradient_accumulation_steps
    assert (per_update, config.generation_batch_size) == (512, 512 * 16)
    assert config.generation_batch_size // config.num_generations == 512
    assert config.generation_batch_size // per_update == 16
    recipe = yaml.safe_load((REPO / "examples" / "qwen2.5-7b-2x8" / "recipe.yaml").read_text())
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                "max_tokens_per_microbatch", "sequence_parallel_size", "max_prompt_length", "max_completion_length",
                "overlong_buffer_len"):  # fmt: skip
        assert getattr(config, key) == recipe[key], key
    assert load_config_from_file(str(REPO / "examples" / "qwen2.5-7b-2x8" / "accelerate.yaml")).num_processes == 8
    assert config.use_vllm and config.vllm_mode == "colocate"
    assert config.vllm_max_model_length == config.max_prompt_length + config.max_completion_length
