"""The training command line's flags (dapo_trl/cli/arguments.py): `DAPOParser` over the script, DAPOConfig and
ModelConfig flags, YAML recipes through `--config` (the shipped ones included), `--config` in --help, and help texts
that match the code (the loss table, the default model, `latest`, from_verl's unsupported example).

The commands themselves, run end to end, are tests/test_cli.py's."""

import os
import re

import pytest
import yaml

from dapo_trl.cli import BUILTIN_TINY_MODEL, RECIPE_HELP, DAPOParser

from .helpers import REPO

RECIPES = sorted((REPO / "configs").glob("*.yaml"))

ORIGINAL_FLAGS = [
    "--model_name_or_path",
    "m",
    "--dataset_name",
    "d",
    "--output_dir",
    "OUT",
    "--num_train_epochs",
    "2",
    "--per_device_train_batch_size",
    "8",
    "--gradient_accumulation_steps",
    "2",
    "--learning_rate",
    "2e-6",
    "--num_generations",
    "4",
    "--epsilon",
    "0.2",
    "--epsilon_high",
    "0.3",
    "--loss_type",
    "bnpo",
    "--temperature",
    "0.9",
    "--top_p",
    "0.95",
    "--max_prompt_length",
    "128",
    "--max_completion_length",
    "256",
    "--overlong_buffer_len",
    "64",
    "--overlong_penalty_factor",
    "0.5",
    "--apply_overlong_penalty",
    "false",
    "--filter_groups_enable",
    "true",
    "--max_filter_gen_batches",
    "5",
    "--beta",
    "0.001",
    "--entropy_coeff",
    "0.001",
    "--max_grad_norm",
    "0.5",
    "--bf16",
    "false",
    "--report_to",
    "none",
]


def parse(argv):
    return DAPOParser().parse_args_and_config(args=argv)


def test_every_original_flag_parses(tmp_path):
    argv = [str(tmp_path) if a == "OUT" else a for a in ORIGINAL_FLAGS]
    script, config, model = parse(argv)
    assert model.model_name_or_path == "m" and script.dataset_name == "d"
    assert config.loss_type == "bnpo" and config.epsilon_high == 0.3 and config.top_p == 0.95
    assert config.max_prompt_length == 128 and config.overlong_buffer_len == 64
    assert config.apply_overlong_penalty is False and config.filter_groups_enable is True
    assert config.max_filter_gen_batches == 5 and config.entropy_coef == 0.001 and config.beta == 0.001
    assert config.gradient_accumulation_steps == 2 and config.num_train_epochs == 2


def test_abbreviated_flags_are_refused(tmp_path):
    """A typo such as --epsilon_hi must fail, not silently set epsilon_high."""
    with pytest.raises(ValueError, match="'--epsilon_hi'"):
        parse(["--output_dir", str(tmp_path), "--epsilon_hi", "0.3"])


def write_recipe(tmp_path, text: str):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_yaml_config_file(tmp_path):
    yaml_file = write_recipe(
        tmp_path,
        f"output_dir: {tmp_path}\nepsilon_high: 0.25\nmax_completion_length: 128\noverlong_buffer_len: 32\n"
        "clip_ratio_c: 10.0\nreport_to: none\nbf16: false\n",
    )
    _, config, _ = parse(["--config", str(yaml_file), "--epsilon", "0.15"])
    assert config.epsilon_high == 0.25 and config.epsilon == 0.15 and config.delta == 10.0
    assert config.overlong_buffer_len == 32


def test_flags_override_the_recipe_in_both_spellings_and_env_is_set(tmp_path, monkeypatch):
    monkeypatch.setenv("DAPO_TRL_RECIPE_TEST", "before")  # monkeypatch restores the variable after the test
    recipe = write_recipe(
        tmp_path,
        f"output_dir: {tmp_path}\nmax_steps: 3\nreward_funcs: [math_verify]\nmodel_name_or_path: m\n"
        "report_to: none\nenv:\n  DAPO_TRL_RECIPE_TEST: set-by-recipe\n",
    )
    for config_words in (["--config", str(recipe)], [f"--config={recipe}"]):
        script, config, model = parse([*config_words, "--max_steps", "5"])
        assert (config.max_steps, script.reward_funcs, model.model_name_or_path) == (5, ["math_verify"], "m")
        assert config.output_dir == str(tmp_path)
    assert os.environ["DAPO_TRL_RECIPE_TEST"] == "set-by-recipe"


