"""One module per `anima-models` subcommand: add_arguments(parser) and run(args) -> int."""


class UserError(Exception):
    """An error whose message is the whole answer: printed without a traceback, exit code 2."""
