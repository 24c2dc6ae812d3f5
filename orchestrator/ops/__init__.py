"""Machine operations on a run folder and its board: `orchestrator doctor`, `init --add-pack`, `init --bundle`,
`service`, `start` / `stop`. They use the engine and no way in."""