def test_recipe_mistakes_are_named(tmp_path, capsys):
    unknown = write_recipe(tmp_path, f"output_dir: {tmp_path}\nepsilon_hi: 0.3\n")
    with pytest.raises(ValueError, match="epsilon_hi"):
        parse(["--config", str(unknown)])
    nested = write_recipe(tmp_path, f"output_dir: {tmp_path}\nconfig: other.yaml\n")
    with pytest.raises(ValueError, match="a recipe cannot name another recipe: remove its 'config' key"):
        parse(["--config", str(nested)])
    with pytest.raises(SystemExit) as exit_info:
        parse(["--output_dir", str(tmp_path), "--config"])
    assert exit_info.value.code == 2
    assert "argument --config: expected the path of a YAML recipe" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.name)
def test_every_key_of_a_shipped_recipe_reaches_its_field(recipe):
    keys = yaml.safe_load(recipe.read_text())
    parsed = parse(["--config", str(recipe)])
    for key, value in keys.items():
        (owner,) = [arguments for arguments in parsed if hasattr(arguments, key)]
        # report_to: one name becomes TrainingArguments' list of names.
        assert getattr(owner, key) in (value, [value]), key


def test_help_lists_config_first():
    help_text = DAPOParser().format_help()
    usage, options = help_text.split("\noptions:\n")
    assert usage.startswith("usage: ") and "[-h] [--config RECIPE.yaml] [--dataset_name" in " ".join(usage.split())
    first_options = " ".join(options.split())
    assert first_options.startswith("-h, --help show this help message and exit --config RECIPE.yaml " + RECIPE_HELP)
    assert "configs/dapo_tiny.yaml" in RECIPE_HELP and (REPO / "configs" / "dapo_tiny.yaml").is_file()


# ------------------------------------------------------------------------------------- help texts match the code
def option_help(flag: str) -> str:
    """--help's entry for one flag, whitespace normalised: its names, its help and its "(default: ...)"."""
    options = " ".join(DAPOParser().format_help().split("\noptions:\n", 1)[1].split())
    start = options.index(f"{flag} {flag[2:].upper()}, ")
    return options[start : options.index(")", options.index(" (default: ", start)) + 1]


def test_loss_type_help_lists_the_loss_table():
    from dapo_trl.algorithm import POLICY_LOSSES

    help_text = option_help("--loss_type")
    assert set(re.findall(r"'(\w+)'", help_text)) == set(POLICY_LOSSES)
    assert "'gmpo'" in help_text and "'dapo' (default)" in help_text
    for loss in POLICY_LOSSES.values():  # what each averages over, as its row says
        assert loss.aggregation.value in help_text


def test_model_name_or_path_help_names_the_builtin_default():
    from dapo_trl.builtin_models.tiny_model import BUILTIN_MODELS

    _, _, model = parse(["--output_dir", "out"])
    assert model.model_name_or_path == BUILTIN_TINY_MODEL and BUILTIN_TINY_MODEL in BUILTIN_MODELS
    help_text = option_help("--model_name_or_path")
    assert help_text.endswith(f"(default: {BUILTIN_TINY_MODEL})") and "(default: None)" not in help_text


def test_resume_from_checkpoint_help_says_latest():
    from dapo_trl.training.faults.checkpoints import LATEST

    help_text = option_help("--resume_from_checkpoint")
    assert all(f"'{word}'" in help_text for word in LATEST) and "newest complete checkpoint" in help_text


def test_allow_unsupported_example_is_refused_by_the_translator(capsys):
    """--allow-unsupported's example is a key the translator blocks on (KL in the reward, the old one, is mapped)."""
    from dapo_trl.from_verl import UNSUPPORTED_EXAMPLE, parse_arguments
    from dapo_trl.verl_import.reader import read_verl_input
    from dapo_trl.verl_import.translate import translate

    with pytest.raises(SystemExit):
        parse_arguments(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert UNSUPPORTED_EXAMPLE in help_text and "KL in the reward" not in help_text
    override = UNSUPPORTED_EXAMPLE.split(":")[0]
    script = REPO / "tests" / "data" / "verl" / "grpo_kl.sh"
    t = translate(read_verl_input(script, {"HOME": "/home/user", "PWD": "/data"}, [override]))
    assert override.split("=")[0] in {entry.key for entry in t.blocking}


@pytest.mark.parametrize(
    "flag, value",
    [("dataset_test_split", "validation"), ("dataset_streaming", "true"), ("ignore_bias_buffers", "true")],
)
def test_trls_script_flags_the_script_does_not_read_are_refused_when_set(tmp_path, flag, value):
    """TRL's ScriptArguments lists them; train_dapo.py reads none of them, so setting one is an error naming it."""
    with pytest.raises(ValueError, match=f"--{flag} is not read by train_dapo.py"):
        parse(["--output_dir", str(tmp_path), f"--{flag}", value])
    parse(["--output_dir", str(tmp_path)])  # their defaults are fine
