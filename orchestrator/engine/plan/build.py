"""prompt.json's record (a PromptSpec) -> its plan: one pure function, the job's shape (img2img, batch, the hires fix
in latent or pixel space, the second pass's own prompts) written as steps (orchestrator.engine.plan.steps)."""
from __future__ import annotations

from models.dit.partition import TEXT_TOKENS
from models.sampling.denoise import STATE_FILE
from orchestrator.engine.job_files import (COND_FILE, ENTRIES_FILE, HIRES_COND_FILE, HIRES_TEXT_FILE, HIRES_UNCOND_FILE, INIT_IMAGE_FILE,
                                    INIT_ENCODED_FILE, INIT_LATENT_FILE, MASK_FILE, MIX_ENCODED_FILE, MIX_IMAGE_FILE,
                                    MIXED_LATENT_FILE, REPORT_FILE, TEXT_FILE, TIMING_FILE,
                                    UNCOND_FILE, batch_name)
from orchestrator.engine.plan.steps import (CropImage, Decode, Deliver, Denoise, EncodeImage, EncodeText, HiresDenoise,
                                     MixLatent, MixStart, PixelStart, Plan, Report, Step)
from protocol.prompt import CondEntry, PromptSpec, mixes

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


def cond_entries(spec: PromptSpec) -> tuple:
    """(positive, negative) conditioning entries of the first pass that are not plain text (ConditioningZeroOut,
    ConditioningAverage: protocol.prompt.CondEntry), None for a plain one."""
    return tuple(None if e.plain else e for e in (spec.cond("positive"), spec.cond("negative")))


def hires_entries(spec: PromptSpec) -> tuple:
    """The second pass's (positive, negative) entries when it has prompts of its own: its own text is plain, the side
    it shares with the first pass keeps the first's entry (the same conditioning node in a ComfyUI graph)."""
    h, first = spec.hires, cond_entries(spec)
    return (None if h.prompt is not None else first[0], None if h.negative_prompt is not None else first[1])


def cond_sides(spec: PromptSpec) -> tuple[tuple[CondEntry, ...], tuple[CondEntry, ...]] | None:
    """(positive, negative) entries of a job that has any (a side left out is its plain prompt at strength 1; at
    cfg 1 no negative, as nothing reads it), else None."""
    if not (mixes(spec.positive) or mixes(spec.negative)):
        return None
    pos = spec.positive or (CondEntry(text=spec.prompt),)
    neg = () if spec.negative_ignored() else spec.negative or (CondEntry(text=spec.negative_prompt),)
    return pos, neg


def conditioning_of(entry: CondEntry) -> CondEntry:
    """What an entry's context is made of (its text, zero_out, average), without how the sampler uses it (strength,
    window): entries alike in it share one encoding."""
    return CondEntry(text=entry.text, zero_out=entry.zero_out, average=entry.average)


def entry_conds(spec: PromptSpec) -> tuple[CondEntry, ...]:
    """The distinct conditionings of a job's entries (conditioning_of), positive first, in order: each encoded once
    (cond_entry_K.npy)."""
    sides = cond_sides(spec)
    return () if sides is None else tuple(dict.fromkeys(conditioning_of(e) for e in sides[0] + sides[1]))


def entry_texts(spec: PromptSpec) -> tuple[str, ...]:
    """The texts of entry_conds, in its order (a text zeroed out or averaged in one entry and plain in another is
    there twice)."""
    return tuple(c.text for c in entry_conds(spec))


def entries_pack_refusal(spec: PromptSpec, packs: dict) -> tuple[str, str] | None:
    """(field, why) when a job's entries would run on a long-context pack (more than TEXT_TOKENS text rows), else
    None: such a pack masks each pass's context rows by its prompt pair's token counts, which the scheduler takes for
    the cond and uncond passes only, not per entry. `packs`: {(width, height): pack}; `spec` has its size."""
    sides = cond_sides(spec)
    if sides is None:
        return None
    sizes = [(spec.width, spec.height)] + ([spec.hires.size(spec.width, spec.height)] if spec.hires else [])
    for w, h in sizes:
        pack = packs.get((w, h))
        if pack is not None and pack.text_tokens > TEXT_TOKENS:
            side = "positive" if mixes(spec.positive) else "negative"
            return side, (f"several conditionings (positive / negative entries that each take a model pass) need a "
                          f"pack of {TEXT_TOKENS} text rows; the {w}x{h} pack has {pack.text_tokens} (a long-context "
                          f"pack masks each pass's context by the cond / uncond prompt's token count, not per entry)")
    return None


