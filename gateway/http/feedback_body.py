"""The body of `POST /v1/feedback` as feedback items: one JSON object, a JSON array of them, or
NDJSON (one object per line, read as it arrives, so a large backfill never sits in memory). A JSON
body, and each NDJSON line, may be REFLOW_MAX_REQUEST_BYTES at most."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import Request

from feedback.events import InvalidFeedback
from gateway.intake import Item
from reflow.errors import InvalidArgument, RequestTooLarge

NDJSON = "application/x-ndjson"
NDJSON_TYPES = (NDJSON, "application/jsonl", "application/x-jsonlines")


async def feedback_items(request: Request, max_bytes: int) -> AsyncIterator[Item]:
    """The items of the body, by its content type (and a JSON body that turns out to be lines of
    objects is taken as NDJSON); InvalidArgument for a body that is neither, RequestTooLarge (413)
    for a JSON body or line over `max_bytes`."""
    content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if content_type in NDJSON_TYPES:
        async for line in _lines(request, max_bytes):
            yield _item(line)
        return
    body = await _whole(request, max_bytes)
    try:
        data = json.loads(body)
    except RecursionError:
        raise InvalidArgument("the body nests JSON too deeply to be feedback") from None
    except json.JSONDecodeError as error:
        if error.msg != "Extra data":  # not JSON at all
            raise InvalidArgument(
                f"the body is not JSON ({error.msg} at character {error.pos}); send one feedback object, "
                f"a JSON array of them, or one object per line as {NDJSON}"
            ) from None
        for line in body.splitlines():
            if line.strip():
                yield _item(line)
        return
    except UnicodeDecodeError:
        raise InvalidArgument("the body is not UTF-8 text") from None
    for item in data if isinstance(data, list) else [data]:
        yield item if isinstance(item, dict) else _not_an_object(item)


async def _whole(request: Request, max_bytes: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise RequestTooLarge(
                f"a JSON feedback body may be {max_bytes:,} bytes at most (REFLOW_MAX_REQUEST_BYTES); "
                f"send larger batches as {NDJSON}, which is read as it arrives"
            )
    return bytes(body)


async def _lines(request: Request, max_bytes: int) -> AsyncIterator[bytes]:
    """The non-blank lines of a streamed body."""
    pending = b""
    async for chunk in request.stream():
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
        if len(pending) > max_bytes:
            raise RequestTooLarge(
                f"a line of the {NDJSON} body is over {max_bytes:,} bytes (REFLOW_MAX_REQUEST_BYTES)"
            )
    if pending.strip():
        yield pending


def _item(line: bytes) -> Item:
    try:
        item = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return InvalidFeedback(f"the line is not JSON ({error})")
    except RecursionError:
        return InvalidFeedback("the line nests JSON too deeply to be feedback")
    return item if isinstance(item, dict) else _not_an_object(item)


def _not_an_object(item: object) -> InvalidFeedback:
    return InvalidFeedback(f"an item must be a JSON object of Feedback fields, not {type(item).__name__}")
