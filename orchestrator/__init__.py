"""The orchestrator: its engine (orchestrator.engine), the ways in above it (orchestrator.terminal: the CLI and
the demo; orchestrator.http: the HTTP front with its ComfyUI and A1111 vocabularies) and the machine
operations (orchestrator.ops)."""
