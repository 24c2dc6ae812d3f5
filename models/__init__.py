"""Anima math: checkpoints, config, reference forward, host ops, branch graphs, packs, text, VAE, sampler."""
