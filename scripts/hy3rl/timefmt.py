"""The one timestamp format of every output: ISO 8601 in UTC, to the second, with an
explicit offset (``2026-12-03T09:50:00+00:00``). Standard library only."""

from __future__ import annotations

from datetime import UTC, datetime


def utc_now() -> str:
    """Now, as every record writes it."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def parse(value: str | float | int | None) -> datetime | None:
    """A timestamp from a record (this format, a ``...Z`` one of older records, or epoch
    seconds) as an aware datetime; None when absent or unreadable."""
    if value is None:
        return None
    if isinstance(value, int | float):
        return datetime.fromtimestamp(float(value), tz=UTC)
    try:
        t = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)
