"""The DiT itself: its config and key layout (config, checkpoint), how it splits into NPU branches (partition, shards,
branch_layout), the host's share of a block (host_ops, rope), the FP32 torch reference forward (reference) and the
synthetic checkpoints (synth). Below every other part of models/ but the file formats."""
