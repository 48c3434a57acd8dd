"""Exceptions raised by ``springback.storage``.

One hierarchy, rooted at :class:`StorageError`. Every error names the URI (and,
where there is one, the shard file) it is about, so an operator can act on the
message alone. Callers that map to gRPC status codes should use:

- :class:`CheckpointNotFound` -> NOT_FOUND
- :class:`CheckpointExists` -> ALREADY_EXISTS
- :class:`CorruptCheckpoint`, :class:`CheckpointMismatch` -> FAILED_PRECONDITION (the data is there but bad or not this state's)
- :class:`TransientStorageError` / :class:`CommitTimeout` -> UNAVAILABLE
- anything else -> INTERNAL
"""

from __future__ import annotations


class StorageError(Exception):
    """Base of every error raised by springback.storage."""

    def __init__(self, message: str, *, uri: str | None = None) -> None:
        super().__init__(message)
        self.uri = uri


class TransientStorageError(StorageError):
    """A storage call kept failing with retryable errors until its retry budget ran out."""


class TransientReadError(TransientStorageError):
    """One read of a checkpoint failed with a transient error (classified where
    its cause chain was intact, before DCP gathered it from its rank); the whole
    read may be tried again. Raised by the restore's readers, retried by the
    restore within the store's retry policy, never seen by its callers."""


class CheckpointNotFound(StorageError):
    """No committed checkpoint exists where one was asked for."""


class CheckpointExists(StorageError):
    """A write into a checkpoint directory that is committed, or a file that
    another writer already created (commits are create-only).

    Raised instead of overwriting: a committed checkpoint is never written again.
    Typical causes: two writers of the same step and generation (a duplicate
    rank, two jobs sharing a checkpoint directory).
    """


class CheckpointMismatch(StorageError):
    """A committed checkpoint does not hold the entries the caller's state needs
    (a different model, or state that was never saved). Nothing was loaded."""


class CorruptCheckpoint(StorageError):
    """A committed checkpoint failed verification.

    ``problems`` lists one human-readable line per bad file, each naming the file.
    """

    def __init__(self, message: str, *, uri: str | None = None, problems: list[str] | None = None) -> None:
        super().__init__(message, uri=uri)
        self.problems = list(problems or [])


class CommitTimeout(StorageError):
    """The committing rank did not see every rank's shard become durable in time.

    The checkpoint stays partial (no manifest); the previous committed one is untouched.
    ``missing_ranks`` names the ranks whose done-record never appeared.
    """

    def __init__(self, message: str, *, uri: str | None = None, missing_ranks: list[int] | None = None) -> None:
        super().__init__(message, uri=uri)
        self.missing_ranks = list(missing_ranks or [])
