"""Dashboard login by POST only (issue 44), on a real metrics listener over
real sockets: a token in an address is refused (it lands in logs and
history), the login form POSTs it, and a login over plain HTTP from a peer
that is not loopback is refused (the token would cross the network in clear)
while the same login over HTTPS, or from loopback, opens a session."""

from __future__ import annotations

import socket
import ssl
import subprocess
import urllib.error
import urllib.parse
import urllib.request

import pytest

from sbtest import OPERATOR_TOKEN
from springback.client import metrics

pytestmark = pytest.mark.timeout(60)

TOKEN = OPERATOR_TOKEN
PAGE = b"<!doctype html><html><body><h1>page</h1></body></html>"


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # noqa: ANN002, ANN003
        return None


def _host_address() -> str:
    """This host's address on its default route (not loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # UDP: sends nothing, picks the route
        address = probe.getsockname()[0]
    assert not address.startswith("127."), f"no non-loopback address here ({address})"
    return address


def _serve(listen: str, **tls: str):  # noqa: ANN202
    return metrics.serve(metrics.Registry(), listen, token=TOKEN,
                         pages={"/": lambda path: (200, "text/html", PAGE)}, **tls)


def _send(url: str | urllib.request.Request, data: bytes | None = None,
          context: ssl.SSLContext | None = None) -> tuple[int, dict, bytes]:
    handlers = [NoRedirect()] + ([urllib.request.HTTPSHandler(context=context)] if context else [])
    try:
        with urllib.request.build_opener(*handlers).open(url, data=data, timeout=10) as reply:
            return reply.status, reply.headers, reply.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.headers, refused.read()


def _form(token: str, next_path: str = "/jobs/x") -> bytes:
    return urllib.parse.urlencode({"token": token, "next": next_path}).encode()


@pytest.fixture
def loopback():
    server = _serve("127.0.0.1:0")
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class TestLoginByPostOnly:
    def test_a_token_in_the_address_is_refused_and_opens_no_session(self, loopback):
        code, headers, body = _send(f"{loopback}/?token={TOKEN}")
        assert code == 400 and b"token: not accepted in the address" in body, body
        assert "Set-Cookie" not in headers

    def test_the_form_posts_the_token_and_opens_a_session(self, loopback):
        code, _, page = _send(f"{loopback}/")  # the 401 page is the login form
        assert code == 401 and b"method='post' action='/login'" in page
        assert b"type='password' name='token'" in page
        code, _, page = _send(f"{loopback}/login", _form("wrong-" + TOKEN))
        assert code == 401 and b"token: missing or wrong" in page
        code, headers, _ = _send(f"{loopback}/login", _form(TOKEN))
        assert code == 303 and headers["Location"] == "/jobs/x"
        cookie = headers["Set-Cookie"]
        assert TOKEN not in cookie and "HttpOnly" in cookie, cookie
        request = urllib.request.Request(f"{loopback}/", headers={"Cookie": cookie.split(";")[0]})
        assert _send(request)[0] == 200

    def test_a_login_sends_the_browser_only_to_a_path_of_this_server(self, loopback):
        for elsewhere in ("//evil.example/", "https://evil.example/", "/\\evil.example"):
            code, headers, _ = _send(f"{loopback}/login", _form(TOKEN, elsewhere))
            assert code == 303 and headers["Location"] == "/", (elsewhere, headers["Location"])


class TestNoLoginInClearOverTheNetwork:
    def test_plain_http_from_another_host_is_refused_loopback_is_not(self):
        address = _host_address()
        server = _serve("0.0.0.0:0")
        port = server.server_address[1]
        try:
            code, headers, body = _send(f"http://{address}:{port}/login", _form(TOKEN))
            assert code == 403 and "Set-Cookie" not in headers, body
            assert b"token: login over plain HTTP from " + address.encode() in body
            assert b"--metrics-tls-cert" in body
            assert _send(f"http://127.0.0.1:{port}/login", _form(TOKEN))[0] == 303
        finally:
            server.shutdown()
            server.server_close()

    def test_https_from_another_host_opens_a_session(self, tmp_path):
        address = _host_address()
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj",
                        "/CN=dash", "-addext", f"subjectAltName=IP:{address}", "-keyout",
                        str(tmp_path / "k.pem"), "-out", str(tmp_path / "c.pem")],
                       check=True, capture_output=True, timeout=30)
        server = _serve("0.0.0.0:0", tls_cert=str(tmp_path / "c.pem"),
                        tls_key=str(tmp_path / "k.pem"))
        try:
            trust = ssl.create_default_context(cafile=str(tmp_path / "c.pem"))
            code, headers, _ = _send(f"https://{address}:{server.server_address[1]}/login",
                                     _form(TOKEN), trust)
            assert code == 303 and "; Secure" in headers["Set-Cookie"]
        finally:
            server.shutdown()
            server.server_close()
