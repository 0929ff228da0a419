"""The one rule for a pinned revision (a git commit of deps, a hub commit of the model): a
full 40-hex lowercase commit SHA; branches, tags and short SHAs are refused because they
move or can become ambiguous. Standard library only."""

from __future__ import annotations

import re

FULL_SHA = re.compile(r"^[0-9a-f]{40}$")


def sha_problem(value: str | None, *, what: str, lowercase_as: str, full_from: str) -> str | None:
    """Why ``value`` is not an acceptable pin, or None when it is a full 40-hex SHA.
    ``what`` names the pin ("commit SHA"), ``lowercase_as`` who prints SHAs in lowercase,
    ``full_from`` how to find the full SHA of a short one or of a ref."""
    if not value:
        return f"missing; pin a full 40-hex {what}"
    if FULL_SHA.match(value):
        return None
    if re.fullmatch(r"[0-9a-fA-F]{40}", value):
        return f"{value!r} must be lowercase hex (as {lowercase_as} prints it)"
    if re.fullmatch(r"[0-9a-fA-F]{4,39}", value):
        return (f"{value!r} is a short SHA ({len(value)} characters); pin the full 40-hex "
                f"{what} ({full_from}): short SHAs can become ambiguous")
    return (f"{value!r} is not a commit SHA; branch names and tags are refused because they "
            f"move: pin the full 40-hex {what} ({full_from})")
