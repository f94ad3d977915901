"""The cluster recipes (examples/<model>-<nodes>x<gpus>/, docs/cluster-recipes.md) hold together without a GPU: each
recipe.yaml parses through train_dapo.py's own parser as DAPOConfig builds it on the training processes its
accelerate.yaml names, with the paper's batch on that count; the accelerate config and the vLLM server script split
the folder's nodes between trainer and server; the weight sync the recipe asks for is the one its server is started
for and one its model may use; every shell script parses and every repository path a script names exists."""

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from dapo_trl.cli import DAPOParser
from dapo_trl.config import DAPOConfig
from dapo_trl.training.rollout.vllm_backends import check_moe_weight_sync

from .helpers import REPO

EXAMPLES = REPO / "examples"
RECIPES = sorted(path.parent for path in EXAMPLES.glob("*/recipe.yaml"))
SCRIPTS = sorted([*EXAMPLES.rglob("*.sh"), *EXAMPLES.rglob("*.sbatch")])
# The paper's batch (docs/algorithm.md, run_dapo.sh): 512 prompts x 16 responses a rollout, 16 updates of 512.
PROMPTS, RESPONSES, UPDATES, MAX_RESPONSE, OVERLONG_BUFFER = 512, 16, 16, 20480, 4096


def layout(folder: Path) -> tuple[int, int]:
    """(nodes, GPUs per node) the folder's name promises: qwen2.5-7b-2x8 -> (2, 8)."""
    match = re.search(r"-(\d+)x(\d+)$", folder.name)
    assert match, f"{folder.name}: an example folder is named <model>-<nodes>x<gpus per node>"
    return int(match.group(1)), int(match.group(2))


def parse_recipe(folder: Path, tmp_path: Path, monkeypatch, processes: int, *flags: str):
    """(script, DAPOConfig, model) as train_dapo.py builds them on each of `processes` training processes: TRL's
    GRPOConfig derives and checks its batch from the process count when the config is constructed."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(DAPOConfig, "world_size", property(lambda self: processes))
    words = ["--config", str(folder / "recipe.yaml"), "--output_dir", str(tmp_path), *flags]
    return DAPOParser().parse_args_and_config(args=words)


def batch_layout(config: DAPOConfig, processes: int) -> dict[str, int]:
    per_update = config.per_device_train_batch_size * processes * config.gradient_accumulation_steps
    return {
        "prompts per rollout": config.generation_batch_size // config.num_generations,
        "responses per prompt": config.num_generations,
        "responses per update": per_update,
        "updates per rollout": config.generation_batch_size // per_update,
    }


PAPER = {
    "prompts per rollout": PROMPTS,
    "responses per prompt": RESPONSES,
    "responses per update": PROMPTS * RESPONSES // UPDATES,
    "updates per rollout": UPDATES,
}


def server_settings(folder: Path) -> dict[str, str]:
    """The variables serve.sh exports for scripts/start_vllm_server.sh (TP, DP, WEIGHT_SYNC, ...)."""
    text = (folder / "serve.sh").read_text()
    settings = {}
    for line in re.findall(r"^export (.*)$", text, flags=re.M):
        for name, value in re.findall(r"\b([A-Z_]+)=(\"[^\"]*\"|\S+)", line.split("#")[0]):
            settings[name] = value
    return settings


def trainer_processes(folder: Path) -> int:
    return load_config_from_file(str(folder / "accelerate.yaml")).num_processes


def is_moe(model_name: str) -> bool:
    """The recipes' mixture-of-experts models, by their names (Qwen3-30B-A3B: 3B active parameters); no download."""
    return re.search(r"-A\d+B", model_name) is not None


def test_the_three_recipes_of_the_guide_are_there():
    assert {folder.name for folder in RECIPES} >= {"qwen2.5-7b-2x8", "qwen2.5-32b-16x8", "qwen3-30b-a3b-3x8"}
    for folder in RECIPES:
        assert {"recipe.yaml", "accelerate.yaml", "serve.sh", "train.sh"} <= {p.name for p in folder.iterdir()}


