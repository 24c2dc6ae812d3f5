"""One module per `anima-models` subcommand: add_arguments(parser) and run(args) -> int."""
