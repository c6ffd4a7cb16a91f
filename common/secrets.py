"""Keep credentials out of logs, logged configs and checkpoints.

Two sources of secrets: config keys whose names say so (`api_key`, `token`, `secret`, ...) and
the values of credential environment variables (S3, wandb, hub, MosaicML), which can reach a log
line through an error message or a URL. `redact()` cleans a config before it is logged;
`RedactingFilter` cleans log records. `protect_config_secrets()` adds the first kind's values to the
second, so they are masked in log records too, and in `sys.argv`, which wandb records with the run
(an override such as `loggers.remote.backend_kwargs.aws_secret_access_key=...` would otherwise be
stored in the run's metadata).
"""

import logging
import os
import re
import sys

MASK = "***"
SECRET_KEY = re.compile(r"secret|token|password|passwd|credential|api[_-]?key|access[_-]?key", re.I)
SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SESSION_TOKEN",
    "S3_SECRET_ACCESS_KEY",
    "WANDB_API_KEY",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "MOSAICML_API_KEY",
    "DATABRICKS_TOKEN",
    "AZURE_STORAGE_KEY",
)
_URL_USERINFO = re.compile(r"(\w+://)[^/@\s]+@")
MIN_SECRET_LEN = 6  # shorter values (e.g. "1") would mask innocent text; real credentials are long
_config_secrets: list[str] = []  # see protect_config_secrets


def secret_values() -> list[str]:
    env = [v for name in SECRET_ENV if len(v := os.environ.get(name, "")) >= MIN_SECRET_LEN]
    return env + _config_secrets


def config_secret_values(obj, under_secret_key: bool = False) -> list[str]:
    """The string values under secret-named keys of a config (dicts, lists, scalars)."""
    if isinstance(obj, dict):
        return [
            v
            for k, value in obj.items()
            for v in config_secret_values(value, under_secret_key or bool(SECRET_KEY.search(str(k))))
        ]
    if isinstance(obj, (list, tuple)):
        return [v for value in obj for v in config_secret_values(value, under_secret_key)]
    return [obj] if under_secret_key and isinstance(obj, str) and len(obj) >= MIN_SECRET_LEN else []


def protect_config_secrets(cfg: dict) -> None:
    """Mask `cfg`'s secret values in later log records and in this process's command line."""
    _config_secrets.extend(v for v in config_secret_values(cfg) if v not in _config_secrets)
    sys.argv[:] = [redact_text(arg) for arg in sys.argv]


def redact_text(text: str, secrets: list[str] | None = None) -> str:
    for value in secrets if secrets is not None else secret_values():
        text = text.replace(value, MASK)
    return _URL_USERINFO.sub(rf"\1{MASK}@", text)


def redact(obj, secrets: list[str] | None = None):
    """A copy of a config (dicts, lists, scalars) with secret-named keys and secret values masked."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(obj, dict):
        return {
            k: MASK if isinstance(k, str) and SECRET_KEY.search(k) and v is not None else redact(v, secrets)
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v, secrets) for v in obj)
    if isinstance(obj, str):
        return redact_text(obj, secrets)
    return obj


class RedactingFilter(logging.Filter):
    """Masks credential values in every record passing through a handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact_text(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


def install_log_redaction() -> None:
    """Attach the filter to every handler of the root logger (call after logging is configured)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
