"""The user-facing commands end to end: test_dapo.sh, train_dapo.py flags and YAML, and their error messages."""

import os
import subprocess
import sys

import pytest

from dapo_trl.cli import RECIPE_HELP

from .helpers import REPO, python_command, run_command, run_unchecked

pytestmark = pytest.mark.e2e


def run_failing(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    result = run_unchecked(args, timeout=300, env=env)
    assert result.returncode != 0, result.stdout[-2000:]
    return result


# Warnings the smoke run may print that come from dependencies, not from this library (listed in the README).
DEPENDENCY_WARNINGS = ("[real_accelerator.py:213:get_accelerator] Setting accelerator to CPU",)  # DeepSpeed, no GPU


def test_smoke_script_trains_two_steps_and_prints_metrics_and_charts(tmp_path):
    result = run_command(["./test_dapo.sh"], env={"OUTPUT_DIR": str(tmp_path), "PYTHONWARNINGS": "default"})
    output = result.stdout + result.stderr
    warned = [line for line in output.splitlines() if "warn" in line.lower()]
    assert all(any(known in line for known in DEPENDENCY_WARNINGS) for line in warned), warned
    assert "None" not in output, "a None value reached a logger"
    assert "DAPO metrics per logged step" in result.stdout
    for metric in ("rewards/dapo_math_reward/mean", "rewards/overlong_penalty/mean", "clip_ratio/high_mean"):
        assert metric in result.stdout
    assert "step 2" in result.stdout
    assert (tmp_path / "model.safetensors").exists()
    assert list((tmp_path / "runs").glob("*/events.out.tfevents.*")), "TensorBoard is the default logger"
    assert_charts_of_what_it_logged(tmp_path, result)


def assert_charts_of_what_it_logged(tmp_path, result) -> None:
    """The smoke run's charts: the panels, drawn from the series the trainer wrote to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from .test_plot import check_png, read_series_file

    plots = tmp_path / "plots"
    assert f"charts: {plots}" in result.stdout.splitlines()
    record = read_series_file(plots)
    assert record["source"].startswith("TensorBoard events")  # --save_strategy no: no trainer_state.json
    for panel in ("reward", "response_length", "dynamic_sampling", "entropy_and_clipping"):
        check_png(plots / f"{panel}.png")
    assert "rewards/dapo_math_reward/mean" in record["panels"]["reward"]["series"]
    # what the trainer logged, read straight from its event file
    (events,) = (tmp_path / "runs").glob("*/events.out.tfevents.*")
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    logged = [(event.step, event.value) for event in accumulator.Scalars("train/dynamic_sampling/keep_rate")]
    plotted = record["panels"]["dynamic_sampling"]["series"]["dynamic_sampling/keep_rate"]
    assert [step for step, _ in plotted] == [1, 2] == [step for step, _ in logged]
    assert [value for _, value in plotted] == [value for _, value in logged]
    # the warm-started built-in model solves some problems: kept groups, a real loss and gradient (a random model
    # never does: keep rate 0, loss 0, grad norm 0, and a newcomer cannot tell a working trainer from a broken one)
    assert all(value > 0 for _, value in plotted)
    optimization = record["panels"]["optimization"]["series"]
    assert all(value > 0 for _, value in optimization["grad_norm"])
    assert any(value != 0 for _, value in optimization["loss"])
    assert os.path.getsize(plots / "series.json") > 0


def test_smoke_script_with_two_processes(tmp_path):
    """On an empty cache: both ranks load the shipped warm-started model (a build on first use once joined the
    launch's process group and hung); the cache stays empty."""
    env = {"OUTPUT_DIR": str(tmp_path / "out"), "NUM_PROCESSES": "2", "DAPO_TRL_CACHE": str(tmp_path / "cache")}
    result = run_command(["./test_dapo.sh"], env=env, timeout=400)
    assert "DAPO metrics per logged step" in result.stdout
    assert not (tmp_path / "cache").exists()


def test_the_builtin_moe_model_on_an_empty_cache_under_zero3_with_two_processes(tmp_path):
    """ZeRO-3, 2 processes, an empty cache: the shipped model loads and trains (a build on first use once hung here:
    transformers partitioned the model being built). `accelerate launch` itself runs the smoke scripts' tests."""
    zero3 = str(REPO / "configs" / "deepspeed" / "zero3_cpu_test.json")
    flags = ["--model_name_or_path", "builtin:tiny-moe", "--output_dir", str(tmp_path / "out"), "--max_steps", "1"]
    flags += ["--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "8"]
    flags += ["--report_to", "none", "--plot", "false"]
    command = python_command("train_dapo.py", *flags, num_processes=2, deepspeed_config=zero3)
    result = run_command(command, env={"DAPO_TRL_CACHE": str(tmp_path / "cache")}, timeout=400)
    assert "step 1" in result.stdout and not (tmp_path / "cache").exists()


def test_yaml_recipe_and_latest_without_a_checkpoint(tmp_path):
    """A YAML recipe with flags; `--resume_from_checkpoint latest` starts fresh when there is no checkpoint yet (a
    requeued command resuming: tests/test_preemption.py)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"output_dir: {tmp_path / 'out'}\nmax_steps: 1\nper_device_train_batch_size: 4\nnum_generations: 2\n"
        "max_completion_length: 16\noverlong_buffer_len: 4\nreport_to: none\nsave_strategy: steps\nsave_steps: 1\n"
        "clip_ratio_c: 3.0\nlogging_steps: 1\n"
    )
    # An eval set is loaded only when something evaluates: with eval_strategy 'no' (the default) an unreachable one
    # does not stop the run.
    args = ["--loss_type", "dapo", "--eval_dataset_name", "no-such/dataset", "--resume_from_checkpoint", "latest"]
    result = run_command([sys.executable, "train_dapo.py", "--config", str(recipe), *args])
    assert "step 1" in result.stdout and (tmp_path / "out" / "checkpoint-1" / "dapo_checkpoint.json").exists()


def test_bad_value_names_the_field_without_traceback(tmp_path):
    result = run_failing([sys.executable, "train_dapo.py", "--output_dir", str(tmp_path), "--clip_ratio_c", "1.1"])
    assert "clip_ratio_c=1.1 must be > 1 + epsilon_high" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_flag_is_named(tmp_path):
    result = run_failing([sys.executable, "train_dapo.py", "--output_dir", str(tmp_path), "--epsilon_hi", "0.3"])
    assert "'--epsilon_hi'" in result.stderr  # quoted: not the usage's --epsilon_high, which starts the same
    assert "Traceback" not in result.stderr


def test_unreachable_model_gives_one_clear_message(tmp_path):
    result = run_failing(
        ["./test_dapo.sh"], env={"MODEL_PATH": "Qwen/Qwen2.5-0.5B-Instruct", "OUTPUT_DIR": str(tmp_path)}
    )
    assert "could not load model 'Qwen/Qwen2.5-0.5B-Instruct'" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_reward_is_named(tmp_path):
    result = run_failing([sys.executable, "train_dapo.py", "--output_dir", str(tmp_path), "--reward_funcs", "nope"])
    assert "--reward_funcs 'nope'" in result.stderr


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("dapo_trl.tiny_model", "dapo_trl.builtin_models", "build_tiny_model"),
        ("dapo_trl.config_reference", "dapo_trl.config.reference", "render"),
    ],
)
def test_a_moved_module_still_runs_and_imports_naming_its_new_place(old, new, name):
    """The top level groups config under `config/` and the built-in models under `builtin_models/`; the old names
    users may have in scripts keep working, and say where the module went."""
    ran = run_command([sys.executable, "-m", old, "--help"], timeout=120)
    assert "usage:" in ran.stdout and f"moved to {new}" in ran.stderr
    code = f"import warnings; warnings.simplefilter('error'); from {old} import {name}"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert imported.returncode != 0 and f"FutureWarning: {old} moved to {new}" in imported.stderr
    code = f"import warnings; warnings.simplefilter('ignore'); import {old}, {new}; assert {old}.{name} is {new}.{name}"
    run_command([sys.executable, "-c", code], timeout=120)


TRAINING_COMMANDS = (["train_dapo.py"], ["-m", "dapo_trl.cli"])


@pytest.mark.parametrize(
    "command",
    [
        ["train_dapo.py"],
        ["-m", "dapo_trl.cli"],
        ["-m", "dapo_trl.evaluate"],
        ["-m", "dapo_trl.from_verl"],
        ["-m", "dapo_trl.builtin_models"],
    ],
    ids=["train_dapo.py", "dapo_trl.cli", "dapo_trl.evaluate", "dapo_trl.from_verl", "dapo_trl.builtin_models"],
)
def test_every_entry_point_prints_help(command):
    """argparse %-formats help strings: a bare % in any field's help used to crash --help."""
    result = run_command([sys.executable, *command, "--help"], timeout=120)  # a non-zero exit fails with its output
    assert "usage:" in result.stdout and "--output" in result.stdout
    if command in TRAINING_COMMANDS:  # TrlParser reads --config without declaring it; DAPOParser lists it
        assert "[--config RECIPE.yaml]" in result.stdout
        assert " ".join(f"--config RECIPE.yaml {RECIPE_HELP}".split()) in " ".join(result.stdout.split())
