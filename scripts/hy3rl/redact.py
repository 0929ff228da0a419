"""Redaction of secrets (tokens, API keys, passwords) for everything the report writes, and
for the config the report rule receives (rule params are copied into `snakemake --report`'s
record). Standard library only, so that rules can import it cheaply.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

SECRET_KEY_RE = re.compile(r"(?i)(token|secret|password|passwd|api[_-]?key|credential)")
# Names that match SECRET_KEY_RE but are counts/settings, not secrets (tokenizer paths,
# token budgets such as ppo_max_token_len_per_gpu, TOKENIZERS_PARALLELISM).
NOT_SECRET_KEY_RE = re.compile(
    r"(?i)(tokeniz|tokens\b|token_?(len|length|count|num|ids?|budget|level|mean|sum)"
    r"|(max|num|total|min)_?(new_)?tokens?)"
)
SAFE_HEX_KEY_RE = re.compile(r"(?i)(commit|sha|head|rev)")
REDACTED = "[REDACTED]"
_TOKEN_PATTERNS = (
    re.compile(r"\bhf_[A-Za-z0-9]{16,}"),  # Hugging Face tokens
    re.compile(r"\bsk-[A-Za-z0-9_\-]{16,}"),  # OpenAI-style keys
    re.compile(r"\bwandb_v\d+_[A-Za-z0-9_]{16,}"),  # newer W&B keys
)
# KEY=value / "key": value in free text (logs, exit reasons, Hydra overrides, YAML).
# The key starts where a run of key characters starts (the lookbehind): the same matches
# as without it (a key found inside a run is also found from the run's start, further
# left), but a long run with no secret name in it (base64, a hash list) is scanned once,
# not once from each of its characters (quadratic: seconds a report).
_KV = re.compile(
    r"(?<![A-Za-z0-9_.\-])"
    r"(?P<key>[A-Za-z0-9_.\-]*(?i:token|secret|password|passwd|api[_-]?key|credential)"
    r"[A-Za-z0-9_]*)(?P<sep>['\"]?\s*[=:]\s*['\"]?)(?P<val>[^\s'\",}<&]{4,})"
)
_HEX40 = re.compile(r"(?<![0-9A-Fa-f])[0-9a-fA-F]{40}(?![0-9A-Fa-f])")


def _is_plain_number(value: Any) -> bool:
    return isinstance(value, bool | int | float) or value is None


def is_secret_key(key: str) -> bool:
    """A config key or environment variable name whose (string) value is a secret."""
    return bool(SECRET_KEY_RE.search(key)) and not NOT_SECRET_KEY_RE.search(key)


def _plausible_secret(value: str) -> bool:
    v = value.strip()
    if v == REDACTED:  # already redacted (e.g. the config the report rule receives)
        return False
    return len(v) >= 6 and not re.fullmatch(r"[\d.]+|(?i:true|false|none|null|yes|no)", v)


class Redactor:
    """Replaces secrets by ``[REDACTED]`` in strings and (recursively) in JSON-like data.

    ``secrets``: exact values to remove wherever they appear (from the environment and the
    config, under secret-looking names). ``allowed_hex``: 40-hex strings known to be git
    SHAs (any other 40-hex string looks like a W&B key and is removed).
    """

    def __init__(self, secrets: Iterable[str] = (), allowed_hex: Iterable[str] = ()):
        self.secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)
        self.allowed_hex = {h.lower() for h in allowed_hex}

    def text(self, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        out = value
        for secret in self.secrets:
            out = out.replace(secret, REDACTED)
        for pat in _TOKEN_PATTERNS:
            out = pat.sub(REDACTED, out)
        out = _KV.sub(self._kv, out)
        return _HEX40.sub(
            lambda m: m.group(0) if m.group(0).lower() in self.allowed_hex else REDACTED, out
        )

    @staticmethod
    def _kv(m: re.Match[str]) -> str:
        key, val = m.group("key"), m.group("val")
        if not is_secret_key(key.rsplit(".", 1)[-1]) or not _plausible_secret(val) or (
            val.startswith(REDACTED)
        ):
            return m.group(0)
        return m.group("key") + m.group("sep") + REDACTED

    def __call__(self, obj: Any, key: str = "") -> Any:
        if isinstance(obj, Mapping):
            return {self.text(str(k)): self(v, str(k)) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [self(v, key) for v in obj]
        if key and is_secret_key(key) and not _is_plain_number(obj):
            return REDACTED
        return self.text(obj)

    def check_bytes(self, name: str, blob: bytes) -> None:
        """Raise if an exact secret value is in ``blob`` (the last gate before writing)."""
        for secret in self.secrets:
            if secret.encode() in blob:
                raise RuntimeError(f"report: a secret value would be written to {name}; refusing")


def _collect(obj: Any, key: str, secrets: set[str], hexes: set[str]) -> None:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _collect(v, str(k), secrets, hexes)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _collect(v, key, secrets, hexes)
    elif isinstance(obj, str):
        if key and is_secret_key(key):
            if _plausible_secret(obj):
                secrets.add(obj)
        elif key and SAFE_HEX_KEY_RE.search(key) and _HEX40.fullmatch(obj.strip()):
            hexes.add(obj.strip())


def make_redactor(
    env: Mapping[str, str], sources: Iterable[Any], extra_env_names: Iterable[str] = ()
) -> Redactor:
    """Secrets: env values under secret-looking names (or named in ``extra_env_names``) and
    secret-keyed strings in ``sources``; allowed 40-hex: values of commit/sha keys."""
    secrets: set[str] = set()
    hexes: set[str] = set()
    extra = set(extra_env_names)
    for name, value in env.items():
        if (is_secret_key(name) or name in extra) and _plausible_secret(value):
            secrets.add(value)
    for src in sources:
        _collect(src, "", secrets, hexes)
    hexes -= secrets
    return Redactor(secrets, hexes)


def redact_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with the values under secret-looking keys (and secret-looking strings)
    replaced by ``[REDACTED]``; git SHAs under commit/sha keys are kept."""
    return make_redactor({}, [config])(config)
