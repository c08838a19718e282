"""Session state beside the KV blocks: what a restarted cloud, or another replica sharing the
store, needs to serve a session's next turn without the edge resending what the store holds.

A session is kept as one *record* and its activations as *pieces*:

* record ``sess/<blake3(session key)>``: JSON of the session's prompt token ids, split layer,
  KV block size, Merkle leaves (hex) and the keys of its activation pieces, in order.
* piece ``act/<blake3(session key)[:16]>/<blake3(session key || piece bytes)>``: float32
  activations ``[n, H]`` of tokens ``[i * B, i * B + n)``, ``n <= B`` (the block size), the last
  one possibly partial. The key commits to the session (its first part groups a session's record
  and pieces: ``kvstore.slot_tag``) and to the bytes: a loaded piece is re-hashed and a mismatch is
  a piece the cloud lacks.

Both are sealed by the store as well (``cloud.store.blocks``: a flipped bit reads as a miss). A
session loads as the longest prefix whose pieces all verify: its token ids and activations are
cut there, and its leaves to the full blocks inside that prefix; the edge learns what is missing
through ``SyncSession`` and resends only that. The KV blocks named by the leaves live in the same
store under their own keys; one that is missing is recomputed by the engine, never guessed.

Who calls: the gateway saves after every committed turn and loads on a turn or a sync for a
session its memory table does not hold.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import blake3
import numpy as np

from tandem.cloud.sessions.table import CloudSession
from tandem.cloud.store.blocks import BlockStore

RECORD_VERSION = 1
log = logging.getLogger("tandem.cloud")


def record_key(session_key: str) -> str:
    """Store key of a session's record (its id is hashed: ids never appear in the store's keys)."""
    return "sess/" + blake3.blake3(session_key.encode()).hexdigest()


def piece_key(session_key: str, data: bytes) -> str:
    """Store key of an activation piece: the session's hash as in ``record_key`` (first 16 hex
    digits: ``kvstore.slot_tag`` keeps a session's record and pieces together), then a BLAKE3
    commitment to the session and the piece's bytes."""
    h = blake3.blake3(session_key.encode() + b"\x00")
    h.update(data)
    return "act/" + blake3.blake3(session_key.encode()).hexdigest()[:16] + "/" + h.hexdigest()


@dataclass
class Loaded:
    """A session read back from the store: ``session`` holds the verified prefix; ``stored_tokens``
    is how many tokens the record named (more than ``len(session.token_ids)`` when a piece was lost)."""

    session: CloudSession
    stored_tokens: int


class SessionStore:
    """Saves and loads ``CloudSession`` state in a ``BlockStore`` (see module doc)."""

    def __init__(self, store: BlockStore, hidden_size: int) -> None:
        self.store, self.hidden_size = store, hidden_size

    def save(self, session_key: str, s: CloudSession, first_new_token: int) -> None:
        """Write the pieces from the one holding ``first_new_token`` on (earlier ones are in the
        store since the turn that wrote them; one that was lost since loads as missing), then the
        record: a reader sees the old record or the new one, each written after its pieces. Pieces
        of the old record that the new one no longer names are deleted.

        Raises:
            EngineError: a shared store could not be written.
        """
        if s.hidden is None or not s.token_ids or not s.block_tokens:
            return
        bs = s.block_tokens
        old = self._record(session_key)
        old_pieces: list[str] = old.get("pieces", []) if old else []
        pieces: list[str] = []
        for i in range(-(-len(s.token_ids) // bs)):
            data = np.ascontiguousarray(s.hidden[i * bs : (i + 1) * bs], np.float32).tobytes()
            key = piece_key(session_key, data)
            if i < first_new_token // bs:
                self.store.touch(key)  # in the store since an earlier turn: keep it as recent as the record
            elif not self.store.contains(key):
                self.store.put(key, data)
            pieces.append(key)
        record = {
            "v": RECORD_VERSION,
            "k": s.split_layer,
            "bs": bs,
            "tokens": s.token_ids,
            "leaves": [leaf.hex() for leaf in s.leaves],
            "pieces": pieces,
        }
        self.store.put(record_key(session_key), json.dumps(record, separators=(",", ":")).encode())
        for key in set(old_pieces) - set(pieces):
            self.store.delete(key)

    def _record(self, session_key: str) -> dict | None:
        raw = self.store.get(record_key(session_key))
        if raw is None:
            return None
        try:
            rec = json.loads(raw)
            if not isinstance(rec, dict) or rec.get("v") != RECORD_VERSION:
                return None
            return rec
        except ValueError:
            return None

    def load(self, session_key: str) -> Loaded | None:
        """The session's verified prefix, or None when the store holds no usable record."""
        rec = self._record(session_key)
        if rec is None:
            return None
        try:
            k, bs, tokens = int(rec["k"]), int(rec["bs"]), [int(t) for t in rec["tokens"]]
            leaves = [bytes.fromhex(x) for x in rec["leaves"]]
            pieces = [str(x) for x in rec["pieces"]]
        except (KeyError, TypeError, ValueError):
            log.warning("session record of %s is malformed: ignored", session_key)
            return None
        if bs <= 0 or len(pieces) != -(-len(tokens) // bs) or len(leaves) != len(tokens) // bs:
            log.warning("session record of %s does not add up: ignored", session_key)
            return None
        parts: list[np.ndarray] = []
        held = 0
        for i, key in enumerate(pieces):
            n = min(bs, len(tokens) - i * bs)
            data = self.store.get(key)
            if data is None or len(data) != n * self.hidden_size * 4 or piece_key(session_key, data) != key:
                log.info("session %s: activation piece %d missing or wrong; holding %d tokens", session_key, i, held)
                break
            parts.append(np.frombuffer(data, np.float32).reshape(n, self.hidden_size))
            held += n
        if not held:
            return Loaded(CloudSession(), len(tokens))
        hidden = np.concatenate(parts) if len(parts) > 1 else parts[0].copy()
        s = CloudSession(
            token_ids=tokens[:held], hidden=hidden, leaves=leaves[: held // bs], split_layer=k, block_tokens=bs
        )
        return Loaded(s, len(tokens))

    def drop(self, session_key: str) -> bool:
        """Delete a session's record and pieces (its KV blocks age out of the store's LRU); True if
        the store held a record of it.

        Raises:
            EngineError: a shared store could not be written.
        """
        rec = self._record(session_key)
        for key in (rec or {}).get("pieces", []):
            self.store.delete(key)
        self.store.delete(record_key(session_key))
        return rec is not None
