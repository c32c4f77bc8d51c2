"""Images named by URL, in place: data URLs decoded, hosts outside the allowlist refused, a body
past the cap refused, and a redirect not followed (it could lead past the allowlist). The host is
a tiny server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import threading

import pytest

from diffserve.errors import APIError
from diffserve.frontend.image_urls import host_allowed, image_bytes


@contextlib.contextmanager
def host(status: int, body: bytes = b"", location: str | None = None):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            if location:
                self.send_header("Location", location)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/x.png"
    finally:
        httpd.shutdown()
        httpd.server_close()


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
    with host(200, b"x" * 100) as url:
        assert fetched(url) == b"x" * 100
        assert "99 bytes" in refused(url, "image_too_large", limit=99).message


def test_a_redirect_is_not_followed():
    with host(200, b"secret") as target, host(302, location=target) as url:
        assert "302" in refused(url, "image_url_unreachable").message


def test_a_host_not_allowed_is_never_asked():
    with host(200, b"x") as url:
        refused(url, "image_url_not_allowed", hosts=("example.com",))
