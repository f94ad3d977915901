"""`python -m dapo_trl.from_verl`: verl runs (tests/data/verl/, written for these tests from the recipes' documented
keys) become recipes whose batch and step arithmetic equals verl's, with every key accounted for in the report."""

import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import yaml

from dapo_trl.from_verl import main
from dapo_trl.verl_import.batches import plan_batches
from dapo_trl.verl_import.hydra import VerlInputError, parse_hydra_value, resolve_interpolations
from dapo_trl.verl_import.model_data import model_size_billions
from dapo_trl.verl_import.outputs import write_outputs
from dapo_trl.verl_import.reader import read_verl_input
from dapo_trl.verl_import.script import read_shell_script
from dapo_trl.verl_import.translate import translate
from dapo_trl.verl_import.translation import APPROXIMATED, MAPPED, NOT_NEEDED, UNSUPPORTED
from dapo_trl.verl_import.yaml_config import read_verl_yaml

from .helpers import REPO, python_command, run_command, run_unchecked

DATA = Path(__file__).resolve().parent / "data" / "verl"
DAPO_SCRIPT = DATA / "dapo_recipe.sh"
RETOOL_SCRIPT = DATA / "retool_recipe.sh"
GRPO_SCRIPT = DATA / "grpo_kl.sh"
LORA_SCRIPT = DATA / "grpo_lora.sh"  # verl's examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh, unchanged
GSPO_SCRIPT = DATA / "gspo_3b_math.sh"  # verl's examples/gspo_trainer/test_gspo_3b_math.sh, unchanged
GMPO_SCRIPT = DATA / "gmpo_7b_math.sh"  # verl's examples/gmpo_trainer/test_dapo_7b_math.sh, unchanged
QWEN3_SCRIPT = DATA / "grpo_qwen3_8b.sh"  # verl's examples/grpo_trainer/run_qwen3-8b.sh, unchanged
MOE_SCRIPT = DATA / "moe_r3_qwen3_30b.sh"  # Qwen3-30B-A3B DAPO with R3 routing replay on verl's Megatron backend
# What the GSPO script leaves to its surroundings: SLURM's node count, and a name made by $(basename ...).
GSPO_INPUTS = ("--env", "SLURM_JOB_NUM_NODES=1", "trainer.experiment_name=gspo-3b", "trainer.default_local_dir=/ckpt")
TOOL_CONFIG = DATA / "recipe" / "retool" / "sandbox_fusion_tool_config.yaml"
ENVIRONMENT = {"HOME": "/home/user", "PWD": "/data"}


def translated(script: Path, *extra: str, env: dict | None = None):
    return translate(read_verl_input(script, env or ENVIRONMENT, list(extra)))


