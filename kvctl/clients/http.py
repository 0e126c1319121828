"""The HTTP plumbing the server clients share: one connection pool, closed with the client."""

from __future__ import annotations


class HTTPClient:
    def __init__(self, url: str, timeout: float) -> None:
        import httpx

        self.url = url.rstrip("/")
        if url.startswith("unix:"):  # unix:/path/to/socket
            transport = httpx.HTTPTransport(uds=url[len("unix:"):])
            self._client = httpx.Client(transport=transport, base_url="http://localhost", timeout=timeout)
        else:
            self._client = httpx.Client(base_url=self.url, timeout=timeout)

    def close(self) -> None:
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
