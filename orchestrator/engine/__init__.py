"""The orchestrator's engine: the job daemon, the plan and its runner, stage control under supervisord, the
job store and its records, reports and PNG text, the run folder. It imports no way in (the CLI, the HTTP
front): what a front knows, such as the PNG formats, it is handed (docs/architecture.md, "The orchestrator's
layers")."""
