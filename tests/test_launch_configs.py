"""The launch configs (configs/accelerate/*.yaml, configs/deepspeed/*.json) load and say what their names say, and
run_dapo.sh wires them into the `accelerate launch train_dapo.py` command it runs: its generation (vLLM server,
colocated vLLM, or transformers' generate, said on stderr), and the command examples/slurm_dapo.sbatch gives it.

The YAML training recipes in configs/ (`train_dapo.py --config`) are tests/test_cli_arguments.py's."""

import json
import os
import re
import subprocess

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from .helpers import REPO

ACCELERATE_CONFIGS = sorted((REPO / "configs" / "accelerate").glob("*.yaml"))
DEEPSPEED_CONFIGS = sorted((REPO / "configs" / "deepspeed").glob("*.json"))


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.stem)
def test_accelerate_configs_load_and_point_to_existing_deepspeed_files(path):
    config = load_config_from_file(str(path))
    raw = yaml.safe_load(path.read_text())
    if "zero3" in path.stem:
        assert config.distributed_type == "DEEPSPEED"
        deepspeed_file = REPO / raw["deepspeed_config"]["deepspeed_config_file"]
        assert deepspeed_file.exists()
        assert json.loads(deepspeed_file.read_text())["zero_optimization"]["stage"] == 3
        assert ("offload" in path.stem) == ("offload" in deepspeed_file.stem)
    else:  # no DeepSpeed in the name: none in the config
        assert config.distributed_type == "NO" and "deepspeed_config" not in raw
    assert config.num_machines == (2 if "2nodes" in path.stem else 1)
    gpus = re.search(r"(\d+)gpu", path.stem)  # zero3_2nodes_16gpu: 16 processes in all; single_gpu: 1
    assert config.num_processes == (int(gpus.group(1)) if gpus else 1)


@pytest.mark.parametrize("path", DEEPSPEED_CONFIGS, ids=lambda p: p.stem)
def test_deepspeed_configs_leave_batch_sizes_to_the_trainer(path):
    config = json.loads(path.read_text())
    assert config["train_micro_batch_size_per_gpu"] == "auto" and config["gradient_accumulation_steps"] == "auto"
    offload = config["zero_optimization"].get("offload_param", {}).get("device")
    assert (offload == "cpu") == ("offload" in path.stem)


