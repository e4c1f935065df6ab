"""One SGLang engine's HTTP API, as the trainer calls it (standard library only)."""

from __future__ import annotations

import base64
import http.client
import json
import urllib.error
import urllib.request
from typing import Any

from titan_weight_sync.errors import WeightSyncError
from titan_weight_sync.wire import LOAD_FORMAT

MAX_REPLY_BYTES = 64 << 20


class EngineAPI:
    """The engine at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def call(
        self, path: str, body: dict[str, Any] | None = None, get: bool = False
    ) -> dict[str, Any]:
        """POST ``body`` as JSON to ``path`` (or GET it); the JSON answer (SGLang's own
        ``success`` / ``message`` when it refuses).

        :raises WeightSyncError: the engine is unreachable, timed out or answered nonsense.
        """
        data = None if get else json.dumps(body or {}).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                status, raw = reply.status, reply.read(MAX_REPLY_BYTES + 1)
        except urllib.error.HTTPError as err:  # SGLang answers a refusal with 400
            status, raw = err.code, err.read(MAX_REPLY_BYTES + 1)
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as err:
            reason = getattr(err, "reason", err)
            raise WeightSyncError(
                f"weight_sync: the engine at {self.url} does not answer {path} ({reason}): it "
                "died or is unreachable"
            ) from None
        if len(raw) > MAX_REPLY_BYTES:
            raise WeightSyncError(f"weight_sync: {self.url}{path} answered over 64 MiB")
        try:
            answer = json.loads(raw) if raw.strip() else {}
        except ValueError:  # some endpoints (flush_cache) answer in plain text
            text = raw[:2000].decode(errors="replace").strip()
            return {"success": status == 200, "message": text}
        if not isinstance(answer, dict):
            answer = {"result": answer}
        if status != 200:
            answer.setdefault("success", False)
        return answer

    def require(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """:meth:`call`, raising with the engine's message when it says ``success: false``."""
        answer = self.call(path, body)
        if answer.get("success") is False:
            raise WeightSyncError(
                f"weight_sync: the engine at {self.url} refused {path}: {answer.get('message')}"
            )
        return answer

    def titan(
        self, payload: bytes, weight_version: str | None = None, flush_cache: bool = True
    ) -> tuple[bool, str]:
        """Send one weight_sync message inside SGLang's ``update_weights_from_tensor``
        (``flush_cache``: SGLang flushes the cache after a commit that loaded)."""
        answer = self.call(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": [base64.b64encode(payload).decode()],
                "load_format": LOAD_FORMAT,
                "flush_cache": flush_cache,
                "weight_version": weight_version,
            },
        )
        return bool(answer.get("success")), str(answer.get("message", answer))
