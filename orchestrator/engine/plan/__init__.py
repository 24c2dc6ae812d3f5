"""A job as a plan (docs/plan.md): the typed steps (steps), the one pure function from a prompt to its steps (build)
and the runner that carries them out in the daemon (run, with the steps' executors in encode, denoise and decode)."""