def run_translator(script: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """The command line in a subprocess (its exit status and messages are part of the contract)."""
    env = [f"--env={name}={value}" for name, value in ENVIRONMENT.items()]
    command = [sys.executable, "-m", "dapo_trl.from_verl", str(script), "--output", str(out), "--ignore-environment"]
    return run_unchecked([*command, *env, *extra], timeout=120)


def parse_recipe(path: Path):
    """The recipe through train_dapo.py's own parser (script, DAPOConfig and ModelConfig fields)."""
    from trl import ModelConfig, TrlParser

    from dapo_trl import DAPOConfig
    from dapo_trl.cli import DAPOScriptArguments

    parser = TrlParser((DAPOScriptArguments, DAPOConfig, ModelConfig), allow_abbrev=False)
    return parser.parse_args_and_config(args=["--config", str(path)])


# ------------------------------------------------------------------------------------------------ reading
def test_shell_resolution_follows_bash():
    script = textwrap.dedent(
        """\
        #!/bin/bash
        set -xeuo pipefail
        export HOST_DIR=/srv   # a comment with key.sub=ignored
        N=4
        BASE=${BASE:-"${HOME}/verl"}
        EMPTY=
        PICKED=${EMPTY:-fallback} KEEP=${EMPTY-kept}
        SIZE=$(( (N + 2) * 2 ** 3 / 5 ))
        NEG=$((-7 / 2))
        LIST="['$HOST_DIR/a', '$BASE/b']"
        VLLM_USE_V1=1 python3 -m verl.trainer.main_ppo \\
            a.int=$SIZE a.neg=$NEG a.float=1e-6 a.bool=True a.null=null \\
            a.path="$BASE/x y" a.single='$N' a.list="$LIST" a.picked=$PICKED a.keep=$KEEP \\
            +a.added=$((N*N)) a.quoted='["console","wandb"]' ~a.gone $@
        """
    )
    found = read_shell_script(script, {"HOME": "/home/u"})
    assert found.command == "python3 -m verl.trainer.main_ppo"
    assert found.values == {
        "a.int": 9,
        "a.neg": -3,
        "a.float": 1e-6,
        "a.bool": True,
        "a.null": None,
        "a.path": "/home/u/verl/x y",
        "a.single": "$N",
        "a.list": ["/srv/a", "/home/u/verl/b"],
        "a.picked": "fallback",
        "a.keep": "",
        "a.added": 16,
        "a.quoted": ["console", "wandb"],
    }
    assert found.deleted == ["a.gone"] and not found.unresolved
    assert any("$@" in note for note in found.notes)


def test_environment_wins_over_a_default_and_the_script_over_the_environment():
    script = "NNODES=${NNODES:-16}\nMODEL=/m\npython3 -m verl.trainer.main_ppo trainer.nnodes=$NNODES a.m=$MODEL\n"
    found = read_shell_script(script, {"NNODES": "2", "MODEL": "/env"})
    assert found.values == {"trainer.nnodes": 2, "a.m": "/m"}


def test_unresolvable_variables_are_reported_not_guessed(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=2 \\\n"
        "  data.train_files=$DATA/train.parquet data.train_batch_size=$((BATCH * 2)) trainer.nnodes=${NODES:?set it}\n"
    )
    found = read_verl_input(script, {})
    assert found.unresolved == {
        "data.train_files": ["DATA"],
        "data.train_batch_size": ["BATCH"],
        "trainer.nnodes": ["NODES"],
    }
    result = run_translator(script, tmp_path / "out")
    assert result.returncode == 2
    assert "data.train_files: DATA" in result.stderr and "data.train_batch_size: BATCH" in result.stderr
    assert "unresolved: needs DATA" in (tmp_path / "out" / "report.md").read_text()
    assert not (tmp_path / "out" / "recipe.yaml").exists()
    resolved = run_translator(script, tmp_path / "ok", "--env", "DATA=/d", "--env", "BATCH=4", "--env", "NODES=1")
    assert resolved.returncode == 0, resolved.stderr
    recipe = yaml.safe_load((tmp_path / "ok" / "recipe.yaml").read_text())
    assert recipe["dataset_name"] == "/d/train.parquet"


def test_a_command_substitution_is_answered_with_an_override_not_env(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=2 \\\n"
        "  data.train_files=/d/train.parquet trainer.experiment_name=dapo-$(basename $MODEL_PATH)\n"
    )
    result = run_translator(script, tmp_path / "out")
    assert result.returncode == 2
    assert "give those keys their value as overrides after the script, e.g. trainer.experiment_name=VALUE" in (
        result.stderr
    )
    fixed = run_translator(script, tmp_path / "ok", "trainer.experiment_name=dapo-qwen")
    assert fixed.returncode == 0, fixed.stderr


def test_hydra_values():
    assert parse_hydra_value("1e-6") == 1e-6 and parse_hydra_value("-1") == -1 and parse_hydra_value("0.80") == 0.8
    assert parse_hydra_value("False") is False and parse_hydra_value("null") is None
    assert parse_hydra_value("['a', \"b,c\", 3]") == ["a", "b,c", 3]
    assert parse_hydra_value("'quoted: text'") == "quoted: text"


def test_yaml_config_is_flattened_and_interpolated(tmp_path):
    found = read_verl_yaml(
        "data:\n  train_batch_size: 64\n  gen_batch_size: ${data.train_batch_size}\n"
        "actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1e-6\n"
        "algorithm:\n  adv_estimator: grpo\n  filter_groups:\n    enable: true\n    max_num_gen_batches: 0\n"
        "trainer:\n  logger: [console]\nhydra:\n  searchpath: [file://verl/trainer/config]\n"
    )
    t = translate(found)
    assert found.values["actor_rollout_ref.actor.optim.lr"] == 1e-6  # YAML 1.1 would read a string
    assert t.recipe["filter_groups_oversample"] == 1 and t.recipe["max_filter_gen_batches"] == 0
    assert t.recipe["report_to"] == "none"
    assert set(t.entries) == set(found.values)
    assert t.entries["hydra.searchpath"].status == NOT_NEEDED


def test_not_a_verl_run_is_refused(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("echo hello\npython3 train.py --lr 1e-6\n")
    with pytest.raises(VerlInputError, match="no command with verl overrides"):
        read_verl_input(script, {})


# ------------------------------------------------------------------------------------------------ arithmetic
@pytest.mark.parametrize(
    "train, n, mini, world, epochs, micro, dynamic",
    [
        (512, 16, 32, 128, 1, None, True),  # DAPO
        (64, 16, 16, 8, 1, None, True),  # ReTool
        (256, 8, 64, 4, 2, 16, False),
        (1024, 5, 256, 8, 1, 40, False),  # verl's GRPO example
        (96, 4, 24, 16, 3, 6, False),
        (8, 4, 8, 1, 1, 3, False),  # micro-batch 3 does not divide 32: 2
    ],
)
def test_batch_plan_keeps_verls_responses_per_update_and_per_rollout(train, n, mini, world, epochs, micro, dynamic):
    plan = plan_batches(
        train_batch_size=train,
        num_generations=n,
        ppo_mini_batch_size=mini,
        world_size=world,
        ppo_epochs=epochs,
        micro_batch_per_gpu=micro,
        use_dynamic_bsz=dynamic,
        max_token_len_per_gpu=4096,
    )
    assert not plan.errors
    assert plan.responses_per_update == mini * n
    assert plan.responses_per_rollout == train * n
    assert plan.updates_per_rollout == train // mini * epochs
    assert plan.responses_per_rollout % n == 0  # TRL: the generation batch holds whole groups
    if dynamic:
        assert plan.gradient_accumulation_steps == 1 and plan.max_tokens_per_microbatch == 4096
    else:
        assert plan.per_device_train_batch_size <= micro and plan.max_tokens_per_microbatch is None


def test_batch_plan_with_ulysses_runs_verls_micro_batch_per_group():
    """verl's ppo_micro_batch_size_per_gpu under SP is what a group of sp GPUs runs together; here a group runs its
    processes' micro-batches together, so each process takes micro / sp, and accumulation stays verl's."""
    plan = plan_batches(
        train_batch_size=256,
        num_generations=8,
        ppo_mini_batch_size=64,
        world_size=8,
        micro_batch_per_gpu=8,
        sequence_parallel_size=4,
    )
    # verl: 2 groups of 4, 64 x 8 / 2 = 256 responses per group and update, micro 8: 32 accumulation steps.
    assert (plan.per_device_train_batch_size, plan.gradient_accumulation_steps) == (2, 32) and not plan.notes
    plan = plan_batches(
        train_batch_size=256,
        num_generations=8,
        ppo_mini_batch_size=64,
        world_size=8,
        micro_batch_per_gpu=6,
        sequence_parallel_size=4,
    )
    assert plan.per_device_train_batch_size == 1 and "per Ulysses group" in plan.notes[0]


def test_ulysses_size_that_does_not_divide_the_world_blocks(tmp_path):
    t = translated(RETOOL_SCRIPT, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=3")
    entry = t.entries["actor_rollout_ref.actor.ulysses_sequence_parallel_size"]
    assert entry.blocking and "does not divide the world size 8" in entry.how


def test_batch_plan_refuses_what_verl_refuses():
    plan = plan_batches(train_batch_size=30, num_generations=3, ppo_mini_batch_size=10, world_size=4)
    assert plan.errors and "not divisible by the world size 4" in plan.errors[0]


def test_model_size_from_the_path():
    assert model_size_billions("/m/Qwen2.5-32B") == 32
    assert model_size_billions("ckpt/multiturn-sft-qwen-2.5-7b-instruct/global_step_372") == 7
    assert model_size_billions("Qwen/Qwen3-30B-A3B") == 30
    assert model_size_billions("HuggingFaceTB/SmolLM-135M") == pytest.approx(0.135)
    assert model_size_billions("/models/my-policy") is None


# ------------------------------------------------------------------------------------------------ the recipes
def test_dapo_recipe():
    t = translated(DAPO_SCRIPT)
    r = t.recipe
    assert r["model_name_or_path"] == "/home/user/verl/models/Qwen2.5-32B"
    assert r["dataset_name"] == "dapo-math-17k:/home/user/verl/data/dapo-math-17k.parquet"
    assert r["eval_dataset_name"] == ["/home/user/verl/data/aime-2024.parquet"]
    # Batch: 128 processes; 512 x 16 responses per rollout step, 32 x 16 per update, 16 updates per rollout step.
    plan = t.batch
    assert plan.world_size == 128
    assert plan.responses_per_rollout == 512 * 16 and plan.responses_per_update == 32 * 16
    assert (r["num_generations"], r["per_device_train_batch_size"], r["gradient_accumulation_steps"]) == (16, 4, 1)
    assert (r["steps_per_generation"], r["num_iterations"], plan.updates_per_rollout) == (16, 1, 16)
    assert r["max_tokens_per_microbatch"] == 2048 + 20480
    # The DAPO components.
    assert (r["loss_type"], r["epsilon"], r["epsilon_high"], r["clip_ratio_c"], r["beta"]) == (
        "dapo",
        0.2,
        0.28,
        10.0,
        0.0,
    )
    assert (r["max_prompt_length"], r["max_completion_length"], r["overlong_prompt_policy"]) == (2048, 20480, "filter")
    assert (r["apply_overlong_penalty"], r["overlong_buffer_len"], r["overlong_penalty_factor"]) == (True, 4096, 1.0)
    assert (r["filter_groups_enable"], r["max_filter_gen_batches"], r["filter_groups_oversample"]) == (True, 10, 3)
    assert r["reward_funcs"] == ["verl_default"]  # DAPO-Math-17k's rows are math_dapo: DAPO's scorer
    # Steps: verl's rollout steps x 16.
    assert (r["lr_scheduler_type"], r["warmup_steps"], r["learning_rate"]) == ("constant_with_warmup", 160, 1e-6)
    assert (r["save_strategy"], r["save_steps"], r["eval_strategy"], r["eval_steps"]) == ("steps", 80, "steps", 80)
    assert (r["weight_decay"], r["max_grad_norm"], r["num_train_epochs"], r["logging_steps"]) == (0.1, 1.0, 1.0, 16)
    assert (r["val_before_train"], r["eval_num_samples"], r["eval_temperature"], r["eval_top_p"]) == (True, 1, 1.0, 0.7)
    assert (r["temperature"], r["top_p"], r["top_k"], r["padding_free"]) == (1.0, 1.0, 0, True)
    assert r["output_dir"] == "/home/user/verl/ckpts/DAPO/DAPO-Qwen2.5-32B" and r["run_name"] == "DAPO-Qwen2.5-32B"
    assert r["report_to"] == "wandb" and r["vllm_importance_sampling_correction"] is False
    # Launch: 16 x 8 processes, ZeRO-3 with offload because the script offloads.
    assert t.accelerate["distributed_type"] == "DEEPSPEED"
    assert t.accelerate["deepspeed_config"]["deepspeed_config_file"] == "configs/deepspeed/zero3_offload.json"
    assert (t.accelerate["num_machines"], t.accelerate["num_processes"]) == (16, 128)
    assert "param_offload" in t.accelerate_rule
    # vLLM: TP 4, 0.8 of the memory, prompt + response.
    env = t.vllm.environment()
    assert (env["TP"], env["GPU_MEMORY_UTILIZATION"], env["MAX_MODEL_LEN"]) == ("4", "0.8", "22528")
    assert t.vllm.extra_args == ["--max-num-batched-tokens", "22528", "--enable-chunked-prefill"]
    assert not t.blocking
    # Ulysses 8 (actor and reference): sharded forwards over groups of 8; the budget stays per GPU (verl's len x sp).
    assert r["sequence_parallel_size"] == 8 and r["max_tokens_per_microbatch"] == plan.max_tokens_per_microbatch
    for role in ("actor", "ref"):
        entry = t.entries[f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size"]
        assert (entry.status, entry.target) == (MAPPED, "sequence_parallel_size: 8")
    assert "8 x" in t.entries["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"].how
    assert t.entries["trainer.total_epochs"].status == APPROXIMATED


def test_retool_recipe():
    t = translated(RETOOL_SCRIPT)
    r = t.recipe
    assert r["dataset_name"] == "dapo-math-17k:/data/dataset/BytedTsinghua-SIA/DAPO-Math-17k"
    assert r["eval_dataset_name"] == [
        "aime2025:/data/dataset/yentinglin/aime_2025",
        "aime2024:/data/dataset/Maxwell-Jia/AIME_2024",
    ]
    plan = t.batch
    assert plan.responses_per_rollout == 64 * 16 and plan.responses_per_update == 16 * 16
    assert (r["per_device_train_batch_size"], r["steps_per_generation"], plan.updates_per_rollout) == (32, 4, 4)
    # ReTool does not enable dynamic sampling nor the overlong buffer: both off (dapo-trl's defaults are on).
    assert r["filter_groups_enable"] is False and r["apply_overlong_penalty"] is False
    assert r["clip_ratio_c"] == 10.0 and r["epsilon_high"] == 0.28 and r["weight_decay"] == 0.01
    assert r["reward_funcs"] == ["retool"] and r["chat_template"] == "qwen2_5"
    assert r["max_tool_calling_iterations"] == 15 and r["tool_max_output_chars"] == 256  # 16 turns; verl's 256
    assert r["tool_config"] == "tool_config.yaml" and t.files["tool_config.yaml"] == TOOL_CONFIG
    assert (r["eval_num_samples"], r["eval_top_p"], r["eval_temperature"]) == (30, 0.6, 1.0)
    assert (r["save_steps"], r["eval_steps"], r["eval_samples_to_log"]) == (80, 40, 20)
    assert t.accelerate["deepspeed_config"]["deepspeed_config_file"] == "configs/deepspeed/zero3_offload.json"
    assert t.accelerate["num_processes"] == 8 and t.vllm.environment()["MAX_MODEL_LEN"] == "18432"
    assert r["sequence_parallel_size"] == 4 and r["max_tokens_per_microbatch"] == 18432  # verl's len x sp per group
    assert "$@" in " ".join(t.notes)
    assert not t.blocking


def test_grpo_script_kl_in_the_reward_is_mapped(tmp_path):
    result = run_translator(GRPO_SCRIPT, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    recipe = yaml.safe_load((tmp_path / "out" / "recipe.yaml").read_text())
    kl = (recipe["kl_in_reward"], recipe["kl_in_reward_estimator"], recipe["kl_in_reward_coef"])
    assert kl == (True, "kl", 0.001)
    assert recipe["kl_in_reward_controller"] == "fixed" and recipe["beta"] == 0.001  # and the KL loss, both as verl
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| `algorithm.use_kl_in_reward` | `True` | kl_in_reward: true |" in report
    assert "| `algorithm.kl_ctrl.kl_coef` | `0.001` | kl_in_reward_coef: 0.001 |" in report


@pytest.mark.parametrize(
    "overrides,fields,blocking",
    [
        (["algorithm.kl_penalty=k3+"], {"kl_in_reward_estimator": "k3"}, set()),
        (["algorithm.kl_penalty=abs"], {"kl_in_reward_estimator": "abs"}, set()),
        (["algorithm.kl_penalty=full"], {}, {"algorithm.kl_penalty"}),
        (["algorithm.kl_ctrl.type=pid"], {}, {"algorithm.kl_ctrl.type"}),
        (
            ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.05", "+algorithm.kl_ctrl.horizon=500"],
            {"kl_in_reward_controller": "adaptive", "kl_in_reward_target": 0.05, "kl_in_reward_horizon": 500},
            set(),
        ),
        (["algorithm.kl_ctrl.type=adaptive"], {"kl_in_reward_target": 0.1, "kl_in_reward_horizon": 10000}, set()),
    ],
)
def test_kl_in_the_reward_settings(overrides, fields, blocking):
    t = translated(GRPO_SCRIPT, *overrides)
    assert {entry.key for entry in t.blocking} == blocking
    assert {name: t.recipe[name] for name in fields} == fields
    if blocking == {"algorithm.kl_penalty"}:
        assert "verl raises NotImplementedError too" in t.entries["algorithm.kl_penalty"].how


def test_grpo_script_mapping():
    t = translated(GRPO_SCRIPT)
    r = t.recipe
    assert not t.blocking and t.recipe["kl_in_reward"] is True
    assert r["beta"] == 0.001 and t.entries["actor_rollout_ref.actor.kl_loss_type"].status == APPROXIMATED
    assert r["loss_type"] == "grpo" and t.entries["actor_rollout_ref.actor.loss_agg_mode"].status == APPROXIMATED
    # 4 GPUs, 256 x 8 per rollout step, 64 x 8 per update in micro-batches of 16, 2 PPO epochs: K = 4 x 2.
    plan = t.batch
    assert plan.responses_per_rollout == 256 * 8 and plan.responses_per_update == 64 * 8
    assert (r["per_device_train_batch_size"], r["gradient_accumulation_steps"], r["steps_per_generation"]) == (
        16,
        8,
        32,
    )
    assert (r["num_iterations"], plan.updates_per_rollout) == (2, 8)
    assert (r["save_steps"], r["eval_steps"]) == (20 * 8, 5 * 8)
    assert (r["lr_scheduler_type"], r["lr_scheduler_kwargs"], r["warmup_steps"]) == (
        "cosine_with_min_lr",
        {"min_lr_rate": 0.1},
        0.05,
    )
    assert (r["epsilon"], r["epsilon_high"], r["clip_ratio_c"]) == (0.2, 0.2, 3.0)  # verl's defaults
    assert r["eval_temperature"] == pytest.approx(1e-6)  # verl validates greedily by default
    assert r["report_to"] == "tensorboard" and r["dataset_name"] == "/home/user/data/gsm8k/train.parquet"
    assert t.accelerate["distributed_type"] == "MULTI_GPU" and "1.5B" in t.accelerate_rule
    assert t.entries["trainer.total_epochs"].target == "num_train_epochs: 15"
    defaults = {entry.key: entry for entry in t.defaults}
    assert defaults["actor_rollout_ref.actor.clip_ratio_c"].target == "clip_ratio_c: 3.0"
    assert defaults["algorithm.filter_groups.enable"].target == "filter_groups_enable: false"
    assert defaults["reward_model.overlong_buffer.enable"].target == "apply_overlong_penalty: false"


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "full", "k3+", "low_var_kl+"])
def test_unsupported_kl_loss_types_fail_with_a_reason(tmp_path, kind):
    t = translated(GRPO_SCRIPT, "algorithm.use_kl_in_reward=False", f"actor_rollout_ref.actor.kl_loss_type={kind}")
    assert {entry.key for entry in t.blocking} >= {"actor_rollout_ref.actor.kl_loss_type"}
    why = t.entries["actor_rollout_ref.actor.kl_loss_type"].how
    assert f"kl_loss_type={kind!r}" in why and "k3 (low_var_kl)" in why
    if kind == "mse":
        result = run_translator(
            GRPO_SCRIPT,
            tmp_path / "out",
            "algorithm.use_kl_in_reward=False",
            "actor_rollout_ref.actor.kl_loss_type=mse",
        )
        assert result.returncode == 1 and "kl_loss_type='mse'" in result.stderr


def test_k3_is_accepted_and_kl_in_reward_off_is_not_blocking():
    t = translated(GRPO_SCRIPT, "algorithm.use_kl_in_reward=False", "actor_rollout_ref.actor.kl_loss_type=k3")
    assert not t.blocking and t.recipe["beta"] == 0.001
    assert t.entries["algorithm.kl_ctrl.kl_coef"].status == NOT_NEEDED


def test_verl_lora_example_maps_lora_as_verl_builds_it():
    t = translated(LORA_SCRIPT)
    assert not t.blocking
    lora = {key: t.recipe[key] for key in ("use_peft", "lora_r", "lora_alpha", "lora_target_modules", "lora_dropout")}
    assert lora == {
        "use_peft": True,
        "lora_r": 64,
        "lora_alpha": 32,
        "lora_target_modules": ["all-linear"],
        "lora_dropout": 0.0,
    }
    assert "lora_exclude_modules" not in t.recipe
    assert t.recipe["learning_rate"] == 3e-6 and t.recipe["beta"] == 0.001  # verl's lr as is; the KL loss
    for key in ("lora_rank", "lora_alpha"):
        assert t.entries[f"actor_rollout_ref.model.{key}"].status == "mapped"
    assert [entry.key for entry in t.defaults if "target_modules" in entry.key] == [
        "actor_rollout_ref.model.target_modules"
    ]  # not in the script: verl's default all-linear, listed among the defaults applied
    assert "adapter off" in t.entries["actor_rollout_ref.model.lora_rank"].how
    assert any(note.startswith("LoRA: learning_rate is verl's actor.optim.lr (3e-06) unchanged") for note in t.notes)
    t = translated(LORA_SCRIPT, "actor_rollout_ref.model.exclude_modules=.*mlp.*")
    assert t.recipe["lora_exclude_modules"] == [".*mlp.*"] and not t.blocking
    assert t.entries["actor_rollout_ref.model.exclude_modules"].status == "mapped"
    # A one-name list keeps PEFT's suffix matching (one flag value would be a regex the full name must match).
    t = translated(LORA_SCRIPT, "actor_rollout_ref.model.exclude_modules=[q_proj]")
    assert t.recipe["lora_exclude_modules"] == [r"(.*\.)?q_proj"]
    t = translated(LORA_SCRIPT, "actor_rollout_ref.model.exclude_modules=[q_proj,v_proj]")
    assert t.recipe["lora_exclude_modules"] == ["q_proj", "v_proj"]
    t = translated(LORA_SCRIPT, "actor_rollout_ref.model.lora_adapter_path=/adapters/step_100")
    assert [entry.key for entry in t.blocking] == ["actor_rollout_ref.model.lora_adapter_path"]
    t = translated(LORA_SCRIPT, "actor_rollout_ref.model.lora_rank=0")
    assert "use_peft" not in t.recipe and t.entries["actor_rollout_ref.model.lora_alpha"].status == NOT_NEEDED


def test_lora_exclude_modules_reaches_the_peft_config(tmp_path):
    """--lora_exclude_modules (verl's exclude_modules) is passed into TRL's LoraConfig: one value is a regular
    expression, several are names; without --use_peft it is refused."""
    from dapo_trl.cli import DAPOParser
    from dapo_trl.cli.components import UserFacingError
    from dapo_trl.cli.train import peft_config

    def config(*flags):
        script_args, _, model_args = DAPOParser().parse_args_and_config(["--output_dir", str(tmp_path), *flags])
        return peft_config(model_args, script_args)

    lora = config("--use_peft", "true", "--lora_target_modules", "all-linear", "--lora_exclude_modules", ".*mlp.*")
    assert (lora.target_modules, lora.exclude_modules) == ("all-linear", ".*mlp.*")
    assert config("--use_peft", "true", "--lora_exclude_modules", "up_proj", "down_proj").exclude_modules == {
        "up_proj",
        "down_proj",
    }
    with pytest.raises(UserFacingError, match="--lora_exclude_modules needs --use_peft true"):
        config("--lora_exclude_modules", "up_proj")


@pytest.mark.parametrize(
    "script", [DAPO_SCRIPT, RETOOL_SCRIPT, GRPO_SCRIPT, LORA_SCRIPT, MOE_SCRIPT], ids=lambda p: p.stem
)
def test_every_key_is_in_the_report_and_the_files_load(tmp_path, script):
    result = run_translator(script, tmp_path, "--allow-unsupported")
    assert result.returncode == 0, result.stderr
    found = read_verl_input(script, ENVIRONMENT)
    report = (tmp_path / "report.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| `")]
    for key in found.values:
        assert sum(line.startswith(f"| `{key}` |") for line in rows) == 1, key
    assert "## Mapped" in report and "## Batch and step arithmetic" in report
    with warnings.catch_warnings(record=True) as caught:  # the installed transformers' names: nothing deprecated
        warnings.simplefilter("always")
        script_args, config, model_args = parse_recipe(tmp_path / "recipe.yaml")
    assert not [str(w.message) for w in caught if "deprecated" in str(w.message)]
    t = translate(found)
    assert config.per_device_train_batch_size * t.batch.world_size * config.steps_per_generation == (
        t.batch.train_batch_size * t.batch.num_generations
    )
    assert config.num_generations == t.batch.num_generations and model_args.dtype == "float32"
    if script == RETOOL_SCRIPT:
        assert Path(script_args.tool_config) == tmp_path / "tool_config.yaml"
    from accelerate.commands.config.config_args import load_config_from_file

    accelerate = load_config_from_file(str(tmp_path / "accelerate.yaml"))
    assert accelerate.num_processes == t.batch.world_size
    deepspeed = (accelerate.deepspeed_config or {}).get("deepspeed_config_file")
    # verl's FSDP runs with parameter offload (DAPO, ReTool) become ZeRO-3 with offload; the GRPO script is plain DDP.
    # The LoRA example (Qwen2.5-3B, no offload) and the MoE run (Qwen3-30B-A3B) become ZeRO-3 without offload.
    zero3 = "configs/deepspeed/zero3.json"
    expected = {GRPO_SCRIPT: None, LORA_SCRIPT: zero3, MOE_SCRIPT: zero3}.get(
        script, "configs/deepspeed/zero3_offload.json"
    )
    assert deepspeed == expected and (deepspeed is None or (REPO / deepspeed).is_file())
    vllm = (tmp_path / "vllm_server.sh").read_text()
    assert subprocess.run(["bash", "-n", str(tmp_path / "vllm_server.sh")]).returncode == 0
    assert f"TP={t.vllm.tensor_parallel_size}" in vllm and "scripts/start_vllm_server.sh" in vllm
    assert (REPO / "scripts" / "start_vllm_server.sh").is_file()


def test_main_returns_usage_errors(tmp_path, capsys):
    assert main([str(tmp_path / "missing.sh"), "--output", str(tmp_path / "o")]) == 2
    assert "cannot read" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ rollout correction
RC = "algorithm.rollout_correction."
IS_OFF = {"vllm_importance_sampling_correction": False}
NO_REJECTION = {"rollout_rejection": None}
TOKEN_IS = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate"}
SEQUENCE_IS = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_truncate"}


def rejection(level: str, lower: float, upper: float) -> dict:
    return {"rollout_rejection": level, "rollout_rejection_lower": lower, "rollout_rejection_upper": upper}


# verl's rollout_correction settings (0.7's names, the later *_k1 names, and RolloutCorrectionConfig's presets) and
# the recipe fields each becomes. The bands are on pi_old / pi_rollout: a later verl "low_high" is [1/high, 1/low].
ROLLOUT_CORRECTIONS = {
    "token-is": (["rollout_is=token"], {**TOKEN_IS, "vllm_importance_sampling_clip_max": 2.0, **NO_REJECTION}),
    "sequence-is-threshold-5": (
        ["rollout_is=sequence", "rollout_is_threshold=5.0"],
        {**SEQUENCE_IS, "vllm_importance_sampling_clip_max": 5.0, "vllm_importance_sampling_clip_min": None},
    ),
    "token-rs": (["rollout_rs=token", "rollout_rs_threshold=2.0"], {**IS_OFF, **rejection("token", 0.5, 2.0)}),
    "sequence-rs-lower": (
        ["rollout_rs=sequence", "rollout_rs_threshold=3.0", "rollout_rs_threshold_lower=0.8"],
        rejection("sequence", 0.8, 3.0),
    ),
    "geometric-rs": (["rollout_rs=geometric", "rollout_rs_threshold=1.001"], rejection("geometric", 1 / 1.001, 1.001)),
    "token-k1": (["rollout_rs=token_k1", "rollout_rs_threshold=0.6_1.4"], rejection("token", 1 / 1.4, 1 / 0.6)),
    "seq-sum-k1-number": (["rollout_rs=seq_sum_k1", "rollout_rs_threshold=2.0"], rejection("sequence", 0.5, 2.0)),
    "decoupled_seq_is_rs": (
        ["rollout_is=sequence", "rollout_is_threshold=2.0", "rollout_rs=seq_sum_k1", "rollout_rs_threshold=0.5_2.0"],
        {**SEQUENCE_IS, "vllm_importance_sampling_clip_max": 2.0, **rejection("sequence", 0.5, 2.0)},
    ),
    "decoupled_geo_rs_token_tis": (
        ["rollout_is=token", "rollout_rs=seq_mean_k1", "rollout_rs_threshold=0.999_1.001"],
        {**TOKEN_IS, **rejection("geometric", 1 / 1.001, 1 / 0.999)},
    ),
    "bypass_ppo_clip": (["bypass_mode=true"], {"old_logprobs_source": "engine", **IS_OFF, **NO_REJECTION}),
    "bypass_ppo_clip_geo_rs": (
        ["bypass_mode=true", "loss_type=ppo_clip", "rollout_is=token", "rollout_rs=seq_mean_k1"]
        + ["rollout_rs_threshold=0.999_1.001"],
        {"old_logprobs_source": "engine", **IS_OFF, **rejection("geometric", 1 / 1.001, 1 / 0.999)},
    ),
}


@pytest.mark.parametrize("name", sorted(ROLLOUT_CORRECTIONS))
def test_each_rollout_correction_setting_maps_to_its_recipe(tmp_path, name):
    """Each verl rollout-correction setting becomes TRL's truncated importance weight, dapo-trl's rejection band and
    pi_old's source as listed; nothing blocks, the rejection is reported as approximated (rejected tokens stay in the
    token denominator), and the recipe passes DAPOConfig's checks."""
    overrides, fields = ROLLOUT_CORRECTIONS[name]
    t = translated(GRPO_SCRIPT, *(RC + override for override in overrides))
    assert not t.blocking, [(entry.key, entry.how) for entry in t.blocking]
    assert {field: t.recipe.get(field) for field in fields} == pytest.approx(fields)
    for key in (RC + "rollout_is", RC + "rollout_rs", RC + "bypass_mode"):
        assert key not in t.found.values or key in t.entries
    if t.recipe.get("rollout_rejection"):
        entry = t.entries[RC + "rollout_rs"]
        assert entry.status == APPROXIMATED and "stays in the token denominator" in entry.how
    write_outputs(t, tmp_path)
    _, config, _ = parse_recipe(tmp_path / "recipe.yaml")
    for field, value in fields.items():
        assert getattr(config, field) == pytest.approx(value), field


@pytest.mark.parametrize(
    ("overrides", "key", "reason"),
    [
        (["rollout_rs=token"], "rollout_rs", "without rollout_rs_threshold: verl stops"),
        (["rollout_rs=seq_mean_k3", "rollout_rs_threshold=0.01"], "rollout_rs", "divergence estimate"),
        (["rollout_rs=seq_max_k2", "rollout_rs_threshold=2.5"], "rollout_rs", "divergence estimate"),
        (["rollout_rs='token_k1,seq_sum_k1'", "rollout_rs_threshold=2.0"], "rollout_rs", "several rejection criteria"),
        (["rollout_rs=token_k1", "rollout_rs_threshold=0.6_1.6,2.5"], "rollout_rs", "not a positive number"),
        (
            ["rollout_rs=token", "rollout_rs_threshold=2", "rollout_token_veto_threshold=1e-4"],
            "rollout_token_veto_threshold",
            "veto",
        ),
        (["rollout_is=sequence", "rollout_is_batch_normalize=true"], "rollout_is_batch_normalize", "mean 1"),
        (["rollout_is=median"], "rollout_is", "token and sequence"),
        (["bypass_mode=true", "loss_type=reinforce"], "loss_type", "REINFORCE"),
        (["bypass_mode=true", "use_policy_gradient=true"], "use_policy_gradient", "REINFORCE"),
    ],
)
def test_rollout_correction_settings_without_a_counterpart_block_naming_why(overrides, key, reason):
    t = translated(GRPO_SCRIPT, *(RC + override for override in overrides))
    blocking = {entry.key: entry.how for entry in t.blocking}
    assert RC + key in blocking and reason in blocking[RC + key], blocking


def test_rollout_correction_needs_the_engines_log_probs():
    t = translated(GRPO_SCRIPT, "actor_rollout_ref.rollout.name=hf", RC + "rollout_is=token", RC + "bypass_mode=true")
    assert {entry.key for entry in t.blocking} == {RC + "rollout_is", RC + "bypass_mode"}
    assert "use rollout.name=vllm" in t.entries[RC + "rollout_is"].how


def test_rollout_correction_off_is_not_needed_and_trls_weight_stays_off():
    t = translated(GRPO_SCRIPT, RC + "rollout_is=null", RC + "rollout_rs=null", RC + "rollout_is_threshold=3.0")
    assert not t.blocking and t.recipe["vllm_importance_sampling_correction"] is False
    assert "rollout_rejection" not in t.recipe and "old_logprobs_source" not in t.recipe
    assert {t.entries[RC + key].status for key in ("rollout_is", "rollout_rs", "rollout_is_threshold")} == {NOT_NEEDED}


# ------------------------------------------------------------------------------------------------ end to end
VERL_SOURCES = ["math_dapo", "openai/gsm8k", "lighteval/MATH", "aime2024"]


def write_verl_parquet(path: Path, sources: list[str], rows: int = 64) -> Path:
    """Built-in arithmetic problems as one of verl's preprocessed parquet files, data sources taken in turn."""
    from datasets import Dataset

    from dapo_trl.data import make_arithmetic_dataset

    problems = make_arithmetic_dataset(num_problems=rows)
    Dataset.from_list(
        [
            {
                "data_source": sources[i % len(sources)],
                "prompt": row["prompt"],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": row["solution"]},
                "extra_info": {"index": i},
            }
            for i, row in enumerate(problems)
        ]
    ).to_parquet(str(path))
    return path


E2E_OVERRIDES = [
    "--model_name_or_path",
    "builtin:tiny",
    "--max_steps",
    "2",
    "--per_device_train_batch_size",
    "8",
    "--num_generations",
    "4",
    "--gradient_accumulation_steps",
    "1",
    "--steps_per_generation",
    "2",
    "--max_completion_length",
    "32",
    "--use_vllm",
    "false",
    "--eval_strategy",
    "no",
    "--val_before_train",
    "false",
    "--report_to",
    "none",
    "--save_strategy",
    "no",
    "--logging_steps",
    "1",
    "--plot",
    "false",
    "--disable_tqdm",
    "true",
]


def test_verls_gspo_example_is_sequence_level_importance_sampling_without_dual_clip():
    t = translated(GSPO_SCRIPT, *GSPO_INPUTS[2:], env={**ENVIRONMENT, "SLURM_JOB_NUM_NODES": "1"})
    r = t.recipe
    assert not t.blocking and not t.found.unresolved
    assert (r["loss_type"], r["importance_sampling_level"], r["clip_ratio_c"]) == ("grpo", "sequence", None)
    assert (r["epsilon"], r["epsilon_high"]) == (0.0003, 0.0004)  # the GSPO paper's, Sec. 5.1
    assert r["max_tokens_per_microbatch"] == 20480 and r["apply_overlong_penalty"] is False  # its buffer is off
    assert t.entries["actor_rollout_ref.actor.policy_loss.loss_mode"].status == APPROXIMATED
    (dual_clip,) = [entry for entry in t.defaults if entry.key == "actor_rollout_ref.actor.clip_ratio_c"]
    assert dual_clip.status == NOT_NEEDED  # verl's GSPO loss ignores it: its 3.0 default is not applied


def test_verls_gmpo_example_is_gmpo_with_its_overlong_penalty():
    """loss_mode=geo_mean is the gmpo loss (its own sequence mean, log-space clip 0.4, no dual-clip); the DAPO reward
    manager's overlong buffer, passed as reward_kwargs, is DAPO's penalty; the model-config override is a step the
    user takes, reported, not a refusal."""
    t = translated(GMPO_SCRIPT)
    r = t.recipe
    assert not t.blocking and not t.found.unresolved
    assert (r["loss_type"], r["epsilon"], r["epsilon_high"], r["clip_ratio_c"]) == ("gmpo", 0.4, 0.4, None)
    assert r.get("importance_sampling_level", "token") == "token"
    assert (r["apply_overlong_penalty"], r["overlong_buffer_len"], r["overlong_penalty_factor"]) == (True, 4096, 1.0)
    assert t.entries["actor_rollout_ref.actor.policy_loss.loss_mode"].status == MAPPED
    assert t.entries["actor_rollout_ref.actor.loss_agg_mode"].status == NOT_NEEDED  # geo_mean ignores it
    override = t.entries["actor_rollout_ref.model.override_config.max_position_embeddings"]
    assert override.status == UNSUPPORTED and not override.blocking


def test_the_loss_modes_translated_are_the_loss_tables_verl_names():
    from dapo_trl.algorithm.losses import POLICY_LOSSES
    from dapo_trl.verl_import.losses import OWN_LOSS_MODES

    for mode, (loss_type, _) in OWN_LOSS_MODES.items():
        assert POLICY_LOSSES[loss_type].verl_name == mode
    assert {row.verl_name for row in POLICY_LOSSES.values()} - {None} == {"vanilla", *OWN_LOSS_MODES}


def test_verls_qwen3_grpo_example_translates_as_it_is():
    t = translated(QWEN3_SCRIPT)
    r = t.recipe
    assert not t.blocking and not t.found.unresolved
    assert (r["loss_type"], r["beta"], r["clip_ratio_c"], r["num_generations"]) == ("dapo", 0.001, 3.0, 5)
    assert r["filter_groups_enable"] is False and r["kl_in_reward"] is False


def test_verls_sapo_loss_mode_maps_with_its_temperatures():
    mode, tau = "actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "+actor_rollout_ref.actor.tau_pos=1.2"
    t = translated(GRPO_SCRIPT, mode, tau, "actor_rollout_ref.actor.loss_agg_mode=token-mean")
    r = t.recipe
    assert not t.blocking
    assert (r["loss_type"], r["clip_ratio_c"]) == ("sapo", None)  # verl's SAPO aggregates seq-mean-token-mean
    assert (r["sapo_temperature_pos"], r["sapo_temperature_neg"]) == (1.2, 1.05)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "script",
    [DAPO_SCRIPT, RETOOL_SCRIPT, GRPO_SCRIPT, LORA_SCRIPT, GSPO_SCRIPT, GMPO_SCRIPT, QWEN3_SCRIPT],
    ids=lambda p: p.stem,
)
def test_translated_recipe_trains_two_steps(tmp_path, script):
    """Each translated recipe trains 2 steps on verl-format rows (GSM8K's among them): DAPO's with its Ulysses
    sequence parallelism on 2 processes (one group of 2); verl's LoRA example through train_dapo.py's ModelConfig
    flags (use_peft, lora_r 64, ...): only the adapter is saved, and it trained (through gradient checkpointing; an
    entropy bonus gives it a gradient even where the tiny model's sampled groups all score alike)."""
    inputs = GSPO_INPUTS if script == GSPO_SCRIPT else ()
    result = run_translator(script, tmp_path / "recipe", *inputs)  # nothing blocking in any of them
    assert result.returncode == 0, result.stderr
    recipe = yaml.safe_load((tmp_path / "recipe" / "recipe.yaml").read_text())
    data = str(write_verl_parquet(tmp_path / "train.parquet", VERL_SOURCES))  # each source scored by its own scorer
    overrides = [*E2E_OVERRIDES, "--output_dir", str(tmp_path / "run")]
    overrides += ["--dataset_name", data, "--eval_dataset_name", data]
    if recipe.get("apply_overlong_penalty"):
        overrides += ["--overlong_buffer_len", "8"]
    command = ["train_dapo.py", "--config", str(tmp_path / "recipe" / "recipe.yaml"), *overrides]
    if recipe.get("sequence_parallel_size", 1) > 1:  # verl's Ulysses 8 (DAPO) or 4 (ReTool)
        if script == DAPO_SCRIPT:  # on 2 processes, one group of 2, every forward sharded
            overrides = ["--sequence_parallel_size", "2", "--per_device_train_batch_size", "4"]
            command = python_command(*command, *overrides, num_processes=2)
        else:
            command = [sys.executable, *command, "--sequence_parallel_size", "1"]
    else:
        command = [sys.executable, *command]
    if script == LORA_SCRIPT:  # a gradient whatever the rewards: a group of equal rewards has no advantage
        command += ["--entropy_coeff", "0.01"]
    run = run_command(command, timeout=300)
    assert "step 2" in run.stdout, run.stdout[-2000:]
    assert (tmp_path / "run" / "model.safetensors").exists() == (script != LORA_SCRIPT)
    assert ("'kl/in_reward'" in run.stdout) == (script == GRPO_SCRIPT)  # the GRPO script's KL in the reward ran
    if script != RETOOL_SCRIPT:  # verl_default scored each data source with its own scorer
        logged = set(re.findall(r"'rewards/verl_default/acc/([^']+)'", run.stdout))
        assert len(logged) >= 2 and logged <= set(VERL_SOURCES), run.stdout[-3000:]
    if script == LORA_SCRIPT:
        import json

        from safetensors.torch import load_file

        adapter = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
        assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == (64, 32, 0.0)
        weights = load_file(tmp_path / "run" / "adapter_model.safetensors")
        assert weights and all("lora_A" in name or "lora_B" in name for name in weights)  # the adapter alone
        assert any(value.abs().max() > 0 for name, value in weights.items() if "lora_B" in name)  # B left zero
        assert "'kl'" in run.stdout  # verl's KL loss, against the adapter-off reference


def test_default_reward_is_verls_scorer_per_data_source(tmp_path):
    """No custom reward: verl_default, and the report says which scorer each data source of the files gets."""
    write_verl_parquet(tmp_path / "train.parquet", ["openai/gsm8k", "lighteval/MATH", "math_dapo"], rows=12)
    write_verl_parquet(tmp_path / "test.parquet", ["openai/gsm8k"], rows=4)
    t = translated(GRPO_SCRIPT, env={**ENVIRONMENT, "GSM8K_DIR": str(tmp_path)})
    assert t.recipe["reward_funcs"] == ["verl_default"] and not t.blocking
    notes = "\n".join(t.notes)
    assert f"'openai/gsm8k' (4 rows of {tmp_path}/train.parquet): GSM8K's '#### N' scorer (1 / 0)" in notes
    assert f"'lighteval/MATH' (4 rows of {tmp_path}/train.parquet): Hendrycks' MATH scorer" in notes
    assert f"'math_dapo' (4 rows of {tmp_path}/train.parquet): DAPO's 'Answer:' scorer (+1 / -1)" in notes
    assert f"'openai/gsm8k' (4 rows of {tmp_path}/test.parquet)" in notes
    # A source verl scores with a scorer dapo-trl lacks blocks the translation, naming it and the way on.
    write_verl_parquet(tmp_path / "train.parquet", ["openai/gsm8k", "numina_olympiads"], rows=4)
    t = translated(GRPO_SCRIPT, env={**ENVIRONMENT, "GSM8K_DIR": str(tmp_path)})
    assert [entry.key for entry in t.blocking] == ["custom_reward_function.path"]
    assert "'numina_olympiads' (verl's prime_math)" in t.blocking[0].how and "compute_score" in t.blocking[0].how
    # Code sources are scored on the SandboxFusion service verl's config names.
    write_verl_parquet(tmp_path / "train.parquet", ["openai/gsm8k", "apps"], rows=4)
    t = translated(
        GRPO_SCRIPT,
        "reward_model.sandbox_fusion.url=http://sandbox:8080/run_code",
        env={**ENVIRONMENT, "GSM8K_DIR": str(tmp_path)},
    )
    assert not t.blocking and t.recipe["sandbox_url"] == "http://sandbox:8080/run_code"
    assert "'apps' (2 rows of" in "\n".join(t.notes) and "SandboxFusion code scorer" in "\n".join(t.notes)
    # Files that are not here: the sources are unknown, said in a note, nothing blocks.
    t = translated(GRPO_SCRIPT)
    assert not t.blocking and "is not here to read" in "\n".join(t.notes)


# ------------------------------------------------------------------------------------------------ --tool_config
def tool_config(**config) -> dict:
    data = yaml.safe_load(TOOL_CONFIG.read_text())
    data["tools"][0]["config"].update(config)
    return data


def test_verl_tool_config_becomes_the_remote_sandbox():
    from dapo_trl.tools.verl_config import load_verl_tool_config

    settings = load_verl_tool_config(TOOL_CONFIG, world_size=8)
    assert settings.sandbox_url == "http://localhost:8080/run_code"
    assert (settings.timeout_s, settings.memory_mb, settings.max_concurrency) == (30.0, 1024, 16)  # 128 over 8
    assert settings.tool_name == "code_interpreter" and settings.description == "A tool for executing code."
    notes = " ".join(settings.notes)
    assert "CustomSandboxFusionTool" in notes and "cluster-wide" in notes
    alone = load_verl_tool_config(TOOL_CONFIG, world_size=1)
    assert alone.max_concurrency == 128


@pytest.mark.parametrize(
    "change, message",
    [
        ({"default_language": "cpp"}, "runs Python only"),
        ({"type": "mcp"}, "only 'native' tools"),
        ({"sandbox_fusion_url": ""}, "sandbox_fusion_url is not set"),
        ({"memory_limit_mb": 0}, "must be > 0"),
    ],
)
def test_verl_tool_config_fields_that_cannot_be_honoured_are_errors(change, message):
    from dapo_trl.tools.verl_config import ToolConfigError, parse_verl_tool_config

    with pytest.raises(ToolConfigError, match=message):
        parse_verl_tool_config(tool_config(**change))


def test_verl_tool_config_other_tools_are_errors():
    from dapo_trl.tools.verl_config import ToolConfigError, parse_verl_tool_config

    data = tool_config()
    data["tools"][0]["class_name"] = "verl.tools.gsm8k_tool.Gsm8kTool"
    with pytest.raises(ToolConfigError, match="only verl's SandboxFusionTool"):
        parse_verl_tool_config(data)
    data = tool_config()
    data["tools"][0]["tool_schema"]["function"]["parameters"]["properties"]["timeout"] = {"type": "integer"}
    with pytest.raises(ToolConfigError, match="exactly one, 'code'"):
        parse_verl_tool_config(data)


def test_tool_config_flag_builds_the_interpreter_the_yaml_describes(tmp_path):
    from transformers.utils import get_json_schema

    from dapo_trl.cli import DAPOScriptArguments, UserFacingError, build_tools
    from dapo_trl.tools.code_interpreter import interpreter_of
    from dapo_trl.tools.remote import RemoteSandbox

    data = tool_config(default_timeout=12, memory_limit_mb=512, unknown_knob=1)
    data["tools"][0]["tool_schema"]["function"].update(name="python", description="Runs a program.")
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump(data))
    args = DAPOScriptArguments(tool_config=str(path))
    (tool,) = build_tools(args, world_size=4)
    sandbox = interpreter_of(tool).sandbox
    assert isinstance(sandbox, RemoteSandbox) and sandbox.url == "http://localhost:8080/run_code"
    assert (sandbox.limits.timeout_s, sandbox.limits.memory_mb, sandbox.gate.max_concurrency) == (12.0, 512, 32)
    assert args.tools == ["code_interpreter"] and args.sandbox == "remote"
    schema = get_json_schema(tool)["function"]
    assert schema["name"] == "python" and schema["description"] == "Runs a program."
    assert schema["parameters"]["properties"]["code"]["description"] == "The code to execute."
    interpreter_of(tool).close()
    with pytest.raises(UserFacingError, match="--sandbox_timeout 5.0 contradicts --tool_config"):
        build_tools(DAPOScriptArguments(tool_config=str(path), sandbox_timeout=5.0))
    with pytest.raises(UserFacingError, match="--tool_config: .*runs Python only"):
        path.write_text(yaml.safe_dump(tool_config(default_language="go")))
        build_tools(DAPOScriptArguments(tool_config=str(path)))


