"""Sampling: ComfyUI's samplers and schedulers (k_sampling, schedules), the sampler a job drives step by step
(sampler), its resumable state (sampler_state), the noise and Brownian tree behind the stochastic samplers, Spectrum's
forecast, and the one-process denoising baseline (denoise). Imports nothing from the DiT or its packs: the model is
whatever callable the caller hands in."""
