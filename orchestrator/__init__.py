"""The job daemon, the orchestrator CLI and supervisord control."""