def dry_run(**env) -> list[str]:
    result = subprocess.run(
        ["./run_dapo.sh", "--max_steps", "3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "DRY_RUN": "1", **env},
        check=True,
    )
    return result.stdout.split()


def flag(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def test_run_dapo_defaults_are_the_papers():
    words = dry_run()
    expected = {
        "--epsilon": "0.2",
        "--epsilon_high": "0.28",
        "--num_generations": "16",
        "--max_completion_length": "20480",
        "--overlong_buffer_len": "4096",
        "--learning_rate": "1e-6",
        "--weight_decay": "0.1",
        "--max_filter_gen_batches": "10",
        "--filter_groups_enable": "true",
        "--loss_type": "dapo",
    }
    for name, value in expected.items():
        assert flag(words, name) == value
    assert words[-2:] == ["--max_steps", "3"]  # extra arguments come last and win
    assert flag(words, "--sequence_parallel_size") == "1" and "--max_tokens_per_microbatch" not in words
    words = dry_run(SEQUENCE_PARALLEL_SIZE="4", MAX_TOKENS_PER_MICROBATCH="18432")
    assert flag(words, "--sequence_parallel_size") == "4" and flag(words, "--max_tokens_per_microbatch") == "18432"


def test_run_dapo_multi_node_with_a_vllm_server():
    words = dry_run(
        NNODES="2",
        NODE_RANK="1",
        MASTER_ADDR="10.1.2.3",
        MASTER_PORT="29600",
        ACCELERATE_CONFIG="configs/accelerate/zero3_2nodes_16gpu.yaml",
        VLLM_SERVER_HOST="gen-node",
    )
    assert flag(words, "--config_file") == "configs/accelerate/zero3_2nodes_16gpu.yaml"
    assert (flag(words, "--num_machines"), flag(words, "--machine_rank")) == ("2", "1")
    assert (flag(words, "--main_process_ip"), flag(words, "--main_process_port")) == ("10.1.2.3", "29600")
    assert flag(words, "--rollout_streaming") == "false" and flag(words, "--rollout_max_staleness") == "0"
    assert "--vllm_importance_sampling_mode" not in words
    words = dry_run(
        VLLM_SERVER_HOST="gen-node",
        VLLM_WEIGHT_SYNC="shared_storage",
        VLLM_WEIGHT_SYNC_DIR="/shared/w",
        ROLLOUT_STREAMING="true",
        ROLLOUT_MAX_STALENESS="1",
        ROLLOUT_IN_FLIGHT_WEIGHT_UPDATES="true",
    )
    assert flag(words, "--rollout_in_flight_weight_updates") == "true"
    assert parsed_config(words).rollout_in_flight_weight_updates
    assert flag(words, "--vllm_weight_sync") == "shared_storage"
    assert flag(words, "--vllm_weight_sync_dir") == "/shared/w"
    assert flag(words, "--rollout_streaming") == "true" and flag(words, "--rollout_max_staleness") == "1"
    assert flag(words, "--vllm_importance_sampling_mode") == "token_truncate"
    assert flag(words, "--vllm_mode") == "server" and flag(words, "--vllm_server_host") == "gen-node"


def parsed_config(words: list[str]):
    """The DAPOConfig train_dapo.py would build from a dry run's command line."""
    from dapo_trl.cli import DAPOParser

    _, config, _ = DAPOParser().parse_args_and_config(args=words[words.index("train_dapo.py") + 1 :])
    return config


def test_run_dapo_clip_ratio_c_reaches_the_config():
    default = dry_run()
    assert flag(default, "--clip_ratio_c") == "None"  # off, as in the paper
    config = parsed_config(default)
    assert config.clip_ratio_c is None and config.delta is None
    config = parsed_config(dry_run(CLIP_RATIO_C="10.0"))  # verl's DAPO and ReTool recipes
    assert config.clip_ratio_c == 10.0 and config.delta == 10.0  # dual-clip is TRL's delta
    with pytest.raises(ValueError, match="clip_ratio_c=1.1 must be > 1 \\+ epsilon_high"):
        parsed_config(dry_run(CLIP_RATIO_C="1.1"))


def generation_line(**env) -> tuple[int, list[str], str]:
    """(exit status, the dry run's command, the line run_dapo.sh prints on stderr about generation)."""
    result = subprocess.run(
        ["./run_dapo.sh"], cwd=REPO, capture_output=True, text=True, env={**os.environ, "DRY_RUN": "1", **env}
    )
    return result.returncode, result.stdout.split(), result.stderr.strip()


def test_run_dapo_says_how_it_generates():
    """On a vLLM server with VLLM_SERVER_HOST, colocated vLLM with VLLM_MODE=colocate, else transformers' generate with
    a warning: one line on stderr says which (the dry run prints it too)."""
    status, words, said = generation_line()
    assert status == 0 and "--use_vllm" not in words
    assert said.startswith("run_dapo.sh: warning: generating with transformers' generate") and "slow" in said
    status, words, said = generation_line(VLLM_SERVER_HOST="gen-node", VLLM_SERVER_PORT="8100")
    assert said == "run_dapo.sh: generating on the vLLM server at http://gen-node:8100"
    assert flag(words, "--vllm_mode") == "server"
    status, words, said = generation_line(VLLM_MODE="colocate", VLLM_GPU_MEMORY_UTILIZATION="0.4")
    assert said.startswith("run_dapo.sh: generating with vLLM colocated on every training GPU")
    config = parsed_config(words)
    assert config.use_vllm and config.vllm_mode == "colocate" and config.vllm_gpu_memory_utilization == 0.4
    assert config.vllm_max_model_length == 2048 + 20480  # not the model's own maximum: the KV cache is a share
    for wrong in ({"VLLM_MODE": "server"}, {"VLLM_MODE": "colocated"}):  # no host; a misspelt mode
        status, words, said = generation_line(**wrong)
        assert status == 2 and not words and "VLLM_MODE" in said


def sbatch_training_command(tmp_path) -> list[str]:
    """The run_dapo.sh command examples/slurm_dapo.sbatch runs on training node 0, dry-run: the inner `bash -c "..."`
    with the sbatch's own defaults for what it passes on."""
    text = (REPO / "examples" / "slurm_dapo.sbatch").read_text()
    defaults = dict(re.findall(r'^(?:export )?([A-Z_]+)="\$\{\1:-([^}]*)\}"', text, flags=re.M))
    (inner,) = re.findall(r'bash -c "(.*?)" &', text, flags=re.S)
    values = {**defaults, "TRAIN_NODES[0]": "train-0", "VLLM_NODE": "gen-node", "SHARED_DIR": str(tmp_path)}
    values["RUN_NAME"] = "dapo-7b"
    inner = re.sub(r"(?<!\\)\$\{?([A-Z_]+(?:\[0\])?)\}?", lambda m: values[m.group(1)], inner).replace("\\$", "$")
    env = {**os.environ, "DRY_RUN": "1", "SLURM_NODEID": "0", "MODEL_PATH": defaults["MODEL_PATH"]}
    result = subprocess.run(["bash", "-c", inner], cwd=REPO, capture_output=True, text=True, env=env, check=True)
    return result.stdout.split()


def test_the_slurm_example_trains_the_7b_recipes_layout_on_its_nodes(tmp_path, monkeypatch):
    """examples/slurm_dapo.sbatch: 2 training nodes of 8 GPUs and a vLLM node; by default Qwen2.5-7B with the token
    budget and sequence parallelism of examples/qwen2.5-7b-2x8, the paper's batch on its 16 processes, a server of
    replicas that use the node's 8 GPUs, the grace period run_dapo.sh is given."""
    from dapo_trl import DAPOConfig
    from dapo_trl.cli import DAPOParser

    words = sbatch_training_command(tmp_path)
    accelerate = load_config_from_file(str(REPO / flag(words, "--config_file")))
    assert (accelerate.num_machines, accelerate.num_processes) == (2, 16)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(DAPOConfig, "world_size", property(lambda self: accelerate.num_processes))
    _, config, model = DAPOParser().parse_args_and_config(args=words[words.index("train_dapo.py") + 1 :])
    assert config.per_device_train_batch_size * 16 * config.gradient_accumulation_steps == 512
    assert config.generation_batch_size == 512 * 16 and config.num_generations == 16
    recipe = yaml.safe_load((REPO / "examples" / "qwen2.5-7b-2x8" / "recipe.yaml").read_text())
    assert model.model_name_or_path == recipe["model_name_or_path"]
    assert model.attn_implementation == recipe["attn_implementation"]
    assert config.max_tokens_per_microbatch == recipe["max_tokens_per_microbatch"]
    assert config.sequence_parallel_size == recipe["sequence_parallel_size"]
    assert config.vllm_mode == "server" and config.vllm_server_host == "gen-node"
    assert config.vllm_weight_sync == "shared_storage" and config.rollout_streaming
    text = (REPO / "examples" / "slurm_dapo.sbatch").read_text()
    assert re.search(r'TP="\$\{TP:-1\}"', text) and "DP=$((8 / TP))" in text  # 8 replicas of 1 GPU, as serve.sh
    assert config.preemption_grace_seconds == 480  # + torchrun's 60 s < the 600 s of --signal=B:USR1@600
