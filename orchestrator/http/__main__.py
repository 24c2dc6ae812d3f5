"""`python -m orchestrator.http --config RUN/pipeline.toml`: the HTTP front (supervisord's [program:http]).

A setting it refuses (another address than loopback without a token, a token file others can read, a port in use,
another front already serving the run folder) is one line on stderr and exit 2 before anything listens, once past
supervisord's startsecs (stages.base.config_exit): supervisord then shows it EXITED with status 2 and leaves it down
(exitcodes=2), however long the start took."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path



def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.http", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the run folder's pipeline.toml")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from orchestrator.http.app import FrontBusy, make_front, serve
    from orchestrator.http.settings import HttpSettings, SettingsError
    from stages.base import config_exit
    from stages.config import ConfigError, load_config

    def refused(message: str) -> int:            # exit 2 past supervisord's startsecs: EXITED, however slow the start
        print(f"anima-http: {message}", file=sys.stderr, flush=True)
        return config_exit()
    try:
        cfg = load_config(Path(args.config))
        settings = HttpSettings.from_config(cfg)
        token = settings.check()
    except (ConfigError, SettingsError) as e:
        return refused(str(e))
    logging.getLogger().setLevel(cfg.log_level.upper())
    import setproctitle
    setproctitle.setproctitle("anima-http")
    try:
        asyncio.run(serve(make_front(cfg, settings, token)))
    except FrontBusy as e:
        return refused(str(e))
    except OSError as e:
        return refused(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
