"""LoRA for Anima: reading LoRA files in every layout they come in, mapping their module names onto the models' own
layers, and applying them (merged into FP32 weights, or as the low-rank inputs of a LoRA-ready pack's branch
graphs). docs/lora.md describes the whole path.

    file     LoraFile, LoraPair, LoraError: one file as stored (pairs, layouts, alpha), checked for structure
    targets  TargetTable: name -> layer (DiT, LLM adapter, Qwen3) from the models' key lists; where each computes
    plan     LoraUse, plan_loras -> LoraPlan: merged weights, stacked factors (rank R, SVD reduction), the report
    lycoris  LoKr / LoHa: header checks, ΔW as ComfyUI's weight adapters form it, its exact low-rank form
    synth    write_lora: synthetic LoRAs with real key names
"""
from models.lora.file import LoraError, LoraFile, LoraPair
from models.lora.plan import LoraPlan, LoraUse, parse_lora_arg, plan_loras, plan_text_loras, reduce_rank
from models.lora.targets import PLACES, Target, TargetTable

__all__ = ["LoraError", "LoraFile", "LoraPair", "LoraPlan", "LoraUse", "PLACES", "Target", "TargetTable",
           "parse_lora_arg", "plan_loras", "reduce_rank"]
