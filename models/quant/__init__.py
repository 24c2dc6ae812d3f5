"""INT8 (W8A8) packs: calibration of branch inputs, SmoothQuant factors folded into the host modulation, and the
simulator check (docs/quant.md)."""
