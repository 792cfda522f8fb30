"""Credentials taken out of URLs before reflow shows or writes them (`endpoints.json`, the console):
a password, a user name that may be a token, and query parameters named like secrets."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "***"
# query parameters whose values are credentials (`?token=`, `?access_token=`, S3's `X-Amz-Signature`, ...)
SECRET_PARAMETER_WORDS = ("token", "password", "passwd", "secret", "key", "auth", "signature", "credential")


def redact_url(url: str) -> str:
    """`url` with its credentials replaced by `***`: the password of `user:password@` (the user
    stays), a lone `token@` whole, and the values of secret-looking query parameters. Text that is
    no URL comes back as it is."""
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        return url
    userinfo, at, host = parts.netloc.rpartition("@")
    if at:
        user, colon, _password = userinfo.partition(":")
        userinfo = f"{user}:{REDACTED}" if colon else REDACTED
    query = parts.query
    parameters = parse_qsl(query, keep_blank_values=True)
    if any(_is_secret(name) for name, _ in parameters):
        shown = [(name, REDACTED if _is_secret(name) else value) for name, value in parameters]
        query = urlencode(shown, safe="*")
    return urlunsplit(parts._replace(netloc=f"{userinfo}{at}{host}", query=query))


def _is_secret(parameter: str) -> bool:
    return any(word in parameter.lower() for word in SECRET_PARAMETER_WORDS)
