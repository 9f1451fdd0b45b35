"""The framing headers of a request's head, checked by RFC 9112 where httptools does not: pure
policy for `api.http_protocol`, which answers what it finds wrong before the request is started."""

from __future__ import annotations


def framing_problem(num_hosts: int, codings: list[bytes] | None, http_version: str) -> tuple[int, str, str] | None:
    """What is wrong with a request's `Host` headers (`num_hosts` of them) and `Transfer-Encoding`
    values (`codings`), by RFC 9112 (§3.2, §6.1): (status, message, code), or None."""
    if num_hosts > 1:
        return 400, f"a request may have one Host header, not {num_hosts}", "invalid_host_header"
    if num_hosts == 0 and http_version == "1.1":
        return 400, "an HTTP/1.1 request needs a Host header", "invalid_host_header"
    if codings is None:
        return None
    if http_version != "1.1":
        return 400, f"Transfer-Encoding is not allowed in an HTTP/{http_version} request", "invalid_transfer_encoding"
    names = [name.strip().lower() for value in codings for name in value.split(b",")]
    if names[-1] != b"chunked" or names.count(b"chunked") > 1:
        return None  # its body cannot be framed: httptools refuses it (400), as it begins
    if len(names) > 1:
        other = ", ".join(name.decode("latin-1") for name in names[:-1])
        return (501, f"transfer coding {other} is not supported: send the body with Transfer-Encoding: chunked "
                     "alone (a compressed body goes with Content-Encoding: gzip or deflate)",
                "unsupported_transfer_coding")
    return None
