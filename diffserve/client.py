"""A Python client for reinforcement-learning trainers: rollouts (``POST /v1/rollouts``) with
tensors back as torch tensors, many prompts sent at once, an overloaded or restarting server
(429, 503) retried as its ``Retry-After`` asks; and the control routes of the online loop (a
server started with ``--enable-weight-updates``): new weights, from disk or straight from the
trainer's memory, and sleeping while the trainer has the device; and asynchronous image jobs.

    from diffserve.client import Client

    client = Client("http://127.0.0.1:8000")
    groups = client.rollout(["a red circle", "a blue square"], n=16, num_inference_steps=20)
    groups[0].log_probs.shape  # torch.Size([16, 20])
    groups[0].weight_version   # "0": the weights that made them
    client.update_weights(tensors=model.state_dict())  # {"weight_version": "1", ...}
    job = client.submit_job({"prompt": "a red circle"})  # an image job, answered later
    client.wait_job(job["id"])["result"]  # the images answer

Needs ``httpx`` (``pip install 'diffserve[client]'``) and torch.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from diffserve.wire.request import SEED_MODULUS  # the server's seeds wrap here

RETRIED = (429, 503)


class RolloutError(RuntimeError):
    """The server refused or failed a rollout: ``status`` and the OpenAI error body."""

    def __init__(self, status: int, body: Any) -> None:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        super().__init__(f"HTTP {status}: {error.get('message', body)}")
        self.status, self.body = status, body


@dataclass
class Rollout:
    """One prompt's group: ``tensors`` by name (see the server's docs/rollouts.md) and the
    request's fields as the server ran them."""

    tensors: dict[str, Any]
    request: dict[str, Any]
    seeds: list[int]
    weight_version: str = "0"

    def __getattr__(self, name: str):  # rollout.latents, rollout.log_probs, ...
        try:
            return self.__dict__["tensors"][name]
        except KeyError:
            raise AttributeError(name) from None