@pytest.mark.parametrize("folder", RECIPES, ids=lambda p: p.name)
def test_accelerate_config_and_server_split_the_nodes(folder):
    nodes, gpus = layout(folder)
    config = load_config_from_file(str(folder / "accelerate.yaml"))
    raw = yaml.safe_load((folder / "accelerate.yaml").read_text())
    assert config.distributed_type == "DEEPSPEED"
    deepspeed = REPO / raw["deepspeed_config"]["deepspeed_config_file"]
    assert deepspeed.is_file(), f"{folder.name}/accelerate.yaml names {deepspeed}, which does not exist"
    assert yaml.safe_load(deepspeed.read_text())["zero_optimization"]["stage"] == 3
    assert config.num_processes == config.num_machines * gpus, "one training process per GPU of the training nodes"
    server_nodes = nodes - config.num_machines
    assert server_nodes >= 1, f"{folder.name}: no node left for the vLLM server"
    server = server_settings(folder)
    assert int(server["TP"]) * int(server["DP"]) == server_nodes * gpus, "the server uses every GPU of its nodes"
    assert int(server["TP"]) <= gpus, "a replica's tensor parallel group stays inside a node"
    assert server["MAX_MODEL_LEN"] == str(2048 + MAX_RESPONSE)
    if server_nodes > 1:  # one endpoint over several nodes: vLLM's multi-node data parallelism
        local = re.search(r"--data-parallel-size-local (\d+)", (folder / "serve.sh").read_text())
        assert local and int(local.group(1)) * server_nodes == int(server["DP"])


@pytest.mark.parametrize("folder", RECIPES, ids=lambda p: p.name)
def test_a_moe_server_spreads_its_experts_over_every_gpu(folder):
    """vLLM runs a MoE model's expert layers as one group over the server's DP x TP GPUs (docs/cluster-recipes.md):
    the MoE recipe makes it expert parallel (--enable-expert-parallel, passed on to `vllm serve`); a dense model has
    no experts to split."""
    model = yaml.safe_load((folder / "recipe.yaml").read_text())["model_name_or_path"]
    (command,) = re.findall(r"^exec scripts/start_vllm_server\.sh .*$", (folder / "serve.sh").read_text(), flags=re.M)
    assert ("--enable-expert-parallel" in command.split()) == is_moe(model)


@pytest.mark.parametrize("folder", RECIPES, ids=lambda p: p.name)
def test_recipe_parses_with_the_papers_batch_on_its_processes(folder, tmp_path, monkeypatch):
    processes = trainer_processes(folder)
    script, config, model = parse_recipe(folder, tmp_path, monkeypatch, processes)
    assert config.world_size == processes and config.output_dir == str(tmp_path)
    assert batch_layout(config, processes) == PAPER
    assert (config.max_completion_length, config.overlong_buffer_len) == (MAX_RESPONSE, OVERLONG_BUFFER)
    assert config.loss_type == "dapo" and (config.epsilon, config.epsilon_high) == (0.2, 0.28)
    assert config.filter_groups_enable and config.beta == 0.0
    _, gpus = layout(folder)
    size = config.sequence_parallel_size
    assert processes % size == 0 and gpus % size == 0, "a Ulysses group divides the processes and stays in a node"
    assert config.use_vllm and config.vllm_mode == "server" and config.rollout_streaming
    assert config.vllm_server_recovery_timeout < config.ddp_timeout  # docs/reliability.md
    # Every key of the recipe reaches its field (a misspelt key would be refused, a shadowed one would not).
    for key, value in yaml.safe_load((folder / "recipe.yaml").read_text()).items():
        if key == "output_dir":
            continue
        (owner,) = [arguments for arguments in (script, config, model) if hasattr(arguments, key)]
        assert getattr(owner, key) in (value, [value]), key


