"""Reading a verl run and translating it into a dapo-trl recipe (`python -m dapo_trl.from_verl`, the command line).

Reading (a verl script or YAML as `{dotted key: value}`): `reader.read_verl_input`, over `script` (the verl command
of a shell script), `shell_words` and `shell_expansion` (the shell subset such scripts use), `yaml_config` (a verl
YAML config) and `hydra` (`VerlInput`, Hydra values and `${...}` interpolations).

Translating: `translate.translate` fills a `translation.Translation`, one module per concern: `model_data`,
`batches`, `losses` (and KL in the reward), `reward` (and dynamic sampling), `schedule`, `rollout` (and tools),
`rollout_correction` (verl's `algorithm.rollout_correction`), `trainer_keys` (and the accelerate config); the
one-to-one and nothing-to-translate keys are tables in `translate`.
Writing: `outputs.write_outputs` (recipe.yaml, report.md, vllm_server.sh, accelerate.yaml).
"""