class Client:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout_s: float = 600.0, max_retries: int = 8, concurrency: int = 16,
                 backoff_s: float = 0.5) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s,
                                 limits=httpx.Limits(max_connections=concurrency))
        self.max_retries, self.concurrency, self.backoff_s = max_retries, concurrency, backoff_s

    def rollout(self, prompts: str | Sequence[str], n: int = 16, **fields) -> list[Rollout]:
        """One rollout request per prompt (``n`` samples each), sent concurrently; the groups in
        the prompts' order. ``fields``: any of the endpoint's (``seed``, ``num_inference_steps``,
        ``guidance_scale``, ``noise_level``, ``return``, ``size``, ``loras``, ...); a ``seed``
        is per prompt: prompt i uses ``seed + i * n`` (modulo 2**32, as the server wraps
        seeds), so its images get consecutive seeds that no other prompt's share."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        seed = fields.pop("seed", None)
        bodies = [{"prompt": p, "n": n, **fields,
                   **({"seed": (seed + i * n) % SEED_MODULUS} if seed is not None else {})}
                  for i, p in enumerate(prompts)]
        with ThreadPoolExecutor(min(self.concurrency, len(bodies)) or 1) as pool:
            return list(pool.map(self.rollout_one, bodies))

    def rollout_one(self, body: dict[str, Any]) -> Rollout:
        """One ``POST /v1/rollouts`` with retries."""
        from safetensors.torch import load

        response = self._post("/v1/rollouts", body)
        tensors = load(response.content)
        metadata = _metadata(response.content)
        return Rollout(tensors, json.loads(metadata.get("request", "{}")),
                       json.loads(metadata.get("seeds", "[]")), metadata.get("weight_version", "0"))

    # -- the online loop's control (--enable-weight-updates) ---------------------------------

    def update_weights(self, path: str | None = None, tensors: dict[str, Any] | None = None,
                       mode: str = "drain", weight_version: str | None = None) -> dict[str, Any]:
        """New denoiser weights for every executor: ``path`` (inside the server's
        --weights-dir) or ``tensors`` (name -> tensor, e.g. a model's ``state_dict()``: written
        to shared memory on this host, which the server takes over). ``mode``: ``drain`` lets
        running requests finish on the old weights, ``abort`` ends them. Returns once applied:
        ``{"weight_version": ..., "applied_at": ...}``."""
        from diffserve.wire import shared_tensors

        body: dict[str, Any] = {"mode": mode}
        if weight_version is not None:
            body["weight_version"] = weight_version
        if tensors is not None:
            name = shared_tensors.write(tensors)
            body["tensors"] = {"shared_memory": name}
        else:
            body["path"] = path
        try:
            return self._post("/v1/update_weights", body).json()
        finally:
            if tensors is not None:  # the server took it over, unless it refused before
                (shared_tensors.SHARED_DIR / name).unlink(missing_ok=True)

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Give the device back: 1 moves the weights to host memory, 2 drops them."""
        return self._post("/v1/sleep", {"level": level}).json()

    def wake_up(self) -> dict[str, Any]:
        return self._post("/v1/wake_up", {}).json()

    def is_sleeping(self) -> bool:
        response = self.http.get("/v1/is_sleeping")
        if response.status_code != 200:
            raise RolloutError(response.status_code, _json(response))
        return response.json()["is_sleeping"]

    # -- asynchronous image jobs (Prefer: respond-async) -----------------------------------

    def submit_job(self, body: dict[str, Any], route: str = "generations",
                   webhook: str | None = None, events: Sequence[str] | None = None) -> dict:
        """Hand in a generation (or, with ``route="edits"``, a JSON edit: images as
        ``{"image_url": "data:..."}``); the job, queued. ``webhook``: where its events are
        posted, signed; ``events``: which (start, output, completed; default all)."""
        body = {**body, **({"webhook": webhook} if webhook else {}),
                **({"webhook_events_filter": list(events)} if events is not None else {})}
        return self._post(f"/v1/images/{route}", body, {"Prefer": "respond-async"}).json()

    def job(self, job_id: str) -> dict:
        """The job: its status and, once completed, its answer (``result``)."""
        return self._call("GET", f"/v1/images/jobs/{job_id}")

    def cancel_job(self, job_id: str) -> dict:
        """Cancel a queued or running job (a finished one is left as it is); the job."""
        return self._call("DELETE", f"/v1/images/jobs/{job_id}")

    def wait_job(self, job_id: str, poll_s: float = 0.5, timeout_s: float | None = None) -> dict:
        """Poll until the job is finished (completed, failed or cancelled); the job.
        ``TimeoutError`` after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (job := self.job(job_id))["status"] in ("queued", "in_progress"):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job['status']}")
            time.sleep(poll_s)
        return job

    def _call(self, method: str, path: str) -> dict:
        response = self.http.request(method, path)
        if response.status_code != 200:
            raise RolloutError(response.status_code, _json(response))
        return response.json()

    def _post(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None):
        """The answer (200, or 202 for a job), retrying 429 and 503 after the server's
        ``Retry-After`` (else an exponential backoff) and a connection that fails (a server
        restarting)."""
        import httpx

        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                response = self.http.post(path, json=body, headers=headers)
            except httpx.TransportError:
                if last:
                    raise
                time.sleep(self.backoff_s * 2**attempt)
                continue
            if response.status_code in (200, 202):
                return response
            if response.status_code not in RETRIED or last:
                raise RolloutError(response.status_code, _json(response))
            time.sleep(_retry_after(response, self.backoff_s * 2**attempt))
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _retry_after(response, default: float) -> float:
    try:
        return max(0.0, float(response.headers.get("retry-after", default)))
    except ValueError:
        return default


def _json(response):
    try:
        return response.json()
    except ValueError:
        return response.text


def _metadata(body: bytes) -> dict[str, str]:
    """The safetensors header's metadata (the format: 8 bytes of length, then a JSON header)."""
    length = int.from_bytes(body[:8], "little")
    return json.loads(body[8:8 + length]).get("__metadata__", {})
