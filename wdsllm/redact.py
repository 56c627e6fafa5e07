"""Keeping secrets out of messages: a leaf that imports nothing of wdsllm, so that the error root
and every room can use it.

A URL may carry secrets: a password in its userinfo (``https://user:pa55@host/ds/``) or a token in
its query string (an Azure SAS, a signed CDN URL). :func:`redact` removes both from a URL and
:func:`redact_text` from any text that embeds URLs; every message, log line and error that names a
URL goes through them.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_HIDDEN = "***"
#: URLs inside text: a scheme, "://", then anything up to whitespace or a quote.
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def redact(url: str) -> str:
    """``url`` with its userinfo password and its query string replaced by ``***``.

    ``https://user:pa55@host/ds/?sig=x`` becomes ``https://user:***@host/ds/?***``: the user name
    and the path stay (they say which dataset), the secrets do not. Local paths and ``pipe:``
    commands come back unchanged (the user typed them; a command is not a URL).
    """
    if not isinstance(url, str) or "://" not in url or url.startswith("pipe:"):
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return _HIDDEN
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}{':' + _HIDDEN if colon else ''}@{host}"
    query = _HIDDEN if parts.query else ""
    if netloc == parts.netloc and not query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """``text`` with every URL in it redacted (library messages quote the URLs they fetched)."""
    if not isinstance(text, str) or "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)
