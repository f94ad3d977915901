"""`python -m dapo_trl.config.reference [--check]`: docs/config.md, the configuration reference, written from the
fields of `DAPOConfig` (dapo_trl/config/dapo_config.py) and of the command line's `DAPOScriptArguments`
(dapo_trl/cli/arguments.py).

Every field DAPOConfig adds to TRL's GRPOConfig and every script field declared in arguments.py is documented once,
with its type, default and help, under the group `GROUPS` places it in. A field no group names (or one named by two
groups, or a name that is no field) stops the generator, so a new field cannot be left out of the page. TRL's and
transformers' own fields are linked, not repeated, except those dapo-trl declares again: with another default (both
values listed) or with a help of its own. `--check` writes nothing and exits 1 with a diff when docs/config.md is not
what the fields say now.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trl import GRPOConfig, ModelConfig, ScriptArguments

from ..cli.arguments import DAPOParser, DAPOScriptArguments
from .dapo_config import DAPOConfig
from .groups import GROUPS, Group

REFERENCE_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"
REGENERATE = "python -m dapo_trl.config.reference"

GRPO_CONFIG_DOCS = "https://huggingface.co/docs/trl/grpo_trainer#trl.GRPOConfig"
TRAINING_ARGUMENTS_DOCS = "https://huggingface.co/docs/transformers/main_classes/trainer#transformers.TrainingArguments"
SCRIPT_ARGUMENTS_DOCS = "https://huggingface.co/docs/trl/script_utils#trl.ScriptArguments"
MODEL_CONFIG_SOURCE = "https://github.com/huggingface/trl/blob/v1.16.0/trl/trainer/model_config.py"

# GRPOConfig fields whose TRL default already is DAPO's (paper, Section 5): listed with TRL's value, so a TRL release
# that changes one of them changes the page and fails the check.
ALREADY_DAPO_IN_TRL = ("loss_type", "epsilon", "beta", "temperature", "learning_rate")

# The fields of TRL's ScriptArguments that train_dapo.py reads (dapo_trl/cli/train.py); the others are accepted and
# unused, and the page says so (tests/test_config_reference.py checks both against the package's source).
SCRIPT_ARGUMENTS_READ = ("dataset_config", "dataset_train_split")

# Set in DAPOConfig.__post_init__ from the machine, not field defaults (so not found by comparing the dataclasses).
DERIVED_AT_START = (
    "on a machine without a GPU, `use_cpu=True` and `bf16=False`. There GRPOConfig either refuses to start (bf16) or "
    "lets `accelerate launch --multi_gpu` processes train each on its own without noticing (use_cpu)."
)


# ------------------------------------------------------------------------------------------------ the fields
def dapo_config_fields() -> dict[str, dataclasses.Field]:
    """The fields DAPOConfig adds: not GRPOConfig's (nor, through it, TrainingArguments')."""
    inherited = {field.name for field in dataclasses.fields(GRPOConfig)}
    return {field.name: field for field in dataclasses.fields(DAPOConfig) if field.name not in inherited}


def script_fields() -> dict[str, dataclasses.Field]:
    """The fields declared in DAPOScriptArguments' own body (arguments.py), redeclared ScriptArguments ones included."""
    declared = inspect.get_annotations(DAPOScriptArguments)
    return {field.name: field for field in dataclasses.fields(DAPOScriptArguments) if field.name in declared}


def inherited_names(cls: type, own: Iterable[str]) -> list[str]:
    return [field.name for field in dataclasses.fields(cls) if field.name not in set(own)]


def default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def model_config_class() -> type:
    """The model dataclass the command line parses: TRL's ModelConfig, or a subclass of it from arguments.py."""
    return next(cls for cls in DAPOParser().dataclass_types if issubclass(cls, ModelConfig))


@dataclasses.dataclass(frozen=True)
class Redefined:
    """A TRL field that a dapo-trl dataclass declares again, with another default or another help."""

    name: str
    trl_class: str
    trl_default: Any
    default: Any
    help: str


def redefined_trl_fields() -> list[Redefined]:
    """TRL's fields (GRPOConfig's, TrainingArguments', ModelConfig's) that DAPOConfig or the command line's model
    dataclass declare again: with another default, or the same default and a help of their own."""
    redefined = []
    for trl_class, dapo_class in ((GRPOConfig, DAPOConfig), (ModelConfig, model_config_class())):
        trl_fields = {field.name: field for field in dataclasses.fields(trl_class)}
        for field in dataclasses.fields(dapo_class):
            trl_field = trl_fields.get(field.name)
            if trl_field is None or (
                default_of(trl_field) == default_of(field) and help_of(trl_field) == help_of(field)
            ):
                continue
            redefined.append(
                Redefined(field.name, trl_class.__name__, default_of(trl_field), default_of(field), help_of(field))
            )
    return redefined


