"""The files of a job folder (RUN/jobs/<id>/), in one table: each one's name, who writes it and what it is for.

Everything that lists them reads this table: the queue's crash clean-up at daemon start (orchestrator.engine.jobs: the
daemon's own temporaries always go, a stage's only when stale, since a stage may still be finishing a dead daemon's
request) and the job's plan (orchestrator.engine.plan), whose steps write them and resume from them."""
from __future__ import annotations

from dataclasses import dataclass

from models.sampling.denoise import STATE_FILE
from protocol.prompt import MAX_BATCH, MAX_COND_ENTRIES

DAEMON = "daemon"               # the one process that writes the queue (orchestrator.engine.daemon and its flow)
STAGE = "stage"                 # a stage process, which may outlive a daemon that died


@dataclass(frozen=True)
class JobFile:
    name: str                   # the job's (or its first image's) name
    writer: str                 # DAEMON or STAGE: whose temporaries a daemon start may always remove
    by: str                     # who writes it, in words
    kept: bool                  # True: a record, an input or a result; False: an intermediate kept for a resume
    per_image: bool = False     # a batch's other images have their own: latent_1.npy, image_2.png ... (batch_name)
    count: int = MAX_BATCH      # per_image: how many there may be (the largest batch, or the most entries)


JOB_FILE = "job.json"
TEXT_FILE = "text.json"                  # the prompts' T5 token counts (report `text`), kept for a resume
COND_FILE, UNCOND_FILE = "cond.npy", "uncond.npy"
INIT_IMAGE_FILE, MASK_FILE = "init_image.png", "mask.png"     # img2img's inputs (orchestrator.engine.inputs.JOB_INPUTS)
INIT_LATENT_FILE = "init_latent.npy"     # img2img: the init image's VAE latent, encoded once (init_mix: the mix)
MIX_IMAGE_FILE = "mix_image.png"         # init_mix: the other upload, kept at submit as init_image.png is
INIT_ENCODED_FILE = "init_encoded.npy"   # init_mix: init_image.png's VAE latent, before the mix
MIX_ENCODED_FILE = "mix_encoded.npy"     # init_mix: mix_image.png's VAE latent
LATENT_FILE = "latent.npy"
ENTRY_FILE = "cond_entry.npy"            # positive/negative entries: one context per distinct text (cond_entry_1.npy ...)
ENTRIES_FILE = "cond_entries.json"       # their texts' token counts, written after every context
MIXED_LATENT_FILE = "mixed_latent.npy"   # latent_mix: the pass's latent combined with the init image's, decoded
HIRES_TEXT_FILE = "hires_text.json"      # the second pass's own prompts: their token counts (hires_cond/uncond.npy)
HIRES_COND_FILE, HIRES_UNCOND_FILE = "hires_cond.npy", "hires_uncond.npy"
HIRES_LATENT_FILE = "hires_latent.npy"   # hires fix: the second pass's latent (latent.npy keeps the first pass's)
HIRES_INIT_FILE = "hires_init.npy"       # the pixel path: the scaled first image encoded again, the second start
FIRST_IMAGE_FILE = "first.png"           # the pixel path: the first pass's image as the VAE decoded it (8 bits)
DECODED_FILE = "decoded.png"             # an image operation's input: the VAE's PNG before ImageCrop
BASE_IMAGE_FILE = "base.png"             # hires.keep_base: the first pass's image, delivered (first.png's place)
IMAGE_FILE = "image.png"
REPORT_FILE = "report.json"
TIMING_FILE = "timing.png"

