"""The terminal's ways in: the `orchestrator` CLI, `make demo`, `status JOB`'s view of a job."""