# ------------------------------------------------------------------------------------------------ reward paths
def test_reward_import_paths_and_verl_compute_score(tmp_path):
    from dapo_trl.cli import UserFacingError, resolve_reward_function
    from dapo_trl.rewards import dapo_math_reward

    assert resolve_reward_function("dapo_trl.rewards:dapo_math_reward") is dapo_math_reward
    assert resolve_reward_function("dapo_trl.rewards.dapo_math_reward") is dapo_math_reward
    module = tmp_path / "my_reward.py"
    module.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    ok = solution_str.strip().endswith(str(ground_truth))\n"
        "    return {'score': 1.0 if ok else -1.0 + 0.1 * (extra_info['num_turns'] - 2), 'acc': ok}\n"
        "def trl_style(completions, **kwargs):\n"
        "    return [0.5] * len(completions)\n"
    )
    verl_reward = resolve_reward_function(f"{module}:compute_score")
    assert verl_reward.__name__ == "compute_score"
    scores = verl_reward(
        completions=["so 4", [{"role": "assistant", "content": "5"}]],
        solution=["4", "4"],
        data_source=["math_dapo", "math_dapo"],
    )
    assert scores == [1.0, -1.0]
    assert resolve_reward_function(f"{module}:trl_style")(completions=["a"]) == [0.5]  # TRL signature: as is
    with pytest.raises(UserFacingError, match="cannot import it"):
        resolve_reward_function(f"{tmp_path / 'missing.py'}:compute_score")


