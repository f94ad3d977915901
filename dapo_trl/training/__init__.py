"""The machinery of one DAPO training step, used by `dapo_trl.trainer.DAPOTrainer` only.

- `trl_seam`: every private GRPOTrainer method and attribute the project relies on, checked against the installed
  TRL when a DAPOTrainer is built, and the helpers through which the other modules reach them;
- `sampling`, `streams`, `advantages`: dynamic sampling (the sampler and its checkpoint state, the fresh-prompt
  streams, batch-level advantages over an assembled batch);
- `shaping`, `overlong`, `kl_in_reward`, `reference`: built-in reward columns added after the user's rewards (the soft
  overlong penalty, KL in the reward) and the reference model KL in the reward needs;
- `batching`, `packing`, `steps`: micro-batch shaping (balance, token budget), padding-free forwards, and each
  optimizer step's micro-batches with their exact token denominator;
- `evaluation`: `DAPOTrainer.evaluate` (TRL's evaluation plus avg@n / pass@k);
- `vllm_backends`: TRL's vLLM backend as we patch it (server timeouts, shared-storage weight sync, CPU colocate,
  waiting for a restarted server);
- `checkpoints`, `run_guard`, `preemption`, `fail_together`: checkpoints that are complete or never resumed from, and
  what `train()` runs inside (preemption signals, Ctrl-C, one process's failure reaching every process).

Imports run one way: the trainer imports these, these import `dapo_trl.algorithm`, `dapo_trl.validation` and
`dapo_trl.utils`, never the trainer.
"""