JOB_FILES = (
    JobFile(JOB_FILE, DAEMON, "the queue (orchestrator.engine.jobs), at every state change", kept=True),
    JobFile(INIT_IMAGE_FILE, DAEMON, "the queue at submit (orchestrator.engine.inputs.keep_in_job)", kept=True),
    JobFile(MASK_FILE, DAEMON, "the queue at submit (orchestrator.engine.inputs.keep_in_job)", kept=True),
    JobFile(MIX_IMAGE_FILE, DAEMON, "the queue at submit (orchestrator.engine.inputs.keep_in_job)", kept=True),
    JobFile(TEXT_FILE, DAEMON, "the flow, encoding", kept=False),
    JobFile(COND_FILE, DAEMON, "the flow, encoding (the encoder's contexts)", kept=False),
    JobFile(UNCOND_FILE, DAEMON, "the flow, encoding (the encoder's contexts)", kept=False),
    JobFile(ENTRY_FILE, DAEMON, "the plan, encoding (a positive/negative entry's context)", kept=False,
            per_image=True, count=2 * MAX_COND_ENTRIES),
    JobFile(ENTRIES_FILE, DAEMON, "the plan, encoding (the entries' token counts)", kept=False),
    JobFile(INIT_LATENT_FILE, DAEMON, "the flow, encoding (the VAE encoder's latent; init_mix: the plan's "
                                      "MixStart)", kept=False),
    JobFile(INIT_ENCODED_FILE, DAEMON, "the plan, encoding (init_mix: the init image's VAE latent)", kept=False),
    JobFile(MIX_ENCODED_FILE, DAEMON, "the plan, encoding (init_mix: the other upload's VAE latent)", kept=False),
    JobFile(STATE_FILE, STAGE, "the scheduler, after every step (the first image's: batch_N/ and hires/, "
                               "hires_N/ hold the others')", kept=False),
    JobFile(LATENT_FILE, DAEMON, "the flow, denoising", kept=False, per_image=True),
    JobFile(MIXED_LATENT_FILE, DAEMON, "the plan, latent_mix (LatentComposite / LatentBlend)", kept=False,
            per_image=True),
    JobFile(HIRES_TEXT_FILE, DAEMON, "the flow, the hires fix's own prompts", kept=False),
    JobFile(HIRES_COND_FILE, DAEMON, "the flow, the hires fix's own prompts", kept=False),
    JobFile(HIRES_UNCOND_FILE, DAEMON, "the flow, the hires fix's own prompts", kept=False),
    JobFile(FIRST_IMAGE_FILE, DAEMON, "the flow, the hires fix's pixel path", kept=False, per_image=True),
    # written by the daemon from the VAE stage's inline PNG (the first pass's size is not the hires arena's)
    JobFile(BASE_IMAGE_FILE, DAEMON, "the flow, hires.keep_base: the first pass's image", kept=True, per_image=True),
    JobFile(HIRES_INIT_FILE, DAEMON, "the flow, the hires fix's pixel path", kept=False, per_image=True),
    JobFile(HIRES_LATENT_FILE, DAEMON, "the flow, the hires fix's second pass", kept=False, per_image=True),
    # the daemon writes it when the VAE is remote (the PNG comes back inline), but a local VAE stage may still be
    # writing a dead daemon's: its temporaries go only when stale
    JobFile(IMAGE_FILE, STAGE, "the VAE stage (the daemon when the VAE is remote, or with an image operation: "
                               "ImageCrop of decoded.png)", kept=True, per_image=True),
    # the VAE's PNG when an image operation (ImageCrop) makes image.png from it; written as image.png is
    JobFile(DECODED_FILE, STAGE, "the VAE stage (the daemon when the VAE is remote), before an image operation",
            kept=False, per_image=True),
    JobFile(REPORT_FILE, DAEMON, "the flow, when the job ends", kept=True),
    JobFile(TIMING_FILE, STAGE, "the timing plot's child process (orchestrator.engine.timing_plot), which may outlive "
                                "its daemon", kept=True),
)


def batch_name(stem: str, suffix: str, pos: int) -> str:
    """Image `pos` of a job's batch: latent.npy / image.png for the first (a single image's names), then
    latent_1.npy, image_1.png ... (what the job folder, the report and `output` call them)."""
    return f"{stem}{suffix}" if pos == 0 else f"{stem}_{pos}{suffix}"


def names(f: JobFile) -> tuple[str, ...]:
    """Every name `f` takes in a job folder: one, or one per image of the largest batch (per entry: the most)."""
    if not f.per_image:
        return (f.name,)
    stem, dot, suffix = f.name.rpartition(".")
    return tuple(batch_name(stem, dot + suffix, pos) for pos in range(f.count))


# the names only the daemon writes: their temporaries are stale whenever a daemon starts
DAEMON_FILES = frozenset(n for f in JOB_FILES if f.writer == DAEMON for n in names(f))
