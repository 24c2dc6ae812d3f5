"""Text conditioning: tokenizers, Qwen3 text encoder, LLM adapter, prompt weights, prompt -> context [512, Dc]."""
