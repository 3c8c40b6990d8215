"""The ``storage_options`` of an object-store location, sorted for obstore.

Owns :func:`split_options`: the store's config keys, the HTTP client's keys (with
defaults: every request has a timeout) and the retry settings, apart; this layer's
own keys (``LAYER_KEYS``) are left for :mod:`._object`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

__all__ = ["LAYER_KEYS", "split_options"]

_CLIENT_KEYS = {
    "allow_http",
    "allow_invalid_certificates",
    "connect_timeout",
    "default_content_type",
    "http1_only",
    "http2_only",
    "pool_idle_timeout",
    "pool_max_idle_per_host",
    "proxy_url",
    "proxy_ca_certificate",
    "proxy_excludes",
    "read_timeout",
    "timeout",
    "user_agent",
}
_RETRY_KEYS = {"max_retries", "retry_timeout", "init_backoff", "max_backoff"}
#: This layer's own keys: request size of reads (0: one request per range) and of
#: multipart parts, and requests in flight per call.
LAYER_KEYS = {"read_part_size", "part_size", "max_concurrency"}
#: Defaults: no network call without a timeout, and a bounded total retry time.
_CLIENT_DEFAULTS = {"timeout": "120s", "connect_timeout": "10s"}
_RETRY_DEFAULTS: dict[str, Any] = {"max_retries": 6, "retry_timeout": 120.0}
#: The environment prefix of each cloud's settings (``GOOGLE_ALLOW_HTTP``, ...).
_ENV_PREFIX = {
    "s3": "AWS", "s3a": "AWS", "gs": "GOOGLE",
    "az": "AZURE", "abfs": "AZURE", "abfss": "AZURE", "azure": "AZURE",
}  # fmt: skip
_BOOL_CLIENT_KEYS = ("allow_http", "allow_invalid_certificates", "http1_only", "http2_only")
#: Environment settings that obstore applies over a general one the caller may have
#: passed, as a setting of its own (not an alias obstore would merge): the S3-only
#: ``AWS_ENDPOINT_URL_S3`` beats ``endpoint``. Keyed by the name without the cloud's prefix.
_OVERRIDES = {"endpoint_url_s3": "endpoint"}


def _explicit_wins(config: dict[str, Any], prefix: str) -> None:
    """What the caller passes wins over the environment, for every key.

    obstore merges the environment with ``config`` alias by alias, so an explicit
    ``endpoint`` (or ``access_key_id``, ``region``, ...) replaces ``AWS_ENDPOINT_URL``; but an
    environment variable of a more specific setting (``_OVERRIDES``) would still beat it.
    Such a variable gets the caller's value too.

    >>> import os
    >>> os.environ["AWS_ENDPOINT_URL_S3"] = "http://127.0.0.1:9"
    >>> config = {"endpoint": "http://127.0.0.1:9000"}
    >>> _explicit_wins(config, "AWS"); config["aws_endpoint_url_s3"]
    'http://127.0.0.1:9000'
    >>> del os.environ["AWS_ENDPOINT_URL_S3"]
    """
    own = f"{prefix.lower()}_"
    given = {k.lower().removeprefix(own): v for k, v in config.items()}
    for name in os.environ:
        key = name.lower()
        general = _OVERRIDES.get(key.removeprefix(own)) if key.startswith(own) else None
        if general in given and key not in config:
            config[key] = given[general]


def split_options(
    options: Mapping[str, Any], scheme: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(config, client options, retry config)`` for a ``scheme://`` store."""
    config: dict[str, Any] = {}
    client: dict[str, Any] = dict(_CLIENT_DEFAULTS)
    retry_in: dict[str, Any] = dict(_RETRY_DEFAULTS)
    for key, value in options.items():
        if key in LAYER_KEYS:
            continue
        if key in _CLIENT_KEYS:
            client[key] = value
        elif key in _RETRY_KEYS:
            retry_in[key] = value
        else:
            config[key] = value
    retry: dict[str, Any] = {
        "max_retries": int(retry_in["max_retries"]),
        "retry_timeout": timedelta(seconds=float(retry_in["retry_timeout"])),
    }
    backoff = {
        k: timedelta(seconds=float(retry_in[k]))
        for k in ("init_backoff", "max_backoff")
        if k in retry_in
    }
    if backoff:
        retry["backoff"] = backoff
    # Passing client options hides obstore's own reading of the client keys from the
    # environment (AWS_ALLOW_HTTP, GOOGLE_ALLOW_HTTP, AZURE_ALLOW_HTTP, AZURE_PROXY_URL, ...):
    # read them here, for the URL's cloud, where storage_options do not set the key
    # (plus the bare ALLOW_HTTP, read for every cloud).
    prefix = _ENV_PREFIX.get(scheme, "AWS")
    _explicit_wins(config, prefix)
    for key in sorted(_CLIENT_KEYS - options.keys()):
        names = [f"{prefix}_{key.upper()}"] + (["ALLOW_HTTP"] if key == "allow_http" else [])
        found = [os.environ[n] for n in names if n in os.environ]
        if found:
            client[key] = found[0]
    for key in _BOOL_CLIENT_KEYS:
        if key in client and isinstance(client[key], str):
            client[key] = client[key].lower() in ("1", "true", "yes")
    return config, client, retry
