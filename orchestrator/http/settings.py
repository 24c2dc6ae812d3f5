"""`[stage.http]` settings of the HTTP front, and the checks that keep it safe to start.

    [stage.http]
    host = "127.0.0.1"          # loopback by default; any other address needs token_file
    port = 8188                 # 0: any free port (the one taken is written to RUN/http.json)
    token_file = "http.token"   # a 0600 file holding the token (>= 16 characters); clients send
                                # `Authorization: Bearer <token>` (or HTTP Basic with it as the password)
    max_body_kb = 256           # request bodies larger than this get 413
    max_upload_mb = 32          # image uploads and A1111 img2img bodies (base64 images) up to this
    max_uploads_mb = 2048       # the upload folders (RUN/input, temp, output) together; a new upload past it: 507
    request_timeout_s = 5.0     # one request to the daemon; no answer -> 503
    poll_s = 0.25               # how often running jobs are looked at (progress over the WebSocket)
    idle_timeout_s = 15.0       # headers must arrive, an idle keep-alive connection is closed, within this
    body_timeout_s = 30.0       # a request body must arrive within this, else 408
"""
import os
import stat
from pathlib import Path

from protocol.security import is_loopback
from stages import settings

MIN_TOKEN_CHARS = 16


class SettingsError(ValueError):
    """A setting the front refuses to start with; the message names the file and the key."""


class HttpSettings(settings.HttpSettings, frozen=True):
    """[stage.http] as the config schema's record (stages/settings.py: keys, types, bounds), with the checks that
    keep the front safe to start; token_file is absolute."""

    @property
    def max_body_bytes(self) -> int:
        return self.max_body_kb * 1024

    @property
    def max_upload_bytes(self) -> int:
        return self.max_upload_mb * 2**20

    @property
    def max_uploads_bytes(self) -> int | None:
        return self.max_uploads_mb * 2**20 or None

    @classmethod
    def from_config(cls, cfg) -> "HttpSettings":
        """From the pipeline config's [stage.http] record (checked when the file was read); token_file relative to
        the config file's folder."""
        kw = cfg.settings("http").to_dict()
        if kw["token_file"] is not None:
            p = Path(os.path.expanduser(kw["token_file"]))
            kw["token_file"] = str(p if p.is_absolute() else (Path(cfg.path).parent / p).resolve())
        return cls(**kw)

    def token(self) -> str | None:
        """The token clients must send, read from token_file (None when there is none). SettingsError when the file
        is missing, readable by others, or too short."""
        if self.token_file is None:
            return None
        where = f"stage.http.token_file {self.token_file}"
        try:
            st = os.stat(self.token_file)
            text = Path(self.token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise SettingsError(f"{where}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise SettingsError(f"{where}: mode {stat.S_IMODE(st.st_mode):04o}; it must be a file only its owner "
                                f"can read (chmod 600)")
        if len(text) < MIN_TOKEN_CHARS or any(c.isspace() for c in text):
            raise SettingsError(f"{where}: the token must be one word of at least {MIN_TOKEN_CHARS} characters "
                                f"(e.g. `openssl rand -hex 24 > {self.token_file}`)")
        return text

    def check(self) -> str | None:
        """Safe to start? -> the token (or None on loopback without one). Another address than loopback needs one."""
        token = self.token()
        if token is None and not is_loopback(self.host):
            raise SettingsError(f"stage.http.host {self.host!r} is not a loopback address: listening there needs a "
                                f"token (set stage.http.token_file to a 0600 file holding it), or use 127.0.0.1")
        return token

    @property
    def display_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host
