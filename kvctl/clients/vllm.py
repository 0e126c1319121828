"""vLLM's OpenAI-compatible server: health, tokenization (exactly what vLLM uses), completions."""

from __future__ import annotations

from typing import Any

from kvctl.clients.http import HTTPClient
from kvctl.core.errors import RejectedError, ServerError, UnreachableError

TIMEOUT_S = 30.0


class VLLMClient(HTTPClient):
    def __init__(self, url: str, timeout: float = TIMEOUT_S) -> None:
        super().__init__(url, timeout)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        import httpx

        try:
            response = self._client.request(method, path, json=body)
        except httpx.TransportError as error:
            raise UnreachableError(f"cannot reach vLLM at {self.url}: {error}",
                                   hint="check that vLLM runs and the URL (host:port of its OpenAI server)") from None
        if 400 <= response.status_code < 500:
            raise RejectedError(f"vLLM rejected {path}: {_error_message(response)}",
                                hint="check the model name and input")
        if response.status_code >= 500:
            raise ServerError(f"vLLM failed {path} (HTTP {response.status_code})", hint="check vLLM's log")
        return response.json() if response.content else None

    def health(self) -> bool:
        self._call("GET", "/health")
        return True

    def models(self) -> list[str]:
        return [model["id"] for model in self._call("GET", "/v1/models")["data"]]

    def tokenize(self, model: str, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        body: dict[str, Any] = {"model": model}
        if messages is not None:
            body["messages"] = messages
        else:
            body["prompt"] = prompt
        return self._call("POST", "/tokenize", body)["tokens"]


def _error_message(response) -> str:
    try:
        payload = response.json()
    except ValueError:
        return response.text[:200]
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    return str(error.get("message", error) if isinstance(error, dict) else error)
