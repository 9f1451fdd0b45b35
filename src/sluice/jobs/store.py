"""The durable store of batch jobs: its typed values and the `JobStore` protocol.

Two backends implement the protocol with the same semantics: `SqliteJobStore` (embedded, the
default) and `PostgresJobStore` (several hosts share one database). Everything the API
acknowledges is committed first.

    files    (id, owner, filename, purpose, bytes, content, created_at, idempotency_key, expires_at)
    file_parts (file_id, part) PRIMARY KEY, data     the rest of a file's content, in parts
    batches  (id, owner, endpoint, input_file_id, status, counters, timestamps, ...)
    items    (batch_id, idx) PRIMARY KEY, custom_id, url, body,
             state: queued ─claim─▶ leased ─record─▶ done
                      ▲                │
                      └─retry/expiry───┘

    batch:  validating ─▶ in_progress ─▶ finalizing ─▶ completed     (each step its own commit)
                 │             ├──▶ cancelling ──▶ cancelled
                 ▼             └──▶ expired      (expires_at passed; unfinished items written off)
              failed

Invariants:
- an item's result is written once: `record` updates only rows still `leased` under the caller's
  lease token, in the same statement, so a replayed or expired lease cannot write twice;
- output and error files are assembled at finalization from the item rows, in input order, in
  parts of a few MiB (one value could not hold a file past ~1 GB);
- times are wall-clock seconds (`time.time()`), because leases and expiries outlive processes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

__all__ = [
    "ACTIVE_STATUSES",
    "BatchJob",
    "BatchStatus",
    "Claim",
    "FileObject",
    "Item",
    "ItemOutcome",
    "ItemState",
    "JobStore",
    "LeftoverLine",
    "NewBatch",
    "NewItem",
    "ResultLine",
]


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"
    """Created and persisted; its input file has not been checked and expanded into items yet."""
    FAILED = "failed"
    """The input file was rejected at validation (see `errors`); no item ran."""
    IN_PROGRESS = "in_progress"
    """Items are being claimed and executed (the first ones while the rest are still being stored)."""
    FINALIZING = "finalizing"
    """Every item has an outcome; the output and error files are being assembled."""
    COMPLETED = "completed"
    """Done: `output_file_id` / `error_file_id` hold every input line exactly once."""
    EXPIRED = "expired"
    """The completion window (`expires_at`) passed first: items that finished are kept in the output
    and error files, the others are in the error file with the code `batch_expired`."""
    CANCELLING = "cancelling"
    """Cancel was asked: no new items start; those running are stopped (brief: the next housekeeping)."""
    CANCELLED = "cancelled"
    """Cancelled: finished items are in the output/error files, the rest in the error file."""


ACTIVE_STATUSES = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING,
                   BatchStatus.CANCELLING)


class ItemState(enum.StrEnum):
    QUEUED = "queued"
    """Waiting to be claimed (not before its `not_before` time, after a retry)."""
    LEASED = "leased"
    """Claimed by an executor until its lease ends; an expired lease makes it claimable again."""
    DONE = "done"
    """Its output or error line is recorded; never changes again."""


@dataclass(frozen=True, slots=True)
class FileObject:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int | None = None
    """When the file is deleted (`expires_after` at upload, a batch's `output_expires_after`); None: kept
    until the owner deletes it."""


@dataclass(frozen=True, slots=True)
class NewBatch:
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None
    created_at: int
    expires_at: int
    output_expires_after_s: int | None = None
    """The output and error files expire this long after they are written (None: kept)."""


@dataclass(frozen=True, slots=True)
class BatchJob:
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    metadata: dict[str, str] | None
    created_at: int
    expires_at: int
    num_total: int = 0
    num_completed: int = 0
    num_failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, object]] | None = None
    """Validation errors, each `{"code", "message", "param", "line"}` (line numbers from 1)."""
    output_expires_after_s: int | None = None
    """The output and error files expire this long after they are written (None: kept)."""
    cached_tokens: int = 0
    """Of `input_tokens`, those its answers said came from a prefix cache."""
    reasoning_tokens: int = 0
    """Of `output_tokens`, those its answers said a reasoning model thought with."""

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE_STATUSES


@dataclass(frozen=True, slots=True)
class NewItem:
    idx: int
    """0-based position in the input file; with the batch id, the item's unique key."""
    custom_id: str
    url: str
    body: bytes


@dataclass(frozen=True, slots=True)
class Item:
    batch_id: str
    idx: int
    custom_id: str
    url: str
    body: bytes
    attempts: int
    """Attempts already used up by earlier transient failures."""


@dataclass(frozen=True, slots=True)
class Claim:
    """Items leased to one executor until `until`; only `token` may record their outcomes."""

    token: str
    until: float
    items: tuple[Item, ...]


@dataclass(frozen=True, slots=True)
class ItemOutcome:
    """What became of one leased item.

    Final (`retry_at is None`): `line` is its output-file line (`is_error` false) or error-file line.
    Retry: the item goes back to the queue, claimable from `retry_at`, with `attempts` used up.
    """

    batch_id: str
    idx: int
    line: bytes = b""
    is_error: bool = False
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    retry_at: float | None = None
    attempts: int = 0


@dataclass(frozen=True, slots=True)
class ResultLine:
    idx: int
    line: bytes
    is_error: bool


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A Responses API answer kept for `previous_response_id` and retrieval (`api.responses`)."""

    body: bytes
    """The response object (JSON)."""
    input_items: bytes
    """The conversation's items it answered (JSON list): its predecessors' and its own input."""


@dataclass(frozen=True, slots=True)
class StoredConversation:
    """A Conversations API conversation (`api.conversations`), kept until it is deleted."""

    created_at: int
    metadata: bytes
    """Its metadata (a JSON object)."""
    items: tuple[bytes, ...] = ()
    """Its items (each a JSON object with an `id`), oldest first, when they were asked for."""


@dataclass(frozen=True, slots=True)
class ResponseRun:
    """A background response still to be answered (`jobs.background`): its response's row says
    `queued` or `in_progress` until the gateway holding this run's lease writes its end."""

    owner: str
    response_id: str
    request: bytes
    """What to run: a `RunRequest`, encoded."""
    attempts: int
    """How many times a gateway has started it (a takeover after a crash is one more)."""
    last_event: int = -1
    """The sequence number of its stream's last stored event (-1: none)."""


RUNNING = ("queued", "in_progress")
"""A background response's statuses before its end."""


class RunRequest(msgspec.Struct):
    """What a run needs, kept with it in the store so that any gateway can run it."""

    body: bytes
    """The request to POST to `/v1/responses`: the client's, in the foreground, unstored, unstreamed,
    with the whole conversation in `input` (so a predecessor deleted meanwhile does not matter)."""
    headers: list[tuple[str, str]]
    """The client's headers that shape how it runs (priority class, timeout, version, cache)."""
    response: bytes
    """The response object as it was queued: its end is this with the answer's status, output and usage."""
    stream: bool = False
    """Its events are kept, for the client that created it and those that resume its stream."""


Event = tuple[int, bytes]
"""A streamed background response's event: (sequence number, the SSE event's bytes)."""

LeftoverLine = Callable[[str], bytes]
"""The error line for an item that never ran (batch cancelled or expired), from its custom_id."""


class JobStore(Protocol):
    """Files, batches and their items, durably. `owner` scopes every client-facing lookup."""

    async def create_file(self, owner: str, filename: str, purpose: str, content: bytes, now: int,
                          idempotency_key: str | None = None, file_id: str | None = None,
                          expires_at: int | None = None) -> FileObject:
        """Store a file (id `file_id`, or a new one), deleted at `expires_at` (None: never). With a key
        already used by `owner`, the file stored then is returned instead (its id is not `file_id`)."""
        ...

    async def get_file(self, owner: str, file_id: str) -> FileObject | None: ...

    async def file_content(self, owner: str, file_id: str) -> bytes | None:
        """The whole content (an input file, to validate it)."""
        ...

    async def file_part(self, owner: str, file_id: str, part: int) -> bytes | None:
        """Part `part` of the content (0, 1, ...), None past the last: a large output file is read
        one part at a time. A part may be empty."""
        ...

    async def delete_file(self, owner: str, file_id: str) -> bool: ...

    async def delete_expired_files(self, now: int) -> int:
        """Delete every file (its content and row) whose `expires_at` is `now` or earlier; how many."""
        ...

    async def list_files(self, owner: str, purpose: str | None, after: str | None, limit: int,
                         ascending: bool = False) -> list[FileObject]:
        """The owner's files (of `purpose`, if given), newest first (`ascending`: oldest first),
        those after the file `after` in that order."""
        ...

    async def create_batch(self, batch: NewBatch, idempotency_key: str | None = None) -> BatchJob: ...

    async def get_batch(self, owner: str | None, batch_id: str) -> BatchJob | None:
        """`owner=None` is the executor's view, across owners."""
        ...

    async def find_batch(self, owner: str, idempotency_key: str) -> BatchJob | None:
        """The batch the owner created with this `Idempotency-Key`, if any."""
        ...

    async def list_batches(self, owner: str, after: str | None, limit: int) -> list[BatchJob]:
        """Newest first, those created before the batch `after`."""
        ...

    async def active_batches(self) -> list[BatchJob]: ...

    async def start_batch(self, batch_id: str, items: Sequence[NewItem], now: int,
                          num_total: int | None = None) -> bool:
        """validating -> in_progress, inserting `items` (the first of `num_total`, default all of them)
        in the same transaction; the executor inserts the rest with `add_items` while these run."""
        ...

    async def add_items(self, batch_id: str, items: Sequence[NewItem]) -> None:
        """Insert more items of a started batch, in one transaction; an item already there is kept."""
        ...

    async def num_items(self, batch_id: str) -> int:
        """How many of the batch's items are inserted (less than `num_total` while still loading)."""
        ...

    async def fail_batch(self, batch_id: str, errors: list[dict[str, object]], now: int) -> None: ...

    async def cancel_batch(self, owner: str, batch_id: str, now: int) -> BatchJob | None: ...

    async def claim(self, limit: int, lease_s: float, now: float,
                    room: Mapping[str, int] | None = None) -> Claim | None:
        """Lease up to `limit` claimable items of in-progress, unexpired batches, oldest batch first;
        at most `room[owner]` of the batches of an owner in `room` (the executor paces that tenant)."""
        ...

    async def extend_lease(self, token: str, until: float) -> None: ...

    async def record(self, token: str, outcomes: Sequence[ItemOutcome]) -> int:
        """Apply outcomes of items still leased under `token`, in one transaction; returns how many
        were applied (the others were not ours any more and are ignored)."""
        ...

    async def release_leases(self) -> int:
        """Return every leased item to the queue and every background response's run to be
        claimed (single-owner stores, at startup); how many items."""
        ...

    async def num_live_leases(self, batch_id: str, now: float) -> int: ...

    async def begin_finalizing(self, batch_id: str, now: int) -> BatchJob | None:
        """in_progress -> finalizing (`finalizing_at = now`) once every item is done, and commit it, so
        clients see it while `finalize` assembles the files; a crash in between resumes finalizing.
        Returns the finalizing batch (also when it already was), else None."""
        ...

    async def finalize(self, batch_id: str, status: BatchStatus, leftover: LeftoverLine | None,
                       now: int) -> BatchJob | None:
        """Assemble the output and error files and set the final `status`, atomically. Items not done
        get the error line `leftover(custom_id)`; without `leftover`, the call does nothing and
        returns None while some are not done. A batch already final is returned as it is."""
        ...

    async def result_lines(self, batch_id: str, after_idx: int, limit: int) -> list[ResultLine]:
        """Recorded lines (output and error) of the items after `after_idx`, in input order, up to
        the first item that has none yet: never a hole, so a reader may count lines as positions."""
        ...

    async def put_response(self, owner: str, response_id: str, created_at: int, body: bytes,
                           input_items: bytes) -> None: ...

    async def get_response(self, owner: str, response_id: str) -> StoredResponse | None: ...

    async def delete_response(self, owner: str, response_id: str) -> bool:
        """Forget a response (and its run, if it is a background response not yet answered)."""
        ...

    async def delete_responses_before(self, created_at: int) -> int:
        """Forget responses created before `created_at` (their retention is over); how many."""
        ...

    async def create_conversation(self, owner: str, conversation_id: str, created_at: int, metadata: bytes,
                                  items: Sequence[tuple[str, bytes]]) -> None:
        """Keep a new conversation with its first `items` ((id, JSON) each)."""
        ...

    async def get_conversation(self, owner: str, conversation_id: str,
                               with_items: bool = False) -> StoredConversation | None: ...

    async def update_conversation(self, owner: str, conversation_id: str, metadata: bytes) -> bool:
        """Replace its metadata; False if there is no such conversation of `owner`'s."""
        ...

    async def delete_conversation(self, owner: str, conversation_id: str) -> bool:
        """Forget a conversation and its items."""
        ...

    async def add_conversation_items(self, owner: str, conversation_id: str,
                                     items: Sequence[tuple[str, bytes]]) -> bool:
        """Append `items` ((id, JSON) each) in order, after any appended before, by any gateway;
        False if there is no such conversation of `owner`'s."""
        ...

    async def delete_conversation_item(self, owner: str, conversation_id: str, item_id: str) -> bool:
        """Take an item out of a conversation; False if it has no such item (or there is no such conversation)."""
        ...

    async def put_response_run(self, owner: str, response_id: str, created_at: int, body: bytes, input_items: bytes,
                               request: bytes, token: str, lease_until: float, events: Sequence[Event] = ()) -> None:
        """Store a background response (`body` says queued), its run, leased to `token` (started: its
        first attempt; "": left for any gateway to claim), and the first `events` of its stream, at once."""
        ...

    async def update_response_run(self, response_id: str, token: str, body: bytes | None, *, is_final: bool,
                                  events: Sequence[Event] = ()) -> bool:
        """Write a running response's new `body` (None: keep it) and more `events` of its stream
        if `token` still holds its run (else nothing, False); `is_final`: the run ends with it."""
        ...

    async def num_response_runs(self, owner: str) -> int:
        """How many of the owner's background responses are not answered yet (queued or running)."""
        ...

    async def response_events(self, owner: str, response_id: str, after: int, limit: int) -> list[Event]:
        """The owner's background response's stream events after sequence number `after`, in order."""
        ...

    async def cancel_response_run(self, owner: str, response_id: str, body: bytes) -> bool:
        """End the owner's running response with `body` (cancelled) whoever holds it; False if it
        has no run any more (answered, cancelled or deleted already)."""
        ...

    async def renew_response_runs(self, token: str, response_ids: Sequence[str], lease_until: float) -> set[str]:
        """Extend the leases `token` holds on these runs; the ids it still holds (a run cancelled
        or deleted meanwhile is not among them)."""
        ...

    async def claim_response_runs(self, token: str, now: float, lease_until: float, limit: int) -> list[ResponseRun]:
        """Lease to `token` up to `limit` runs whose lease ran out before `now` (their gateway
        stopped), counting one more attempt each."""
        ...

    async def aclose(self) -> None: ...
