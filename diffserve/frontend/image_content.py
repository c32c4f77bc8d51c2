"""``GET /v1/images/{id}/content``: a ``response_format: "url"`` image, behind the same API key
as every /v1 route, until it expires (404 after)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import Response

from diffserve.errors import APIError
from diffserve.frontend.serving import Serving


def image_gone(image_id: str) -> APIError:
    return APIError(f"No image {image_id!r}: it never existed or has expired "
                    "(--image-ttl-s).", "image_id", "image_not_found", 404)


def image_content_routes(serving: Serving) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/images/{image_id}/content", response_class=Response,
                responses={200: {"content": {"image/png": {}, "image/jpeg": {},
                                             "image/webp": {}}}})
    async def image_content(image_id: str):
        found = (await asyncio.get_running_loop().run_in_executor(
            serving.pool, serving.images.get, image_id)
            if image_id.isascii() and image_id.replace("_", "").isalnum() else None)
        if found is None:
            raise image_gone(image_id)
        data, media_type = found
        return Response(data, media_type=media_type,
                        headers={"Cache-Control": "private, max-age=60"})

    return router
