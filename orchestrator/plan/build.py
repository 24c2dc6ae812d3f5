"""prompt.json's record (a PromptSpec) -> its plan: one pure function, the job's shape (img2img, batch, the hires fix
in latent or pixel space, the second pass's own prompts) written as steps (orchestrator.plan.steps)."""
from __future__ import annotations

from models.sampling.denoise import STATE_FILE
from orchestrator.job_files import (COND_FILE, ENTRIES_FILE, HIRES_COND_FILE, HIRES_TEXT_FILE, HIRES_UNCOND_FILE, INIT_IMAGE_FILE,
                                    INIT_LATENT_FILE, MASK_FILE, TEXT_FILE, UNCOND_FILE, batch_name)
from orchestrator.plan.steps import (Decode, Deliver, Denoise, EncodeImage, EncodeText, HiresDenoise, PixelStart,
                                     Plan, Step)
from protocol.prompt import CondEntry, PromptSpec

CONTEXTS = (TEXT_FILE, COND_FILE, UNCOND_FILE)
HIRES_CONTEXTS = (HIRES_TEXT_FILE, HIRES_COND_FILE, HIRES_UNCOND_FILE)


def hires_texts(spec: PromptSpec) -> tuple[str, str] | None:
    """A job's second pass's (prompt, negative) when it has its own (hires.prompt / negative_prompt), else None."""
    h = spec.hires
    if h is None:
        return None
    texts = (spec.prompt if h.prompt is None else h.prompt,
             spec.negative_prompt if h.negative_prompt is None else h.negative_prompt)
    return None if texts == (spec.prompt, spec.negative_prompt) else texts


def cond_sides(spec: PromptSpec) -> tuple[tuple[CondEntry, ...], tuple[CondEntry, ...]] | None:
    """(positive, negative) entries of a job that has any (a side left out is its plain prompt at strength 1; at
    cfg 1 no negative, as nothing reads it), else None."""
    if spec.positive is None and spec.negative is None:
        return None
    pos = spec.positive or (CondEntry(text=spec.prompt),)
    neg = () if spec.negative_ignored() else spec.negative or (CondEntry(text=spec.negative_prompt),)
    return pos, neg


def entry_texts(spec: PromptSpec) -> tuple[str, ...]:
    """The distinct texts of a job's entries, positive first, in order: each encoded once (cond_entry_K.npy)."""
    sides = cond_sides(spec)
    return () if sides is None else tuple(dict.fromkeys(e.text for e in sides[0] + sides[1]))


def entry_file(k: int) -> str:
    return batch_name("cond_entry", ".npy", k)


def _contexts(spec: PromptSpec) -> tuple[str, ...]:
    texts = entry_texts(spec)
    return CONTEXTS if not texts else (*(entry_file(k) for k in range(len(texts))), ENTRIES_FILE)


def latent_file(pos: int) -> str:
    return batch_name("latent", ".npy", pos)


def final_latent_file(spec: PromptSpec, pos: int) -> str:
    """Image `pos`'s latent to decode: its second pass's with a hires fix, else its first pass's."""
    return batch_name("latent" if spec.hires is None else "hires_latent", ".npy", pos)


def _state(folder: str, pos: int) -> str:
    """Where the scheduler keeps image `pos`'s per-step state: the job folder (or `folder`), batch_N/ or hires_N/."""
    where = batch_name(folder, "", pos) if folder or pos else ""
    return f"{where}/{STATE_FILE}" if where else STATE_FILE


def _encode_steps(spec: PromptSpec) -> list[Step]:
    steps: list[Step] = [EncodeText(entries=bool(entry_texts(spec)), outputs=_contexts(spec))]
    if hires_texts(spec) is not None:
        steps.append(EncodeText(hires=True, outputs=HIRES_CONTEXTS))
    if spec.init_image is not None:
        grey = (MASK_FILE,) if spec.grow_mask_by is not None else ()      # VAEEncodeForInpaint greys under it
        steps.append(EncodeImage(inputs=(INIT_IMAGE_FILE, *grey), outputs=(INIT_LATENT_FILE,)))
    return steps


def _first_pass(spec: PromptSpec, pos: int) -> Step:
    start = () if spec.init_image is None else (INIT_LATENT_FILE, *((MASK_FILE,) if spec.mask is not None else ()))
    return Denoise(pos, inputs=_contexts(spec) + start, outputs=(latent_file(pos),),
                   scratch=(_state("batch" if pos else "", pos),))


def _hires_steps(spec: PromptSpec) -> list[Step]:
    """The second pass of each image: the pixel path's starts first (one VAE session for the batch), then the
    denoises (the job's contexts, or the second pass's own)."""
    contexts = CONTEXTS if hires_texts(spec) is None else HIRES_CONTEXTS
    pixel = spec.hires.space == "pixel"
    starts = [PixelStart(pos, inputs=(latent_file(pos),), outputs=(batch_name("hires_init", ".npy", pos),),
                         scratch=(batch_name("first", ".png", pos),)) for pos in range(spec.batch)] if pixel else []
    passes = [HiresDenoise(pos, inputs=(*contexts, latent_file(pos),
                                        *((batch_name("hires_init", ".npy", pos),) if pixel else ())),
                           outputs=(final_latent_file(spec, pos),), scratch=(_state("hires", pos),))
              for pos in range(spec.batch)]
    return starts + passes


def build_plan(spec: PromptSpec) -> Plan:
    """The steps of a job, in an order that runs them: its contexts (and init latent), each image's first pass, the
    hires fix's second pass, each image decoded, then all delivered."""
    steps = _encode_steps(spec) + [_first_pass(spec, pos) for pos in range(spec.batch)]
    if spec.hires is not None:
        steps += _hires_steps(spec)
    images = tuple(batch_name("image", ".png", pos) for pos in range(spec.batch))
    steps += [Decode(pos, inputs=(final_latent_file(spec, pos),), outputs=(images[pos],)) for pos in range(spec.batch)]
    steps.append(Deliver(inputs=images))
    return Plan(tuple(steps))
