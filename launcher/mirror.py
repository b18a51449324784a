"""The active coordinator's membership, as bytes a standby can load: what makes a takeover
lose nothing the job had decided.

Membership is a pure state machine (:mod:`launcher.membership`), so its attributes *are* the
job's control-plane state: members and their incarnations (pids), the generation and the one
pending, the committed step, the spare pool, vacancies, the elastic policy's clocks, pending
resizes and the stop in progress. They are written as msgpack with a tag for each container
msgpack has no type for (integer-keyed maps, sets, tuples, the two record types), then
compressed: a 2,048-rank job's state is a few tens of KiB.

Times are the active coordinator's ``time.monotonic()``; the standby keeps the offset between
that clock and its own (see :class:`launcher.coordinator.Coordinator`), so every deadline goes
on where it was. Heartbeat times are not sent: at a takeover every member gets a fresh one
(it needs a moment to reconnect), so a process dead since before the takeover is found one
heartbeat timeout after it.

Only data comes back from these bytes: a tagged map names one of the two record classes here,
and nothing else is constructed.
"""

from __future__ import annotations

import zlib
from dataclasses import fields
from typing import Any

import msgpack

from launcher.decisions import Generation, Process
from launcher.membership import Membership
from launcher.policy import PolicyState

_RECORDS: dict[str, type] = {"Process": Process, "Generation": Generation, "Policy": PolicyState}
_NOT_MIRRORED = frozenset({"config", "policy", "last_seen"})
MAX_STATE_BYTES = 16 << 20
"""The most a standby inflates one state to (a bound on what a corrupt message may allocate)."""


_SCALARS = (type(None), bool, int, float, str)
_NAMES = {cls: tuple(f.name for f in fields(cls)) for cls in _RECORDS.values()}
_TAGS = {cls: tag for tag, cls in _RECORDS.items()}


def _pack(value: Any) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is dict:
        return {"@d": [[_pack(k), _pack(v)] for k, v in value.items()]}
    if kind is list:
        return [_pack(v) for v in value]
    if kind in _TAGS:
        return {"@r": _TAGS[kind], "v": [_pack(getattr(value, n)) for n in _NAMES[kind]]}
    if kind in (set, frozenset):
        return {"@s": sorted((_pack(v) for v in value), key=repr)}
    if kind is tuple:
        return {"@t": [_pack(v) for v in value]}
    raise TypeError(f"cannot mirror a {kind.__name__}")


def _unpack(value: Any) -> Any:
    if isinstance(value, list):
        return [_unpack(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "@r" in value:
        cls = _RECORDS[value["@r"]]
        names = _NAMES[cls]
        if len(value["v"]) != len(names):
            raise ValueError(f"a {value['@r']} with {len(value['v'])} fields")
        return cls(**{n: _unpack(v) for n, v in zip(names, value["v"], strict=True)})
    if "@d" in value:
        return {_hashable(_unpack(k)): _unpack(v) for k, v in value["@d"]}
    if "@s" in value:
        return {_hashable(_unpack(v)) for v in value["@s"]}
    if "@t" in value:
        return tuple(_unpack(v) for v in value["@t"])
    raise ValueError("an untagged map in a mirrored state")


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def dump(membership: Membership) -> bytes:
    """The membership's state (everything but its configuration and heartbeat times)."""
    state = {k: _pack(v) for k, v in vars(membership).items() if k not in _NOT_MIRRORED}
    return zlib.compress(msgpack.packb(state, use_bin_type=True), 1)


def load(membership: Membership, data: bytes, now: float) -> None:
    """Replace ``membership``'s state with ``data`` (from :func:`dump` of a membership with the
    same configuration); every member's heartbeat is taken as seen at ``now``.

    Raises:
        ValueError: the bytes are not a mirrored state (nothing is changed then).
    """
    try:
        inflate = zlib.decompressobj()
        raw = inflate.decompress(data, MAX_STATE_BYTES)
        if not inflate.eof or inflate.unconsumed_tail:
            raise ValueError("truncated, or larger than MAX_STATE_BYTES")
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        if not isinstance(doc, dict):
            raise ValueError("not a map")
        state = {k: _unpack(v) for k, v in doc.items()}
    except (ValueError, TypeError, KeyError, AttributeError, zlib.error) as e:
        raise ValueError(f"not a mirrored membership state: {e}") from None
    unknown = set(state) - set(vars(membership))
    if unknown:
        raise ValueError(f"not a mirrored membership state: unknown fields {sorted(unknown)}")
    vars(membership).update(state)
    membership.last_seen = {
        identity: now for identity in membership.procs if identity not in membership.done
    }