def changed_defaults() -> list[Redefined]:
    """The TRL fields whose default DAPO changes."""
    return [field for field in redefined_trl_fields() if field.trl_default != field.default]


def rewritten_help() -> list[Redefined]:
    """The TRL fields whose default DAPO keeps but whose help says what DAPO does with them."""
    return [field for field in redefined_trl_fields() if field.trl_default == field.default]


def placement_problems(groups: Iterable[Group] | None = None) -> list[str]:
    """What keeps the page from documenting every field exactly once under `groups` (default `GROUPS`); [] when
    nothing does."""
    documented = {**dapo_config_fields(), **script_fields()}
    places: dict[str, list[str]] = {}
    for group in GROUPS if groups is None else groups:
        for name in group.fields:
            places.setdefault(name, []).append(group.title)
    problems = [
        f"{name} is in no group of dapo_trl/config/groups.py GROUPS: add it to the group of its concern"
        for name in documented
        if name not in places
    ]
    problems += [
        f"{name} is in more than one group: {', '.join(titles)}" for name, titles in places.items() if len(titles) > 1
    ]
    problems += [
        f"GROUPS names {name!r} ({places[name][0]}), which is neither a DAPOConfig field of its own nor a script field"
        for name in places
        if name not in documented
    ]
    problems += [
        f"{name} has no help text (metadata={{'help': ...}})"
        for name, field in documented.items()
        if not help_of(field)
    ]
    return problems


# ------------------------------------------------------------------------------------------------ rendering
def help_of(field: dataclasses.Field) -> str:
    """The field's help as a reader sees it in --help: argparse's %% escape undone, whitespace collapsed."""
    return " ".join(str(field.metadata.get("help", "")).replace("%%", "%").split())


def type_of(field: dataclasses.Field) -> str:
    kind = field.type
    return kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))


def code(value: Any) -> str:
    text = repr(value)
    return f"``{text}``" if "`" in text else f"`{text}`"


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(char for char in title.lower() if char.isalnum() or char in " -_")
    return kept.replace(" ", "-")


def table_cell(text: str) -> str:
    return text.replace("|", "\\|")


def names(values: Iterable[str]) -> str:
    return ", ".join(f"`{value}`" for value in values)


def field_entry(name: str, field: dataclasses.Field, where: str) -> list[str]:
    return [
        f"### `{name}`",
        "",
        f"{where} · `{type_of(field)}` · default {code(default_of(field))}",
        "",
        help_of(field),
        "",
    ]