def test_the_batch_check_notices_the_wrong_process_count(tmp_path, monkeypatch):
    folder = EXAMPLES / "qwen2.5-7b-2x8"
    _, config, _ = parse_recipe(folder, tmp_path, monkeypatch, 2 * trainer_processes(folder))
    assert batch_layout(config, 2 * trainer_processes(folder)) != PAPER  # twice the prompts per rollout


@pytest.mark.parametrize("folder", RECIPES, ids=lambda p: p.name)
def test_weight_sync_matches_the_server_and_the_model(folder, tmp_path, monkeypatch):
    """The table of docs/cluster-recipes.md, for each recipe: its sync is the one its server is started for; a MoE
    policy syncs over NCCL only, and overlaps (k >= 1) only with in-flight weight updates, routing replay included;
    a dense one overlaps at k = 1."""
    processes = trainer_processes(folder)
    _, config, model = parse_recipe(folder, tmp_path, monkeypatch, processes)
    assert server_settings(folder)["WEIGHT_SYNC"] == config.vllm_weight_sync
    moe = is_moe(model.model_name_or_path)
    check_moe_weight_sync(config, moe)  # what DAPOTrainer refuses at start-up
    if moe:
        assert config.vllm_weight_sync == "nccl" and config.rollout_max_staleness == 0
        _, shared, _ = parse_recipe(folder, tmp_path, monkeypatch, processes, "--vllm_weight_sync", "shared_storage")
        with pytest.raises(ValueError, match="cannot sync a mixture-of-experts policy"):
            check_moe_weight_sync(shared, moe)
        with pytest.raises(ValueError, match="over NCCL needs --rollout_in_flight_weight_updates true"):
            parse_recipe(folder, tmp_path, monkeypatch, processes, "--rollout_max_staleness", "1")
        overlap = ("--rollout_max_staleness", "1", "--rollout_in_flight_weight_updates", "true")
        _, overlapped, _ = parse_recipe(folder, tmp_path, monkeypatch, processes, *overlap)  # MoE overlaps over NCCL
        check_moe_weight_sync(overlapped, moe)
        replay = ("--routing_replay", "true")
        _, replaying, _ = parse_recipe(folder, tmp_path, monkeypatch, processes, *overlap, *replay)  # and R3
        assert replaying.routing_replay and replaying.rollout_in_flight_weight_updates
    else:
        assert config.vllm_weight_sync == "shared_storage" and config.rollout_max_staleness == 1
        assert config.vllm_importance_sampling_mode == "token_truncate"
        assert config.vllm_importance_sampling_clip_max == 2.0


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# A repository path as the scripts write one: examples/..., scripts/..., configs/..., docs/... or a top-level script,
# not part of a longer path (/shared/examples/x) or a variable's value ($SHARED_DIR/vllm_weights).
REPO_PATH = re.compile(r"(?<![\w/.$-])((?:examples|scripts|configs|docs)/[\w.+/-]*[\w+]|train_dapo\.py|run_dapo\.sh)")


def missing_paths(text: str) -> list[str]:
    """The repository paths `text` names that do not exist; `$here` is the script's own `here=` folder."""
    here = re.search(r"^here=(\S+)$", text, flags=re.M)
    if here:
        text = text.replace("$here", here.group(1))
    return sorted({path for path in REPO_PATH.findall(text) if not (REPO / path).exists()})


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_every_path_a_script_names_exists(script):
    assert missing_paths(script.read_text()) == []


def test_the_path_check_finds_a_missing_path():
    text = "here=examples/qwen2.5-7b-2x8\nexec scripts/start_vllm_server.sh\n$here/recipe.yaml $here/nope.yaml\n"
    assert missing_paths(text) == ["examples/qwen2.5-7b-2x8/nope.yaml"]
    assert missing_paths("see docs/reliability.md#preemption and /shared/examples/x") == []


