"""Forwards, batching and the loss step.

- `batching` (micro-batches balanced by tokens, split under a token budget), `steps` (which micro-batches an optimizer
  step trains, their exact token count, the generation batch a checkpoint falls inside, skipping empty steps);
- `policy_loss` (the loss of a forward, through the loss table), `forwards` (every training forward: padded, packed
  or sharded), `packing` (padding-free forwards), `sequence_parallel` (Ulysses: forwards shared by a group of
  processes), `replayed_routing` (routing replay: which routing each forward replays, the rows' routing tensors).
"""
