"""Sampling and scoring: dynamic sampling and the columns a scored batch carries.

- `dynamic_sampling` (the prompt stream, carried groups, keep / fill / carry decisions), `streams` (the seeded,
  resumable prompt stream), `advantages` (batch-level advantages over the final batch);
- `round_scoring` (what a scored round hands between the trainer's overrides), `batch_metrics` (the step metrics over
  the groups decided for the batch);
- reward columns the user's list never shows: `shaping`, `overlong` (Eq. 13), `kl_in_reward`, `reference` (KL in the
  reward's reference model);
- `evaluation` (`evaluate()`: TRL's evaluation plus avg@n / pass@k).
"""
