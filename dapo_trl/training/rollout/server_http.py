"""HTTP for the streaming rollout's server engine: the server's URL honoured as TRL's client honours it (TLS,
CA bundles, a path prefix), and HTTP/1.1 answers read whole or handed on piece by piece as they arrive."""

from __future__ import annotations

import asyncio
import os
import ssl
import urllib.parse
from collections.abc import Callable

from ...utils.http import checked_service_path


def server_address(base_url: str) -> tuple[str, int, str, ssl.SSLContext | None]:
    """(host, port, path prefix, TLS context or None) of a vLLM server URL; what cannot be honoured is refused."""

    def bad(problem: str) -> ValueError:
        return ValueError(
            f"vllm_server_base_url={base_url!r} {problem}; give the server's root URL, e.g. 'http://127.0.0.1:8000' "
            "or 'https://proxy.example/vllm'"
        )

    scheme, _, path = checked_service_path(base_url, bad)
    parts = urllib.parse.urlsplit(base_url)
    if parts.username is not None or parts.password is not None:
        raise bad(
            "has credentials (user:password@), which the streaming rollout does not send: drop them, or use a URL "
            "that needs none"
        )
    if scheme == "http":
        return parts.hostname or "localhost", parts.port or 80, path, None
    # Trust what `requests` (TRL's client, rounds) trusts: its CA-bundle variables, else the system's store.
    bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or None
    return parts.hostname or "localhost", parts.port or 443, path, ssl.create_default_context(cafile=bundle)


def untrusted(call: str, exc: ssl.SSLCertVerificationError) -> str:
    """An untrusted certificate is a setting to fix, not a server to wait for: the message says which setting."""
    return (
        f"{call}: the vLLM server's certificate is not trusted ({exc.verify_message or exc}); set "
        "REQUESTS_CA_BUNDLE to the CA bundle that signed it (requests, for rounds, reads it too)"
    )


async def read_response(
    reader: asyncio.StreamReader, status_line: bytes, feed: Callable[[bytes], None] | None = None
) -> tuple[int, bytes]:
    """(status, body) of an HTTP/1.1 response after its status line: Content-Length, chunked, or read to the end.
    With `feed`, the body is handed to it piece by piece as it arrives instead (and b"" returned)."""
    if not status_line:
        raise ConnectionResetError("the server closed the connection before answering")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise ValueError(f"not an HTTP response: {status_line[:200]!r}")
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    chunks: list[bytes] = []
    keep = chunks.append if feed is None else feed
    if "content-length" in headers:
        keep(await reader.readexactly(int(headers["content-length"])))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            line = await reader.readline()
            if not line:
                # The server went away mid-answer (killed, restarting): a lost connection, as when it closes before
                # answering, so the rollout waits for it instead of stopping on a malformed answer.
                raise ConnectionResetError("the connection closed inside a chunked HTTP body")
            if not (size := int(line.split(b";")[0].strip() or b"0", 16)):
                break
            keep(await reader.readexactly(size))
            await reader.readline()
    else:
        while data := await reader.read(1 << 16):
            keep(data)
    return int(parts[1]), b"".join(chunks)
