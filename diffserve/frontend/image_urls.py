"""Images named by URL, as JSON edits name them: data URLs decoded in place; http(s) URLs
fetched only from the hosts the operator allows (``--allowed-image-hosts``), without following
redirects (a redirect could lead past the allowlist), within a size cap and a timeout. A fetch
runs in a thread (the standard library's client): it never blocks the event loop."""

from __future__ import annotations

import asyncio
import base64
import binascii
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from diffserve.errors import invalid_request

FETCH_TIMEOUT_S = 10.0
ANY_HOST = "*"


def host_allowed(url: str, hosts) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    return bool(host) and (ANY_HOST in hosts or host in {h.lower() for h in hosts})


def data_url_bytes(url: str, param: str) -> bytes:
    """The bytes of a base64 data URL (``data:image/png;base64,...``)."""
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise invalid_request(f"{param} is a data URL without base64 content; send "
                              "'data:image/png;base64,...'", param, "invalid_image_url")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid_request(f"{param} is a data URL whose content is not valid base64", param,
                              "invalid_image_url") from None


class TooLarge(Exception):
    """A fetched image past the size cap."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # the 3xx is answered as an error


NO_REDIRECTS = urllib.request.build_opener(_NoRedirects)


def fetch(url: str, limit: int, timeout_s: float = FETCH_TIMEOUT_S) -> bytes:
    """GET ``url``: its body, at most ``limit`` bytes (:class:`TooLarge` past it)."""
    request = urllib.request.Request(url, headers={"User-Agent": "diffserve"})
    with NO_REDIRECTS.open(request, timeout=timeout_s) as response:
        data = response.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(f"it is larger than {limit} bytes (--max-upload-bytes)")
    return data


async def image_bytes(url: str, param: str, allowed_hosts, limit: int) -> bytes:
    """The image a URL names, or a 400 naming ``param``."""
    if url.startswith("data:"):
        return data_url_bytes(url, param)
    scheme = urlsplit(url).scheme.lower()
    if scheme not in ("http", "https"):
        raise invalid_request(f"{param} must be a data URL or an http(s) URL", param,
                              "invalid_image_url")
    if not host_allowed(url, allowed_hosts):
        raise invalid_request(f"{param}: this server fetches images only from the hosts its "
                              "operator allows (--allowed-image-hosts); send the image as a data "
                              "URL", param, "image_url_not_allowed")
    try:
        return await asyncio.to_thread(fetch, url, limit)
    except TooLarge as error:
        raise invalid_request(f"{param}: {error}", param, "image_too_large") from None
    except urllib.error.HTTPError as error:
        why = f"the host answered {error.code}"
    except (urllib.error.URLError, OSError, ValueError) as error:
        why = f"it could not be fetched ({getattr(error, 'reason', error)})"
    raise invalid_request(f"{param}: {why}", param, "image_url_unreachable")


async def ref_bytes(ref, param: str, allowed_hosts, limit: int) -> bytes:
    if ref.file_id is not None:
        raise invalid_request(f"{param}.file_id: this server has no files API; send an "
                              "image_url", f"{param}.file_id", "unsupported_parameter")
    if ref.image_url is None:
        raise invalid_request(f"Missing required parameter: '{param}.image_url'.",
                              f"{param}.image_url", "missing_required_parameter")
    return await image_bytes(ref.image_url, f"{param}.image_url", allowed_hosts, limit)


async def json_edit_inputs(body, allowed_hosts, limit: int) -> tuple[list[bytes], bytes | None]:
    """A JSON edit's images and mask as the bytes a multipart edit would have uploaded; all
    together at most ``limit`` bytes."""
    images = [await ref_bytes(ref, f"images[{i}]", allowed_hosts, limit)
              for i, ref in enumerate(body.images)]
    mask = None if body.mask is None else await ref_bytes(body.mask, "mask", allowed_hosts, limit)
    if sum(map(len, images)) + len(mask or b"") > limit:
        raise invalid_request(f"the images are larger than {limit} bytes together "
                              "(--max-upload-bytes)", "images", "image_too_large")
    return images, mask
