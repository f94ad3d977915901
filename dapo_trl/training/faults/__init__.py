"""Fault handling and checkpoints: `checkpoints` (complete or never resumed from), and what `train()` runs inside:
`run_guard`, `preemption` (signals that save and stop), `fail_together` (one process's failure reaching all).
"""