def test_yaml_config_through_the_command_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "algorithm": {"adv_estimator": "grpo"},
                "data": {
                    "train_batch_size": 32,
                    "max_prompt_length": 256,
                    "max_response_length": 128,
                    "train_files": "/d/train.parquet",
                },
                "actor_rollout_ref": {
                    "model": {"path": "/m/tiny-0.1B"},
                    "actor": {
                        "ppo_mini_batch_size": 8,
                        "ppo_micro_batch_size_per_gpu": 4,
                        "checkpoint": {"save_contents": ["model"], "load_contents": "${.save_contents}"},
                    },
                    "rollout": {"n": 4, "name": "hf"},
                },
                "custom_reward_function": {"path": "/rewards/mine.py", "name": "score"},
                "trainer": {"n_gpus_per_node": 2, "nnodes": 1, "logger": ["console"]},
            }
        )
    )
    result = run_translator(config, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    recipe = yaml.safe_load((tmp_path / "out" / "recipe.yaml").read_text())
    assert recipe["reward_funcs"] == ["/rewards/mine.py:score"] and recipe["use_vllm"] is False
    assert (recipe["per_device_train_batch_size"], recipe["gradient_accumulation_steps"]) == (4, 4)  # 8 x 4 / 2
    assert recipe["steps_per_generation"] == 4 * 4 and recipe["report_to"] == "none"
    accelerate = yaml.safe_load((tmp_path / "out" / "accelerate.yaml").read_text())
    assert accelerate["distributed_type"] == "MULTI_GPU" and accelerate["num_processes"] == 2
    found = read_verl_input(config, {})
    resolve_interpolations(found, {})
    assert found.values["actor_rollout_ref.actor.checkpoint.load_contents"] == ["model"]  # relative ${.key}


def test_the_overlong_buffer_main_ppo_passes_to_the_dapo_reward_manager_is_mapped():
    """Many DAPO scripts set it as +reward_model.reward_kwargs.overlong_buffer_cfg.* (main_ppo hands reward_kwargs to
    the DAPO reward manager): the penalty is on, with their length and factor, not filed as not needed."""
    prefix = "+reward_model.reward_kwargs."
    t = translated(
        GRPO_SCRIPT,
        f"{prefix}overlong_buffer_cfg.enable=True",
        f"{prefix}overlong_buffer_cfg.len=512",
        f"{prefix}overlong_buffer_cfg.penalty_factor=0.5",
        f"{prefix}overlong_buffer_cfg.log=False",
        f"{prefix}max_resp_len=2048",
    )
    r = t.recipe
    assert (r["apply_overlong_penalty"], r["overlong_buffer_len"], r["overlong_penalty_factor"]) == (True, 512, 0.5)
    assert t.entries["reward_model.reward_kwargs.overlong_buffer_cfg.enable"].status == MAPPED
    assert t.entries["reward_model.reward_kwargs.max_resp_len"].status == NOT_NEEDED and not t.blocking


def test_a_model_config_override_is_a_step_the_user_takes_with_its_command():
    """GMPO's script sets override_config.max_position_embeddings ("very important"): not filed as not needed, but
    reported with how to prepare the model folder (its config.json edited), in the report's notes too."""
    key = "actor_rollout_ref.model.override_config.max_position_embeddings"
    t = translated(GRPO_SCRIPT, f"+{key}=32768")
    entry = t.entries[key]
    assert entry.status == UNSUPPORTED and not entry.blocking
    assert '{"max_position_embeddings": 32768}' in entry.how and "--model_name_or_path PREPARED_MODEL" in entry.how
    assert any("verl overrides the model config at load (max_position_embeddings)" in note for note in t.notes)


def test_allow_unsupported_says_at_the_top_of_the_recipe_what_the_run_does_instead(tmp_path):
    result = run_translator(
        GSPO_SCRIPT,
        tmp_path / "out",
        *GSPO_INPUTS,
        "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
        "--allow-unsupported",
    )
    assert result.returncode == 0, result.stderr
    head = (tmp_path / "out" / "recipe.yaml").read_text().split("\n\n")[0]
    assert "NOT TRANSLATED (written with --allow-unsupported)" in head
    assert "actor_rollout_ref.actor.policy_loss.loss_mode = clip_cov" in head
    assert "Instead: loss_type grpo with a token-level clipped ratio and the same epsilons" in head


# ------------------------------------------------------------------------------------------------ mixture of experts
ROUTER_REPLAY_MODE = "actor_rollout_ref.actor.router_replay.mode"
ENGINE_ROUTING = "actor_rollout_ref.rollout.enable_rollout_routing_replay"


def test_r3_router_replay_becomes_routing_replay_with_the_streaming_rollout(tmp_path):
    """verl's R3 (router_replay.mode=R3 with the rollout's enable_rollout_routing_replay) is routing_replay, on the
    streaming rollout, whose vLLM server returns the routed experts; the recipe passes DAPOConfig's checks."""
    t = translated(MOE_SCRIPT)
    r = t.recipe
    assert not t.blocking
    assert (r["routing_replay"], r["rollout_streaming"], r["filter_groups_enable"]) == (True, True, True)
    assert (r["use_vllm"], r["vllm_mode"]) == (True, "server")
    assert t.vllm.extra_args[-1] == "--enable-return-routed-experts"
    mode, engine = t.entries[ROUTER_REPLAY_MODE], t.entries[ENGINE_ROUTING]
    assert (mode.status, mode.target) == (MAPPED, "routing_replay: true, rollout_streaming: true")
    assert (engine.status, engine.target) == (MAPPED, "vllm_server.sh --enable-return-routed-experts")
    assert any("not --vllm_mode colocate" in note for note in t.notes)
    result = run_translator(MOE_SCRIPT, tmp_path)
    assert result.returncode == 0, result.stderr
    _, config, _ = parse_recipe(tmp_path / "recipe.yaml")  # DAPOConfig's checks: streaming, padding-free, ...
    assert (config.routing_replay, config.rollout_streaming, config.router_aux_loss_coef) == (True, True, 0.001)
    assert "--enable-return-routed-experts" in (tmp_path / "vllm_server.sh").read_text()
    report = (tmp_path / "report.md").read_text()
    assert "Routing replay needs vllm_server.sh's server" in report and "`--vllm_mode colocate --vllm" not in report


def test_r3_of_a_plain_grpo_script_streams_without_dynamic_sampling(tmp_path):
    """verl's own R3 example is plain GRPO (no dynamic sampling): its translation streams (the engine's routing comes
    with the streaming rollout's requests) with every group kept, and passes DAPOConfig's checks."""
    t = translated(MOE_SCRIPT, "algorithm.filter_groups.enable=False")
    r = t.recipe
    assert not t.blocking
    assert (r["routing_replay"], r["rollout_streaming"], r["filter_groups_enable"]) == (True, True, False)
    result = run_translator(MOE_SCRIPT, tmp_path, "algorithm.filter_groups.enable=False")
    assert result.returncode == 0, result.stderr
    _, config, _ = parse_recipe(tmp_path / "recipe.yaml")
    assert (config.routing_replay, config.rollout_streaming, config.filter_groups_enable) == (True, True, False)


def test_r3_with_the_rollout_flag_off_still_replays_and_the_flag_alone_does_not():
    t = translated(MOE_SCRIPT, f"{ENGINE_ROUTING}=False")
    assert t.recipe["routing_replay"] is True and not t.blocking
    entry = t.entries[ENGINE_ROUTING]
    assert entry.status == APPROXIMATED and "its actor asserts the engine's routing is there" in entry.how
    # The engine's routing without mode=R3: verl's actor replays nothing, and neither does the recipe.
    t = translated(MOE_SCRIPT, f"{ROUTER_REPLAY_MODE}=disabled")
    assert t.recipe["routing_replay"] is False and "rollout_streaming" not in t.recipe and not t.blocking
    assert t.entries[ENGINE_ROUTING].status == NOT_NEEDED and "mode=R3" in t.entries[ENGINE_ROUTING].how
    assert "--enable-return-routed-experts" not in t.vllm.extra_args


def test_r2_router_replay_is_unsupported_and_names_r3(tmp_path):
    t = translated(MOE_SCRIPT, env={**ENVIRONMENT, "ROUTING_REPLAY_MODE": "R2"})
    assert [entry.key for entry in t.blocking] == [ROUTER_REPLAY_MODE]
    why = t.blocking[0].how
    assert "R2" in why and "not supported" in why and "R3" in why and "routing_replay: true" in why
    assert t.recipe["routing_replay"] is False and "rollout_streaming" not in t.recipe
    result = run_translator(MOE_SCRIPT, tmp_path, f"{ROUTER_REPLAY_MODE}=R2", "--allow-unsupported")
    assert result.returncode == 0, result.stderr
    head = (tmp_path / "recipe.yaml").read_text().split("\n\n")[0]
    assert "actor_rollout_ref.actor.router_replay.mode = R2" in head
    assert "Instead: routing_replay false: the training forwards route the tokens themselves" in head


@pytest.mark.parametrize(
    "override, fix",
    [
        ("actor_rollout_ref.rollout.name=hf", "this rollout generates with transformers"),
        ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "ulysses_sequence_parallel_size=1"),
        ("actor_rollout_ref.model.use_remove_padding=False", "set actor_rollout_ref.model.use_remove_padding=True"),
    ],
)
def test_r3_that_the_trainer_would_refuse_blocks_with_the_fix(override, fix):
    """What DAPOConfig or DAPOTrainer refuses with routing_replay (no dynamic sampling to stream, no vLLM server,
    sequence parallelism, padded forwards) blocks the translation, saying what to change."""
    t = translated(MOE_SCRIPT, override)
    assert ROUTER_REPLAY_MODE in {entry.key for entry in t.blocking}
    assert fix in t.entries[ROUTER_REPLAY_MODE].how and t.recipe["routing_replay"] is False


