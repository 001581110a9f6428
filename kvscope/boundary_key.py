"""The key of the proxy's message-boundary hashes: where it comes from, and the id spans carry.

Boundary hashes (:func:`kvscope.collector.proxy.telemetry.chain_boundary`) are keyed blake2b, so
that a store alone cannot confirm a guessed prompt: without the key, hashing a guess gives
nothing to compare. Every proxy writing one store must hash with the same key, or a turn's
hashes cannot be compared with its previous turn's; and a key that changed (a restart with a new
one) must never make a conversation look edited. So each turn span records the key's *id*
(:func:`key_id_of`: a keyed hash of a constant, never the key nor a plain hash of it), and the
ledger compares boundary hashes only between turns with the same id; across ids the history is
``unknown``, not ``edited``.

Where the key comes from (:func:`resolve_boundary_key`):

* ``boundary_hash_key_file`` (``--boundary-hash-key-file``, ``KVSCOPE_BOUNDARY_HASH_KEY_FILE``):
  a file a fleet distributes to every proxy that writes one store. It must exist (a typo must
  not quietly give one proxy a key of its own).
* otherwise a file created once under the user's state directory
  (``$XDG_STATE_HOME/kvscope/boundary-hash.key``, ``~/.local/state/kvscope/...``), so a
  restarted proxy keeps its key; its creation is logged.
* when that file cannot be created (a read-only home), a key for this process only, with a
  warning: serving goes on, and turns across a restart read ``unknown`` history.

A key file holds the key as hex (16 to 64 bytes: ``openssl rand -hex 32``), mode 0600.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvscope import settings
from kvscope.errors import SettingError
from kvscope.files import read_limited

logger = logging.getLogger(__name__)

# Bytes of a new key; blake2b takes keys of up to 64 bytes.
KEY_BYTES = 32
MIN_KEY_BYTES, MAX_KEY_BYTES = 16, 64
# Hex characters of a key id: 48 bits, so two keys of one store do not share an id by chance.
KEY_ID_HEX = 12
# Hex characters of a boundary hash (64 bits: plenty to tell edited history from a continuation).
HASH_HEX = 16
DEFAULT_KEY_FILE = "boundary-hash.key"
_KEY_ID_MESSAGE = b"kvscope boundary hash key id"
EPHEMERAL = "ephemeral"
# A key file is one line of at most 128 hex characters; anything far larger is not a key file.
MAX_KEY_FILE_BYTES = 4096


def key_id_of(secret: bytes) -> str:
    """The id spans carry for a key: a MAC of a constant under it (reveals nothing of the key)."""
    return hashlib.blake2b(_KEY_ID_MESSAGE, key=secret, digest_size=KEY_ID_HEX // 2).hexdigest()


class BoundaryKey:
    """A boundary-hash key, its id, and where it came from (a file, or ``ephemeral``)."""

    __slots__ = ("_blank", "key_id", "secret", "source")

    def __init__(self, secret: bytes, source: str = EPHEMERAL) -> None:
        if not MIN_KEY_BYTES <= len(secret) <= MAX_KEY_BYTES:
            raise ValueError(f"a boundary hash key has {MIN_KEY_BYTES} to {MAX_KEY_BYTES} "
                             f"bytes, not {len(secret)}")
        self.secret = secret
        self.source = source
        self.key_id = key_id_of(secret)
        # Keyed once: a copy per message is cheaper than keying each hash (~1.0 vs 2.0 µs).
        self._blank = hashlib.blake2b(digest_size=HASH_HEX // 2, key=secret)

    @classmethod
    def ephemeral(cls) -> BoundaryKey:
        """A random key for this process only (its hashes compare with nothing after it)."""
        return cls(secrets.token_bytes(KEY_BYTES))

    def hasher(self) -> hashlib.blake2b:
        """A fresh keyed blake2b (64-bit digest) to feed one boundary."""
        return self._blank.copy()

    def hash_token_ids(self, token_ids: Sequence[int]) -> str:
        """Keyed hash of a run of token ids: the engine hooks' check that the KV a read loads
        is the prompt's own (``kvscope.kv.tokens_hash``). On vLLM's scheduler thread, so the
        ids are hashed as Python does a tuple of ints (~7 ns a token here, against ~35 for
        packing them into bytes first), and that 64-bit value is keyed: the store cannot
        confirm a guessed prompt without the key. Compare only under one
        :attr:`token_hash_key_id` (it names the Python the tuple hash comes from)."""
        hasher = self._blank.copy()
        hasher.update(hash(tuple(token_ids)).to_bytes(8, "little", signed=True))
        hasher.update(len(token_ids).to_bytes(8, "little"))
        return hasher.hexdigest()

    @property
    def token_hash_key_id(self) -> str:
        """The key's id for token hashes: the key, and the tuple hash's Python."""
        return f"{self.key_id}.py{sys.version_info[0]}{sys.version_info[1]}"

    def __reduce__(self) -> tuple[type[BoundaryKey], tuple[bytes, str]]:
        return BoundaryKey, (self.secret, self.source)

    def __repr__(self) -> str:  # never the secret
        return f"BoundaryKey(id={self.key_id}, source={self.source!r})"


def state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """kvscope's folder under the user's state directory (XDG Base Directory)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "kvscope"


