"""GET with a deadline for the whole answer and a cap on its size, for the
operator commands that read another server (`nettap top`, `nettap size`).

requests' timeout bounds each socket read, not the request: a server that
trickles a byte a second would hold a command forever, and one that answers
a few hundred megabytes would be read into memory whole. Every failure is a
:class:`FetchError` whose text is short and safe to print."""
from __future__ import annotations

import time
from typing import Optional

from exporter.util.logsafe import escape

SHOWN = 200              # characters of a server's own text put into a message


class FetchError(Exception):
    """str(): what failed, short and safe to print; reason: why, in a word
    (too_large, timeout, http, unreachable), for a caller that counts them."""

    def __init__(self, text: str, reason: str = "unreachable"):
        super().__init__(text)
        self.reason = reason


def shown(text: str, limit: int = SHOWN) -> str:
    """text cut to limit characters, control characters escaped: what a
    message may quote of what a server said."""
    text = escape(text)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


def get(url: str, params: Optional[dict] = None, deadline: float = 30.0, max_bytes: int = 64 << 20,
        session=None) -> bytes:
    """The body of a 2xx answer to GET url, whole within deadline seconds
    and max_bytes; FetchError otherwise (naming HTTP status and a short,
    escaped part of the server's text where there is one)."""
    import requests
    import urllib3
    end = time.monotonic() + deadline
    s = session or requests
    try:
        # a silent server is cut by the read timeout, a trickling one by the check per read
        with s.get(url, params=params, timeout=max(0.05, deadline), stream=True) as r:
            body = bytearray()
            while True:
                # read1: what has arrived (one read of the socket), decoded;
                # read(n) would wait for n bytes, one trickled byte at a time
                part = r.raw.read1(65536, decode_content=True)
                if not part:
                    break
                body += part
                if len(body) > max_bytes:
                    raise FetchError(f"{url}: the answer is larger than {max_bytes} bytes", "too_large")
                if time.monotonic() > end:
                    raise FetchError(f"{url}: no whole answer within {deadline:g} s", "timeout")
            if time.monotonic() > end:
                raise FetchError(f"{url}: no whole answer within {deadline:g} s", "timeout")
            if not 200 <= r.status_code < 300:
                raise FetchError(f"{url}: HTTP {r.status_code}: "
                                 f"{shown(bytes(body[:4 * SHOWN]).decode('utf-8', 'replace'))}", "http")
            return bytes(body)
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
        # reading r.raw raises urllib3's own errors (a read timeout, a cut body), not requests'
        timeout = isinstance(e, (requests.Timeout, urllib3.exceptions.TimeoutError))
        raise FetchError(f"cannot reach {url} ({type(e).__name__})", "timeout" if timeout else "unreachable") \
            from None
