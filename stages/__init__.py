"""One module per pipeline process: encoder, scheduler, executor, vae; executor backends."""
