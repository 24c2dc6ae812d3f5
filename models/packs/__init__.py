"""Packs: a DiT checkpoint made into fixed-shape branch graphs for the NPU (pack, branch_graphs), the sharded form
(sharded) and the scratch region the scheduler hands the executor (scratch). Manifests are read by models.records.manifest."""
