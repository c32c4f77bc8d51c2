"""Webhooks of image jobs, signed as Standard Webhooks sign them: ``webhook-id``,
``webhook-timestamp`` and ``webhook-signature`` = ``v1,`` + base64(HMAC-SHA256(secret,
"{id}.{timestamp}.{body}")). A secret written ``whsec_...`` is base64 (the convention's own
form); any other is its UTF-8 bytes.

Each event is posted by a task of its own, the HTTP call in a thread (the standard library's
client, redirects not followed), so a slow or absent receiver never holds up the engine or
another job. A delivery that fails (no answer, or not 2xx) is retried with doubling waits for
``RETRY_FOR_S``; the retries of one event keep its ``webhook-id`` (the receiver's key to
drop duplicates)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import time
import urllib.request

import orjson

from diffserve.errors import invalid_request
from diffserve.frontend.image_urls import NO_REDIRECTS
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

EVENTS = ("start", "output", "completed")
FIRST_WAIT_S, LONGEST_WAIT_S = 0.5, 60.0
RETRY_FOR_S = 3600.0
POST_TIMEOUT_S = 10.0


def secret_bytes(secret: str) -> bytes:
    if secret.startswith("whsec_"):
        return base64.b64decode(secret[len("whsec_"):])
    return secret.encode()


def signature(secret: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{message_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret, signed, hashlib.sha256).digest()).decode()


def check_webhook(url: str | None, events, secret: str, allowed_hosts) -> None:
    """A 400 for a webhook this server will not post to."""
    if url is None:
        if events is not None:
            raise invalid_request("webhook_events_filter needs a webhook", "webhook_events_filter",
                                  "invalid_value")
        return
    if not secret:
        raise invalid_request("This server sends no webhooks: it has no signing secret "
                              "(--webhook-secret)", "webhook", "unsupported_parameter")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise invalid_request(f"webhook {url!r} is not an http(s) URL", "webhook", "invalid_value")
    if allowed_hosts and parts.hostname.lower() not in {h.lower() for h in allowed_hosts}:
        raise invalid_request(f"webhook host {parts.hostname!r} is not one this server posts to "
                              "(--allowed-webhook-hosts)", "webhook", "webhook_not_allowed")


def _post(url: str, body: bytes, headers: dict[str, str]) -> int:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    with NO_REDIRECTS.open(request, timeout=POST_TIMEOUT_S) as response:
        return response.status


class Webhooks:
    def __init__(self, secret: str, clock=time.time) -> None:
        self.secret = secret_bytes(secret) if secret else b""
        self.clock = clock
        self.tasks: set[asyncio.Task] = set()  # deliveries under way (kept from collection)

    def send(self, url: str, job_id: str, event: str, data: dict) -> None:
        """Post ``event`` of a job in the background, retried until delivered or given up."""
        task = asyncio.get_running_loop().create_task(self._deliver(url, job_id, event, data))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _deliver(self, url: str, job_id: str, event: str, data: dict) -> None:
        message_id = f"msg_{job_id}_{event}"
        body = orjson.dumps({"type": f"image.job.{event}", "timestamp": int(self.clock()),
                             "data": data})
        wait, deadline = FIRST_WAIT_S, time.monotonic() + RETRY_FOR_S
        while True:
            timestamp = int(self.clock())
            headers = {"Content-Type": "application/json", "User-Agent": "diffserve",
                       "webhook-id": message_id, "webhook-timestamp": str(timestamp),
                       "webhook-signature": signature(self.secret, message_id, timestamp, body)}
            try:
                status = await asyncio.to_thread(_post, url, body, headers)
                if 200 <= status < 300:
                    return
                why = f"answered {status}"
            except Exception as error:  # noqa: BLE001 - any failure is retried
                why = f"{type(error).__name__}: {error}"
            if time.monotonic() + wait > deadline:
                log.warning("webhook %s of %s to %s given up: %s", event, job_id, url, why)
                return
            log.info("webhook %s of %s to %s failed (%s); again in %.1f s", event, job_id, url,
                     why, wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, LONGEST_WAIT_S)