def test_router_aux_loss_coefficient_maps_and_defaults_to_verls_none():
    """model.override_config.router_aux_loss_coef (verl writes it into the model config) is TRL's
    router_aux_loss_coef; without it the recipe says 0.0, as verl's FSDP actor adds no router loss (TRL's default
    would add the model config's)."""
    t = translated(MOE_SCRIPT)
    key = "actor_rollout_ref.model.override_config.router_aux_loss_coef"
    assert t.recipe["router_aux_loss_coef"] == 0.001
    assert (t.entries[key].status, t.entries[key].target) == (APPROXIMATED, "router_aux_loss_coef: 0.001")
    assert not any("verl overrides the model config at load" in note for note in t.notes)  # not a folder to prepare
    t = translated(DAPO_SCRIPT)
    defaults = {entry.key: entry for entry in t.defaults}
    assert t.recipe["router_aux_loss_coef"] == 0.0 and defaults[key].target == "router_aux_loss_coef: 0.0"
    assert "verl's FSDP actor adds no router load-balancing loss" in defaults[key].how


def test_megatron_moe_keys_are_reported_as_megatron_only():
    t = translated(MOE_SCRIPT)
    megatron = "actor_rollout_ref.actor.megatron."
    coefficient = t.entries[megatron + "override_transformer_config.moe_aux_loss_coeff"]
    assert coefficient.status == UNSUPPORTED and not coefficient.blocking
    assert coefficient.how.startswith("Megatron-only: ") and "pass --router_aux_loss_coef 0.001" in coefficient.how
    balancing = t.entries[megatron + "override_transformer_config.moe_router_load_balancing_type"]
    assert balancing.status == UNSUPPORTED and "--router_aux_loss_coef 0 (none)" in balancing.how
    for name in ("expert_model_parallel_size", "override_transformer_config.moe_token_dispatcher_type"):
        assert t.entries[megatron + name].status == NOT_NEEDED
    for key in [key for key in t.found.values if ".megatron." in key]:
        assert t.entries[key].how.startswith("Megatron-only: "), key
    assert t.entries["actor_rollout_ref.ref.megatron.expert_model_parallel_size"].status == NOT_NEEDED


def test_rollout_expert_parallelism_is_vllms_enable_expert_parallel():
    """verl's vLLM rollout passes enable_expert_parallel when expert_parallel_size > 1 (and asserts it equals TP x
    DP): vllm_server.sh gets --enable-expert-parallel, which splits the experts over all TP x DP GPUs."""
    key = "actor_rollout_ref.rollout.expert_parallel_size"
    t = translated(MOE_SCRIPT, f"{key}=4")  # gen_tp 4, data parallel 1
    assert "--enable-expert-parallel" in t.vllm.extra_args
    assert (t.entries[key].status, t.entries[key].target) == (MAPPED, "vllm_server.sh --enable-expert-parallel")
    t = translated(MOE_SCRIPT, f"{key}=8")  # not TP x DP: verl would refuse it
    assert t.entries[key].status == APPROXIMATED and "TP x DP = 4 GPUs" in t.entries[key].how
    t = translated(MOE_SCRIPT, f"{key}=1")
    assert "--enable-expert-parallel" not in t.vllm.extra_args and t.entries[key].status == NOT_NEEDED
    assert "--enable-expert-parallel" not in translated(MOE_SCRIPT).vllm.extra_args  # unset: tensor parallel experts
