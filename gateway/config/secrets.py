"""Reading the secrets and files a policy points at: upstream credentials, client API keys, CA
bundles.

They are read while the policy is validated (at startup, by `gateway check`, and again on every
reload, so a rotated Kubernetes Secret file is picked up by a reload), and kept in private
attributes of the policy models: never dumped, never in a repr, but part of the models'
equality, so a reload sees a rotated secret as a changed pool. Error messages name the variable
or the file, never a value.
"""

from __future__ import annotations

import os
import re
import ssl
from pathlib import Path

# What may not appear in a header value (HTTP/1.1 field values: no CR, LF, NUL or other
# controls; a tab is allowed).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _read_text(path: str, what: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{what} {path!r} does not exist") from None
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path!r} is not UTF-8 text") from None


def _env(name: str, what: str) -> str:
    value = os.environ.get(name)
    if value is None or not value.strip():
        raise ValueError(f"environment variable {name} ({what}) is not set or empty")
    return value


def secret_value(from_env: str | None, from_file: str | None) -> str:
    """One credential, from an environment variable or a file (a Kubernetes Secret mounted as
    a file ends with a newline: surrounding whitespace is dropped)."""
    if from_env is not None:
        value = _env(from_env, "the pool's credential").strip()
        where = f"environment variable {from_env}"
    else:
        assert from_file is not None
        value = _read_text(from_file, "credential file").strip()
        where = f"credential file {from_file!r}"
    if not value:
        raise ValueError(f"{where} is empty")
    if _CONTROL.search(value):
        raise ValueError(f"{where} holds control characters: not a valid header value")
    if not value.isascii():
        # Header values go out as bytes; a character outside ASCII would fail every request.
        raise ValueError(f"{where} holds characters outside ASCII: not a valid header value")
    return value


def api_keys(from_env: str | None, from_file: str | None) -> tuple[str, ...]:
    """Client API keys: one a line (blank lines and `#` comments ignored); in an environment
    variable, commas separate keys too."""
    if from_env is not None:
        text = _env(from_env, "client API keys").replace(",", "\n")
        where = f"environment variable {from_env}"
    else:
        assert from_file is not None
        text = _read_text(from_file, "API key file")
        where = f"API key file {from_file!r}"
    keys = []
    for line in text.splitlines():
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if _CONTROL.search(key) or " " in key:
            raise ValueError(f"{where}: a key holds spaces or control characters")
        keys.append(key)
    if not keys:
        raise ValueError(f"{where} holds no key")
    return tuple(dict.fromkeys(keys))


def ca_bundle(path: str) -> str:
    """A PEM bundle of CA certificates, checked to load."""
    pem = _read_text(path, "CA file")
    try:
        ssl.create_default_context(cadata=pem)
    except (ssl.SSLError, ValueError):
        raise ValueError(f"CA file {path!r} holds no valid PEM certificate") from None
    return pem
