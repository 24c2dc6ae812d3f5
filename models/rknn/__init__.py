"""rknn-toolkit2 integration: compile packs to .rknn and verify them in the simulator, all through a worker subprocess."""
