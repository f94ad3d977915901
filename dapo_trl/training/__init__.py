"""The machinery of one DAPO training step, used by `dapo_trl.trainer.DAPOTrainer` only, by concern:

- `trl_seam`: every private GRPOTrainer method and attribute the project relies on, checked against the installed
  TRL when a DAPOTrainer is built, and the helpers through which the other modules reach them;
- `sampling/`: dynamic sampling, the prompt streams, batch-level advantages, the reward columns added after the
  user's rewards (overlong penalty, KL in the reward) and evaluation;
- `step/`: micro-batch shaping (balance, token budget), each optimizer step's micro-batches with their exact token
  denominator, the training forwards (padded, padding-free, sequence-parallel, routing replay) and the loss step;
- `rollout/`: the streaming rollout and its engines (the driver, the vLLM server's and colocated vLLM's clients, the
  progress watchdog) and TRL's vLLM backend as we patch it;
- `faults/`: checkpoints that are complete or never resumed from, and what `train()` runs inside (preemption
  signals, Ctrl-C, one process's failure reaching every process).

Imports run one way: the trainer imports these, these import `dapo_trl.algorithm`, `dapo_trl.validation` and
`dapo_trl.utils`, never the trainer.
"""