def read_key_file(path: Path) -> BoundaryKey:
    """The key in ``path`` (hex); :class:`SettingError` naming the file when it is unusable."""
    if not os.path.lexists(path):
        raise SettingError(
            f"boundary hash key file {path} does not exist: create it once (openssl rand -hex "
            f"32 > {path}) and give every proxy that writes the store the same file")
    data = read_limited(path, MAX_KEY_FILE_BYTES, "boundary hash key file", SettingError)
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError as exc:
        raise SettingError(f"boundary hash key file {path}: cannot read it ({exc})") from None
    try:
        secret = bytes.fromhex(text)
        key = BoundaryKey(secret, str(path))
    except ValueError as exc:
        raise SettingError(f"boundary hash key file {path}: not a key of {MIN_KEY_BYTES} to "
                           f"{MAX_KEY_BYTES} bytes in hex ({exc})") from None
    try:
        if path.stat().st_mode & 0o077:
            logger.warning("boundary hash key file %s is readable by other users (chmod 600 "
                           "it): anyone who reads it and a store can test guessed prompts", path)
    except OSError:
        pass
    return key


def create_key_file(path: Path) -> BoundaryKey:
    """The key in ``path``, created (mode 0600) if there is none yet.

    Written to a temporary file and linked into place, so two proxies starting at once end up
    with the one key that won, never a half-written file.
    """
    if path.exists():
        return read_key_file(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.write(secrets.token_bytes(KEY_BYTES).hex() + "\n")
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            return read_key_file(path)  # another process created it first: use its key
    finally:
        try:
            os.unlink(temporary)
        except OSError:
            pass
    key = read_key_file(path)
    logger.warning("kvscope: created the boundary hash key %s (id %s); proxies that write one "
                   "store need the same key: set %s on each", path, key.key_id,
                   settings.SETTINGS["boundary_hash_key_file"].env_var)
    return key


def _check_state_dir(path: Path) -> None:
    """Refuse a symlink at the default key path; warn of a state folder others can write.

    Nobody names the default path, so a symlink there was planted: following it would hash
    with (or create) a key where someone else chose. A folder others may write lets them
    replace the key between runs.
    """
    if path.is_symlink():
        raise SettingError(
            f"boundary hash key file {path} is a symlink, and nobody configured it: refusing "
            f"to follow it; remove it, or set {settings.SETTINGS['boundary_hash_key_file'].env_var}"
            " to the key file you mean")
    try:
        mode = path.parent.stat().st_mode
    except OSError:
        return  # not created yet: create_key_file makes it 0700
    if mode & 0o022:
        logger.warning("kvscope: the boundary hash key folder %s is writable by other users "
                       "(chmod 700 it): they can replace the key", path.parent)


def resolve_boundary_key(explicit: str | None = None,
                         environ: Mapping[str, str] | None = None) -> BoundaryKey:
    """The key a proxy that stores spans hashes with (see the module docstring for the order)."""
    configured = settings.resolve("boundary_hash_key_file", explicit, environ)
    if configured:
        return read_key_file(Path(configured).expanduser())
    path = state_dir(environ) / DEFAULT_KEY_FILE
    _check_state_dir(path)
    try:
        return create_key_file(path)
    except OSError as exc:
        logger.warning("kvscope: cannot create the boundary hash key file %s (%s); hashing with "
                       "a key for this process only (turns across a restart read history "
                       "'unknown'); set %s to a key file", path, exc,
                       settings.SETTINGS["boundary_hash_key_file"].env_var)
        return BoundaryKey.ephemeral()


__all__ = ["BoundaryKey", "DEFAULT_KEY_FILE", "EPHEMERAL", "HASH_HEX", "KEY_BYTES", "KEY_ID_HEX",
    "MAX_KEY_BYTES", "MAX_KEY_FILE_BYTES", "MIN_KEY_BYTES", "create_key_file", "key_id_of",
    "read_key_file", "resolve_boundary_key", "state_dir"]