def render() -> str:
    """The whole of docs/config.md."""
    problems = placement_problems()
    if problems:
        raise ValueError("the configuration reference cannot be written:\n  " + "\n  ".join(problems))
    own, script = dapo_config_fields(), script_fields()
    grpo_defaults = {field.name: default_of(field) for field in dataclasses.fields(GRPOConfig)}
    rewritten = rewritten_help()
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Written by `{REGENERATE}` from the fields of DAPOConfig (dapo_trl/config/dapo_config.py) and",
        "DAPOScriptArguments (dapo_trl/cli/arguments.py); do not edit by hand. tests/test_config_reference.py fails "
        "when it is not current. -->",
        "",
        "Every setting below is a flag of `train_dapo.py` (`--max_filter_gen_batches 10`) and a key of a YAML recipe "
        "given with `--config` (`max_filter_gen_batches: 10`). The command line reads three dataclasses:",
        "",
        f"- **DAPOConfig** (`dapo_trl/config/dapo_config.py`), the training settings, also built in Python "
        f"(`DAPOConfig(...)` for `DAPOTrainer`). It is TRL's [GRPOConfig]({GRPO_CONFIG_DOCS}), which extends "
        "transformers' "
        f"[TrainingArguments]({TRAINING_ARGUMENTS_DOCS}): their fields are documented there and not repeated here, "
        "except the [defaults DAPO changes](#defaults-dapo-changes). This page lists the "
        f"{len(own)} fields DAPOConfig adds.",
        "- **DAPOScriptArguments** (`dapo_trl/cli/arguments.py`): data, rewards, tools and charts, "
        f"{len(script)} flags of the command line only (marked *script*), over TRL's "
        f"[ScriptArguments]({SCRIPT_ARGUMENTS_DOCS}).",
        f"- TRL's **ModelConfig** ([its fields]({MODEL_CONFIG_SOURCE})): the model, its dtype and attention, LoRA and "
        "quantisation.",
        "",
        "`python train_dapo.py --help` prints all of them. In the types, `X | None` takes `None` (in YAML `null`) for "
        "what the help says None means; a `list[str]` flag takes several words (`--reward_funcs dapo_math judge`), a "
        "YAML list in a recipe; a `bool` flag takes `true` / `false` (alone, `--plot` means true).",
        "",
        "## Contents",
        "",
        "- [Defaults DAPO changes](#defaults-dapo-changes)",
        *(["- [TRL fields DAPO explains](#trl-fields-dapo-explains)"] if rewritten else []),
        *(f"- [{group.title}](#{anchor(group.title)})" for group in GROUPS),
        "",
        "## Defaults DAPO changes",
        "",
        "TRL's and transformers' fields whose default dapo-trl changes:",
        "",
        "| field | of | TRL's default | DAPO's default | what it does |",
        "|---|---|---|---|---|",
        *(
            f"| `{field.name}` | {field.trl_class} | {table_cell(code(field.trl_default))} | "
            f"{table_cell(code(field.default))} | {table_cell(field.help)} |"
            for field in changed_defaults()
        ),
        "",
        f"Set when the config is built rather than by default: {DERIVED_AT_START}",
        "",
        "Already DAPO's in GRPOConfig, so unchanged: "
        + ", ".join(f"`{name}={grpo_defaults[name]!r}`" for name in ALREADY_DAPO_IN_TRL)
        + ".",
        "",
    ]
    if rewritten:
        lines += [
            "## TRL fields DAPO explains",
            "",
            "TRL's fields whose default dapo-trl keeps, with a help of its own that says what it does with them:",
            "",
        ]
        for field in rewritten:
            lines += [f"- `{field.name}` ({field.trl_class}, default {code(field.default)}): {field.help}"]
        lines += [""]
    for group in GROUPS:
        lines += [f"## {group.title}", "", group.intro, ""]
        if group.trl_fields == "script":
            unused = [name for name in inherited_names(ScriptArguments, script) if name not in SCRIPT_ARGUMENTS_READ]
            unread = f"; its {names(unused)} are accepted and not used by `train_dapo.py`" if unused else ""
            lines += [
                f"TRL's [ScriptArguments]({SCRIPT_ARGUMENTS_DOCS}) adds {names(SCRIPT_ARGUMENTS_READ)}{unread}.",
                "",
            ]
        if group.trl_fields == "model":
            lines += [
                f"TRL's [ModelConfig]({MODEL_CONFIG_SOURCE}): {names(inherited_names(model_config_class(), ()))}.",
                "",
            ]
        for name in group.fields:
            if name in own:
                lines += field_entry(name, own[name], "DAPOConfig")
            else:
                lines += field_entry(name, script[name], "*script*")
    return "\n".join(lines).rstrip("\n") + "\n"


# ------------------------------------------------------------------------------------------------ command line
def check(path: Path = REFERENCE_PATH) -> list[str]:
    """The difference between `path` and what the fields say now, as unified-diff lines; [] when current."""
    expected = render()
    current = path.read_text() if path.exists() else ""
    if current == expected:
        return []
    return list(
        difflib.unified_diff(
            current.splitlines(), expected.splitlines(), f"{path} (on disk)", f"{path} (from the fields)", lineterm=""
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=REGENERATE,
        description="Write docs/config.md, the configuration reference, from the fields of DAPOConfig and "
        "DAPOScriptArguments and their help.",
    )
    parser.add_argument("--check", action="store_true", help="Write nothing; exit 1 with a diff if the page is stale.")
    parser.add_argument("--output", type=Path, default=REFERENCE_PATH, help="The page (default: docs/config.md).")
    args = parser.parse_args(argv)
    try:
        if args.check:
            diff = check(args.output)
            if diff:
                shown = diff[:80] + ([f"... {len(diff) - 80} more diff lines"] if len(diff) > 80 else [])
                print("\n".join(shown), file=sys.stderr)
                print(f"\n{args.output} is not current: run `{REGENERATE}` and commit it.", file=sys.stderr)
                return 1
            print(f"{args.output} is current.")
            return 0
        args.output.write_text(render())
    except ValueError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
