"""Images named by URL, in place: data URLs decoded, hosts outside the allowlist refused, a body
past the cap refused, and a redirect not followed (it could lead past the allowlist). The host is
a tiny server on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest

from diffserve.errors import APIError
from diffserve.frontend.image_urls import host_allowed, image_bytes
from helpers import image_host


def fetched(url: str, hosts=("127.0.0.1",), limit: int = 100) -> bytes:
    return asyncio.run(image_bytes(url, "images[0].image_url", hosts, limit))


def refused(url: str, code: str, **kwargs) -> APIError:
    with pytest.raises(APIError) as error:
        fetched(url, **kwargs)
    assert (error.value.status, error.value.code) == (400, code)
    assert error.value.param == "images[0].image_url"
    return error.value


def test_hosts_are_allowed_by_name_or_star():
    assert host_allowed("http://127.0.0.1:8/x", ("127.0.0.1",))
    assert host_allowed("https://Images.Example/x", ("images.example",))
    assert host_allowed("https://anything/x", ("*",))
    assert not host_allowed("http://127.0.0.2/x", ("127.0.0.1",))
    assert not host_allowed("http://127.0.0.1/x", ())


def test_data_urls_need_no_host():
    assert fetched("data:image/png;base64,aGVsbG8=", hosts=()) == b"hello"


def test_a_body_within_the_cap_is_read_and_one_past_it_refused():
    with image_host(200, b"x" * 100) as url:
        assert fetched(url) == b"x" * 100
        assert "99 bytes" in refused(url, "image_too_large", limit=99).message


def test_a_redirect_is_not_followed():
    with image_host(200, b"secret") as target, image_host(302, location=target) as url:
        assert "302" in refused(url, "image_url_unreachable").message


def test_a_host_not_allowed_is_never_asked():
    with image_host(200, b"x") as url:
        refused(url, "image_url_not_allowed", hosts=("example.com",))
