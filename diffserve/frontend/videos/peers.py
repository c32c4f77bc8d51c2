"""Video jobs past one server (Ray Serve replicas): each replica holds its own jobs, in its own
store, and a job's id ends with its replica's tag (``_r<rank>``). Ray Serve's proxy may send a
request about a job to any replica; one that does not hold the job passes it on to the one that
does, over that replica's internal HTTP address (kept in a directory the replicas share), and a
list gathers every replica's page. A replica's rank survives its replacement, and so does its
store (``--video-dir``/replica-<rank>), so ids keep routing across restarts."""

from __future__ import annotations

import asyncio
import re
from typing import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from diffserve.errors import APIError

HOLDER = re.compile(r"_r(\d+)$")
# A peer's request: answer from this replica's own store (no passing on, no gathering).
LOCAL_HEADER = "x-diffserve-videos-local"
PASSED = ("authorization", "content-type", "accept")  # headers a passed-on request keeps
TIMEOUT_S = 60.0


def unreachable(rank: int) -> APIError:
    return APIError(f"The replica holding this video (rank {rank}) cannot be reached now; retry "
                    "shortly.", None, "replica_unavailable", 503, "server_error",
                    {"Retry-After": "1"})


class Peers:
    def __init__(self, rank: int, address_of: Callable[[int], Awaitable[str | None]],
                 addresses: Callable[[], Awaitable[dict[int, str]]]) -> None:
        """``address_of(rank)``: a replica's internal base URL (None: no such replica);
        ``addresses()``: every replica's."""
        import httpx

        self.rank, self.tag = rank, f"_r{rank}"
        self.address_of, self.addresses = address_of, addresses
        self.client = httpx.AsyncClient(timeout=TIMEOUT_S)

    def holder(self, video_id: str, http_request: Request) -> int | None:
        """The rank of the replica holding ``video_id`` if it is another one (and the request
        did not come from a peer); None to answer here."""
        match = HOLDER.search(video_id)
        if match is None or http_request.headers.get(LOCAL_HEADER):
            return None
        rank = int(match.group(1))
        return None if rank == self.rank else rank

    def local(self, http_request: Request) -> bool:
        return bool(http_request.headers.get(LOCAL_HEADER))

    def _headers(self, http_request: Request) -> dict[str, str]:
        kept = {k: v for k, v in http_request.headers.items() if k.lower() in PASSED}
        return {**kept, LOCAL_HEADER: "1"}

    async def pass_on(self, http_request: Request, rank: int) -> Response | None:
        """The holder's answer to this request, streamed back; None where no replica has that
        rank (the id is unknown)."""
        import httpx

        address = await self.address_of(rank)
        if address is None:
            return None
        url = address + http_request.url.path + (f"?{http_request.url.query}"
                                                 if http_request.url.query else "")
        try:
            sent = self.client.build_request(http_request.method, url,
                                             headers=self._headers(http_request))
            answer = await self.client.send(sent, stream=True)
        except httpx.HTTPError:
            raise unreachable(rank) from None
        kept = {k: v for k, v in answer.headers.items()
                if k.lower() in ("content-type", "content-length", "openai-poll-after-ms",
                                 "retry-after")}
        return StreamingResponse(answer.aiter_raw(), answer.status_code, kept,
                                 background=_Close(answer))

    async def pages(self, http_request: Request) -> list[dict]:
        """Every other replica's page of the list (the same query), as JSON bodies."""
        addresses = {rank: url for rank, url in (await self.addresses()).items() if rank != self.rank}

        async def one(rank: int, url: str) -> dict:
            try:
                answer = await self.client.get(url + "/v1/videos", params=http_request.query_params,
                                               headers=self._headers(http_request))
            except Exception:  # noqa: BLE001 - the list cannot be complete without it
                raise unreachable(rank) from None
            if answer.status_code != 200:
                raise unreachable(rank)
            return answer.json()

        return list(await asyncio.gather(*(one(r, u) for r, u in addresses.items())))

    async def close(self) -> None:
        await self.client.aclose()


class _Close:
    """Closes a streamed answer once it has been passed on (a background task)."""

    def __init__(self, answer) -> None:
        self.answer = answer

    async def __call__(self) -> None:
        await self.answer.aclose()
