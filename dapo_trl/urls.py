"""Checking the base URL of an HTTP service the trainer calls (a judge, a sandbox) before the first request."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable


def checked_service_path(base_url: str, bad: Callable[[str], ValueError]) -> tuple[str, str, str]:
    """(scheme, netloc, path without trailing slash) of an http(s) URL; `bad(problem)` builds the error raised."""
    if not isinstance(base_url, str) or not base_url.strip():
        raise bad("is empty")
    url = base_url.strip()
    if any(c.isspace() for c in url):
        raise bad("contains whitespace")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise bad("must start with http:// or https://")
    if not parts.hostname:
        raise bad("has no host")
    try:
        _ = parts.port  # raises ValueError for a non-numeric or out-of-range port
    except ValueError:
        raise bad("has an invalid port") from None
    if parts.query or parts.fragment:
        raise bad("must not have a query string or fragment")
    return parts.scheme, parts.netloc, parts.path.rstrip("/")