def entry_pair(conditioning: CondEntry) -> tuple:
    """The (positive, negative) entries of the ENCODE that makes one conditioning of entry_conds (its text as the
    prompt, an empty negative): (None, None) for a plain text."""
    return (None if conditioning.plain else conditioning, None)


def entry_file(k: int) -> str:
    return batch_name("cond_entry", ".npy", k)


def _contexts(spec: PromptSpec) -> tuple[str, ...]:
    texts = entry_conds(spec)
    return CONTEXTS if not texts else (*(entry_file(k) for k in range(len(texts))), ENTRIES_FILE)


def latent_file(pos: int) -> str:
    return batch_name("latent", ".npy", pos)


def final_latent_file(spec: PromptSpec, pos: int) -> str:
    """Image `pos`'s latent to decode: its second pass's with a hires fix, else its first pass's."""
    return batch_name("latent" if spec.hires is None else "hires_latent", ".npy", pos)


def mixed_latent_file(pos: int) -> str:
    return batch_name(MIXED_LATENT_FILE.removesuffix(".npy"), ".npy", pos)


def second_start_file(spec: PromptSpec, pos: int) -> str:
    """Image `pos`'s latent a latent-space second pass starts from: the mixed one with latent_mix, else its first."""
    return latent_file(pos) if spec.latent_mix is None else mixed_latent_file(pos)


def decoded_latent_file(spec: PromptSpec, pos: int) -> str:
    """Image `pos`'s latent its Decode reads: without a second pass, the mixed one with latent_mix; else the final
    pass's."""
    if spec.latent_mix is not None and spec.hires is None:
        return mixed_latent_file(pos)
    return final_latent_file(spec, pos)


def _state(folder: str, pos: int) -> str:
    """Where the scheduler keeps image `pos`'s per-step state: the job folder (or `folder`), batch_N/ or hires_N/."""
    where = batch_name(folder, "", pos) if folder or pos else ""
    return f"{where}/{STATE_FILE}" if where else STATE_FILE


def _encode_steps(spec: PromptSpec) -> list[Step]:
    texts = entry_conds(spec)
    steps: list[Step] = [EncodeText(mixed=True, outputs=_contexts(spec)) if texts else
                         EncodeText(outputs=CONTEXTS, entries=cond_entries(spec))]
    if hires_texts(spec) is not None:
        steps.append(EncodeText(hires=True, outputs=HIRES_CONTEXTS, entries=hires_entries(spec)))
    if spec.init_image is not None:
        grey = (MASK_FILE,) if spec.grow_mask_by is not None else ()      # VAEEncodeForInpaint greys under it
        encoded = INIT_LATENT_FILE if spec.init_mix is None else INIT_ENCODED_FILE
        steps.append(EncodeImage(inputs=(INIT_IMAGE_FILE, *grey), outputs=(encoded,)))
    if spec.init_mix is not None:                  # both encodes in one VAE session, then the daemon's numpy
        steps += [EncodeImage(inputs=(MIX_IMAGE_FILE,), outputs=(MIX_ENCODED_FILE,), mix=True),
                  MixStart(inputs=(INIT_ENCODED_FILE, MIX_ENCODED_FILE), outputs=(INIT_LATENT_FILE,))]
    return steps


def _first_pass(spec: PromptSpec, pos: int) -> Step:
    start = () if spec.init_image is None else (INIT_LATENT_FILE, *((MASK_FILE,) if spec.mask is not None else ()))
    return Denoise(pos, inputs=_contexts(spec) + start, outputs=(latent_file(pos),),
                   scratch=(_state("batch" if pos else "", pos),))


def base_image_file(pos: int) -> str:
    return batch_name("base", ".png", pos)


def _pixel_start(spec: PromptSpec, pos: int) -> PixelStart:
    """Image `pos`'s pixel path: its first image decoded is scratch (first.png), or with hires.keep_base the
    delivered base.png itself (the pixels ComfyUI's SaveImage writes from the same VAEDecode)."""
    first = base_image_file(pos) if spec.hires.keep_base else batch_name("first", ".png", pos)
    made = (first,) if spec.hires.keep_base else ()
    return PixelStart(pos, inputs=(latent_file(pos),), outputs=(batch_name("hires_init", ".npy", pos), *made),
                      scratch=() if made else (first,))


