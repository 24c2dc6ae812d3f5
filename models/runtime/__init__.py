"""Running a pack: the backends (ONNX Runtime, RKNN, the simulator and the board-paced stand-in), each branch's
lifecycle and its phase times, the DiT runner the scheduler and `anima-models forward` drive, what Linux says about
memory and the NPU (probes), and numeric verification of a pack against the reference (verify)."""
