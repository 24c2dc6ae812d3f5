"""rknn-toolkit2 integration: compile packs to .rknn, through a worker subprocess in the toolkit's own environment
(the `rknn-sim` backend that runs branches in its simulator is models/runtime/backends/rknn_sim.py)."""