def _hires_steps(spec: PromptSpec) -> list[Step]:
    """The second pass of each image: the pixel path's starts first (one VAE session for the batch), then the
    denoises (the job's contexts, or the second pass's own)."""
    contexts = _contexts(spec) if hires_texts(spec) is None else HIRES_CONTEXTS     # entries: the first pass's
    pixel = spec.hires.space == "pixel"
    starts = [_pixel_start(spec, pos) for pos in range(spec.batch)] if pixel else []
    passes = [HiresDenoise(pos, inputs=(*contexts, second_start_file(spec, pos),
                                        *((batch_name("hires_init", ".npy", pos),) if pixel else ())),
                           outputs=(final_latent_file(spec, pos),), scratch=(_state("hires", pos),))
              for pos in range(spec.batch)]
    return starts + passes


def prompt_pairs(spec: PromptSpec, packs: dict) -> list:
    """[(prompt, negative, pack, entries)] a job sends the encoder: its first pass's (with its conditioning entries,
    build.cond_entries; for a job whose entries each take a model pass, each entry's text with an empty negative),
    and its hires pass's own (build.hires_entries; a size with no pack is left out: that job
    fails on its own)."""
    out, first, texts = [], packs.get((spec.width, spec.height)), hires_texts(spec)
    if first is not None and entry_conds(spec):       # positive/negative entries: each as a cfg-1 job's pair
        return [(c.text, "", first, entry_pair(c)) for c in entry_conds(spec)]
    if first is not None:
        out.append((spec.prompt, spec.negative_prompt, first, cond_entries(spec)))
    hires = packs.get(spec.hires.size(spec.width, spec.height)) if texts is not None else None
    if hires is not None:
        out.append((*texts, hires, hires_entries(spec)))
    return out


def decoded_sizes(spec: PromptSpec) -> list[tuple[str, tuple[int, int]]]:
    """(field, (width, height)) of every size the job's plan has the VAE decode: the final image's (the second pass's
    with a hires fix), and the first pass's too when the pixel path or hires.keep_base decodes it. `spec` has its size
    filled."""
    base = (spec.width, spec.height)
    if spec.hires is None:
        return [("width", base)]
    second = spec.hires.size(*base)
    first = spec.hires.space == "pixel" or spec.hires.keep_base
    return ([("width", base)] if first else []) + [("hires", second)]


def _decode_steps(spec: PromptSpec, images: tuple[str, ...]) -> list[Step]:
    """Each image's final latent to its PNG; with an ImageCrop, the VAE's PNGs first (decoded.png ...), then each
    cut into its image."""
    if spec.crop is None:
        return [Decode(pos, inputs=(decoded_latent_file(spec, pos),), outputs=(images[pos],))
                for pos in range(spec.batch)]
    decoded = [batch_name("decoded", ".png", pos) for pos in range(spec.batch)]
    return ([Decode(pos, inputs=(decoded_latent_file(spec, pos),), outputs=(decoded[pos],)) for pos in range(spec.batch)]
            + [CropImage(pos, inputs=(decoded[pos],), outputs=(images[pos],)) for pos in range(spec.batch)])


def build_plan(spec: PromptSpec) -> Plan:
    """The steps of a job, in an order that runs them: its contexts (and init latent), each image's first pass, the
    latent_mix's MixLatent, the hires fix's second pass, each image decoded (with hires.keep_base its first pass's
    too; with an ImageCrop, cut), then all delivered, then the job's report."""
    steps = _encode_steps(spec) + [_first_pass(spec, pos) for pos in range(spec.batch)]
    if spec.latent_mix is not None:                # the daemon's numpy, before the second pass or the VAE session
        steps += [MixLatent(pos, inputs=(latent_file(pos), INIT_LATENT_FILE), outputs=(mixed_latent_file(pos),))
                  for pos in range(spec.batch)]
    if spec.hires is not None:
        steps += _hires_steps(spec)
    images = tuple(batch_name("image", ".png", pos) for pos in range(spec.batch))
    bases = tuple(base_image_file(pos) for pos in range(spec.batch)) if spec.hires and spec.hires.keep_base else ()
    if bases and spec.hires.space == "latent":       # decoded beside the final images: one VAE session for all
        steps += [Decode(pos, inputs=(latent_file(pos),), outputs=(bases[pos],), base=True)
                  for pos in range(spec.batch)]
    steps += _decode_steps(spec, images)
    steps.append(Deliver(inputs=images + bases))
    steps.append(Report(inputs=images + bases, outputs=(REPORT_FILE, TIMING_FILE)))
    return Plan(tuple(steps))
