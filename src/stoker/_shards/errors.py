"""Every exception type of `stoker.shards` and of the layers under it, in one module.

The public ones (`StoreError`, `MissingObjectError`, `AccessDeniedError`, `CacheFullError`,
`CorruptShardError`, and the index's `MissingIndexError`, `MalformedIndexError`) subclass the
built-in errors users already catch (`OSError`, `FileNotFoundError`, `PermissionError`,
`ValueError`) and name the URL or file; `stoker.shards` re-exports them. The others are how the
client layer says what a failed attempt means to `Store`'s retries (`Transient`,
`RangeNotSatisfiable`, `SizeMismatch`) and to a relayed request (`Relayed`, `OwnerGone`).
Those that carry arguments pickle with them, so a worker's error crosses to the main process.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "INDEX_NAME",
    "AccessDeniedError",
    "CacheFullError",
    "CorruptShardError",
    "MalformedIndexError",
    "MissingIndexError",
    "MissingObjectError",
    "OwnerGone",
    "RangeNotSatisfiable",
    "Relayed",
    "SizeMismatch",
    "StoreError",
    "Transient",
]

# The index's name at a prefix (named here for MissingIndexError's message).
INDEX_NAME = "stoker-index.json"


class _AtURL(OSError):
    """The store errors' common part: the message is `url: reason`, both kept as attributes,
    and the error pickles as (url, reason), so that a worker's error crosses to the main
    process. Put first among the bases, before the built-in error it specialises (all are
    OSErrors)."""

    url: str
    reason: str

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason

    def __reduce__(self) -> tuple[Any, tuple[str, ...]]:
        return type(self), (self.url, self.reason)


class StoreError(_AtURL):
    """A request to the store failed after its retries; the message names the URL.

    It can also be made from its message alone, `StoreError(str(error))`, as generic code
    rebuilds an exception (torch's worker-error wrapper): then `url` is "" and `reason` is
    the message.

    Args:
        url: The object's (or prefix's) URL; or, without `reason`, the whole message.
        reason: What went wrong, last cause included; None when `url` is the whole
            message. Defaults to None.
    """

    def __init__(self, url: str, reason: str | None = None) -> None:
        if reason is None:
            OSError.__init__(self, url)
            self.url = ""
            self.reason = url
        else:
            super().__init__(url, reason)

    def __reduce__(self) -> tuple[Any, tuple[str, ...]]:
        if not self.url:  # made from a whole message
            return type(self), (self.reason,)
        return super().__reduce__()


class MissingObjectError(_AtURL, FileNotFoundError):
    """The object is not in the store; the message names its URL.

    Args:
        url: The object's URL.
        reason: What the store said. Defaults to "no such object".
    """

    def __init__(self, url: str, reason: str = "no such object") -> None:
        super().__init__(url, reason)


class AccessDeniedError(_AtURL, PermissionError):
    """The store refused access to the object; the message names its URL.

    Args:
        url: The object's URL.
        reason: What the store said. Defaults to "access denied".
    """

    def __init__(self, url: str, reason: str = "access denied") -> None:
        super().__init__(url, reason)


class Transient(Exception):
    """A failure worth another attempt (raised by the backends for a short body)."""


class Relayed(Exception):
    """An exception raised by the client of the process that made this one's request (see
    `relay`), as `classify` judged it there.

    Made from its message alone (`Relayed(str(error))`, as generic code rebuilds an
    exception), it is "fatal": nothing says that another attempt could help.

    Args:
        kind: "missing", "denied", "transient" or "fatal"; or, without `text`, the message.
        text: The original exception's type and message; None when `kind` is the message.
            Defaults to None.
    """

    def __init__(self, kind: str, text: str | None = None) -> None:
        if text is None:
            kind, text = "fatal", kind
        super().__init__(text)
        self.kind = kind

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return type(self), (self.kind, str(self))


class OwnerGone(Exception):
    """The process that made this process's requests (see `relay`) has exited: asking again
    cannot help."""


class RangeNotSatisfiable(Exception):
    """The store answered 416: the range starts at or past the object's end."""


class SizeMismatch(Exception):
    """The object is not the size the caller expected: not worth another attempt."""


class MissingIndexError(MissingObjectError):
    """There is no `stoker-index.json` at the prefix; the message says how to build it.

    Args:
        url: The prefix.
        reason: The whole message; None words it as above. Defaults to None.
    """

    def __init__(self, url: str, reason: str | None = None) -> None:
        if reason is None:
            reason = (
                f"no {INDEX_NAME} at {url}: build it once with `stoker index {url}` "
                f"(or stoker.shards.build_index({url!r}))"
            )
        FileNotFoundError.__init__(self, reason)
        self.url = url
        self.reason = reason  # (url, reason) rebuild it, as MissingObjectError's do


class MalformedIndexError(ValueError):
    """An index that is not what stoker writes: the message names the URL and what is wrong."""


class CacheFullError(OSError):
    """The cache cannot make room for a shard: what it holds is pinned or being downloaded,
    and stayed so until the timeout. The message names the folder, the cap, the bytes in
    use and pinned, and the shard's size."""


class CorruptShardError(OSError):
    """A shard's bytes do not parse as what its index says they are (a tar cut short, a
    header whose checksum does not match, a sample range holding no sample or two), or a
    whole shard's checksum does not match the index. The message names the shard and, where
    known, the sample."""
