"""The bounds of a job's sampling settings: the one record every holder of them reads.

prompt.json and the page's form (protocol/prompt.py), an A1111 body (orchestrator/http/a1111.py), a ComfyUI graph's
sampler inputs as /object_info declares them (orchestrator/http/comfy_nodes.py), the wire's DenoiseParams and SamplingRef
(protocol/messages.py) and a pack's recorded settings (models/records/manifest.py). docs/prompts.md "Bounds" lists them.
ComfyUI's own KSampler declares wider ones (steps 1..10000, cfg 0..100); a graph past ours is refused with ComfyUI's
node_errors for the bounds our /object_info declares, as ComfyUI refuses a value past its own.
"""
from typing import NamedTuple

from models.base.schema import Float, Int


class Bound(NamedTuple):
    lo: float
    hi: float


STEPS = Bound(1, 200)          # a sampling pass's steps (the hires pass's own included)
CFG = Bound(1.0, 30.0)         # the CFG scale; 1 runs no unconditional pass (ComfyUI's rule)

Steps = Int(STEPS.lo, STEPS.hi)
Cfg = Float(CFG.lo, CFG.hi)