def test_the_guide_links_every_recipe_and_names_its_first_commands():
    guide = (REPO / "docs" / "cluster-recipes.md").read_text()
    for folder in RECIPES:
        assert f"](../examples/{folder.name}/)" in guide, f"docs/cluster-recipes.md does not link {folder.name}"
        assert f"examples/{folder.name}/serve.sh" in guide and f"examples/{folder.name}/train.sh" in guide


def guide_batch_table() -> dict[str, dict[str, str]]:
    """docs/cluster-recipes.md's batch table, by recipe folder: {column: value}."""
    guide = (REPO / "docs" / "cluster-recipes.md").read_text()
    header = next(line for line in guide.splitlines() if line.startswith("| recipe | P |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    rows = {}
    for line in guide[guide.index(header) :].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = dict(zip(columns, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
        shape = re.search(r"(\d+) x (\d+)$", cells["recipe"])
        (folder,) = [f for f in RECIPES if f.name.endswith(f"-{shape.group(1)}x{shape.group(2)}")]
        rows[folder.name] = cells
    return rows


def test_the_guides_batch_table_is_the_recipes():
    """Each row of docs/cluster-recipes.md's batch table: P is the accelerate config's processes, every other column
    the recipe's own value."""
    table = guide_batch_table()
    assert set(table) == {folder.name for folder in RECIPES}
    for folder in RECIPES:
        recipe = yaml.safe_load((folder / "recipe.yaml").read_text())
        row = table[folder.name]
        assert int(row["P"]) == trainer_processes(folder), folder.name
        for column, value in row.items():
            if column not in ("recipe", "P"):
                assert recipe[column] == int(value), f"{folder.name}: the guide says {column} {value}"


BATCH_KEYS = ("num_generations", "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation")


@pytest.mark.parametrize("folder", RECIPES, ids=lambda p: p.name)
def test_the_numbers_a_recipe_comment_names_are_its_own(folder):
    """`per_device_train_batch_size 16 x 8 processes x gradient_accumulation_steps 4 = 512` in a recipe's comments:
    each batch `key N` is the recipe's value of key, each `N processes` its accelerate config's process count (the
    products themselves: tests/test_launch_lines.py)."""
    text = (folder / "recipe.yaml").read_text()
    recipe = yaml.safe_load(text)
    comments = "\n".join(re.findall(r"#(.*)$", text, flags=re.M))
    named = re.findall(r"\b([a-z_]+) (\d+)\b", comments)
    checked = [(key, int(value)) for key, value in named if key in BATCH_KEYS]
    assert len(checked) >= 3, f"{folder.name}: its comments name no batch values"
    assert [(key, recipe[key]) for key, _ in checked] == checked
    processes = {int(count) for count in re.findall(r"\b(\d+) (?:training )?processes\b", comments)}
    assert processes == {trainer_processes(folder)}


SBATCH = sorted(EXAMPLES.rglob("*.sbatch"))


@pytest.mark.parametrize("script", SBATCH, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_the_preemption_grace_leaves_time_to_requeue(script):
    """SLURM signals `@lead` seconds before the time limit; the training processes then have the grace period, and
    torchrun 60 s more (TORCH_ELASTIC_SHUTDOWN_TIMEOUT = grace + 60 in run_dapo.sh and train.sh) before it kills
    them: that must end before the limit, with time left for the exit and `scontrol requeue`."""
    text = script.read_text()
    (lead,) = re.findall(r"^#SBATCH --signal=B:USR1@(\d+)$", text, flags=re.M)
    (grace,) = set(re.findall(r"PREEMPTION_GRACE_SECONDS=(\d+)", text))  # the header says the same value
    assert int(grace) + 60 + 30 <= int(lead), f"grace {grace} s + torchrun's 60 s leaves under 30 s of {lead} s"
