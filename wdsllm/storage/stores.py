"""Which store a URL is in: the key that stores' speeds and counters are kept under. A leaf."""

from __future__ import annotations


def store_of(url: str) -> tuple[str, str]:
    """The store a URL names, as its speed and its counters are kept: (scheme, host and port,
    without a user name or password). The host of s3:// and gs:// is a bucket, of az:// a
    container; of hf:// the repository (``datasets/ORG/NAME``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return ("file", "")
    host = rest.split("/", 1)[0].rsplit("@", 1)[-1].split("?", 1)[0]
    if scheme == "hf":  # hf://datasets/ORG/NAME@REV/...: one repository
        host = "/".join(rest.split("/", 3)[:3]).split("@", 1)[0]
    return (scheme.lower(), host.lower())
