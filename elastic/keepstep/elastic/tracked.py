"""State the training script owns beside the model and optimizer, kept with the parameters.

Where it sits: a script registers objects that have ``state_dict()`` / ``load_state_dict()``
(the ``Stateful`` protocol of torch.distributed.checkpoint: LR schedulers, a GradScaler, an
EMA of the weights, its own counters) through ``keepstep.init(state=...)`` or
``job.track(name, obj)``. train_state.py puts what ``TrackedState.capture`` returns into the
same snapshot as the parameters, so it rolls back, reaches a restarted worker or a joiner,
and lands in durable checkpoints with them; ``TrackedState.load`` puts it back. The Job
folds ``sha256`` into the hash it reports at the end (``Job.params_sha256``).

How it is stored: each object's state dict is walked once per capture. Tensors travel as
tensors named ``tracked/<name>/<i>``; everything else becomes a tagged tree of plain values
(``("V", 3)``, ``("L", [...])``, ``("T", 0)`` for the first tensor...) in the snapshot's meta,
which is stored as tagged JSON (plain_json.py): a snapshot may come from a peer, so no
object of any other type is ever built from it. A dict subclass comes back a dict and a
tuple subclass a tuple, which every ``load_state_dict`` of torch accepts; tensors come
back on the CPU, to be copied into place (as torch's own ``load_state_dict`` do).

The rule for scripts: advance tracked state only for committed steps, after
``if step.commit():`` in the loop body. The job snapshots a committed step when the body
ends (when the loop asks for the next step), so what the body did after the commit is in
the snapshot; a member rolled back to step k gets the state tracked objects had when step
k's body ended, and a repeated step does not advance them twice. Tracked tensors are not
copied before the snapshot's background copy reads them: under the rule they change only
after the next commit, which waits for that copy first.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from keepstep.elastic.errors import (
    ConfigError,
    ScriptStateWarning,
    SnapshotCorrupt,
    StateShapeError,
)

PREFIX = "tracked/"
# What to do instead of advancing tracked state in a step that did not commit.
REPEATED_STEP_RULE = (
    "the step is repeated and would advance it twice. Advance tracked state only under "
    "`if step.commit():`."
)
_LEAVES = (type(None), bool, int, float, complex, str, bytes)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_MAX_DEPTH = 64  # deeper trees are refused rather than risking the recursion limit

# A tagged tree: (tag, body). Tags: V plain leaf, S set / F frozenset of leaves, L list,
# U tuple, D dict (body: [[key, tree], ...]), T tensor (body: its index in the object's list).
Tree = tuple[str, Any]


@runtime_checkable
class Stateful(Protocol):
    """What `job.track` accepts: torch.distributed.checkpoint.stateful.Stateful."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


class TrackedState:
    """The script's registered objects, in registration order; frozen when training starts
    (every member must snapshot the same names)."""

    def __init__(self) -> None:
        self._objects: dict[str, Stateful] = {}
        self.frozen = False
        # Per object, as last captured: its plain tree and its tensors' version counters
        # (bumped by every in-place change), to tell cheaply whether it moved since.
        self._marks: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._warned = False  # warn_if_moved: once per job

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._objects)

    def objects(self) -> tuple[Stateful, ...]:
        return tuple(self._objects.values())

    def add(self, name: str, obj: object) -> None:
        """Register ``obj`` under ``name``; ConfigError naming what is wrong with either."""
        if self.frozen:
            raise ConfigError(
                f"track({name!r}, ...) after job.steps() began: register state before "
                "training starts, so that every member snapshots the same names"
            )
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(
                f"tracked state name {name!r}: must be 1-64 letters, digits, '_', '.' or '-'"
            )
        if name in self._objects:
            raise ConfigError(f"tracked state name {name!r} is already registered")
        if not isinstance(obj, Stateful):
            raise ConfigError(
                f"tracked state {name!r} is a {type(obj).__name__}, which lacks "
                "state_dict() and load_state_dict(state_dict)"
            )
        _walk(name, obj)  # refuse now what could not be snapshotted later
        self._objects[name] = obj

    def capture(self) -> tuple[dict[str, torch.Tensor], list[list[Any]]]:
        """The tensors (live, not copied) and the meta entry ``[[name, tree, n_tensors]]``."""
        tensors: dict[str, torch.Tensor] = {}
        entries: list[list[Any]] = []
        for name, obj in self._objects.items():
            tree, found = _walk(name, obj)
            tensors.update({f"{PREFIX}{name}/{i}": t for i, t in enumerate(found)})
            entries.append([name, tree, len(found)])
            self._marks[name] = _mark(tree, found)
        return tensors, entries

    def moved_since_capture(self) -> list[str]:
        """The objects whose state changed since the last ``capture`` (best effort: a
        tensor that a state dict builds afresh each time is seen only through its tree)."""
        moved = []
        for name, obj in self._objects.items():
            now = _mark(*_walk(name, obj))
            if self._marks.setdefault(name, now) != now:
                moved.append(name)
        return moved

    def warn_if_moved(self, why: str) -> None:
        """Warn (once) if an object moved since the last capture in a step that did not
        commit (``why`` says which): the step is repeated, and would advance it twice."""
        moved = [] if self._warned else self.moved_since_capture()
        if moved:
            self._warned = True
            warnings.warn(
                ScriptStateWarning(
                    f"{why} but tracked state {moved} changed after it: {REPEATED_STEP_RULE}"
                ),
                stacklevel=5,  # warn_if_moved <- Job._apply <- _loop <- steps() <- the script
            )

    def decode(self, entries: object, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Each registered object's state dict from a snapshot, checked before anything is
        loaded: StateShapeError if the snapshot tracks other names, SnapshotCorrupt if its
        trees are malformed."""
        if not isinstance(entries, list) or not all(
            isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) for e in entries
        ):
            raise SnapshotCorrupt("snapshot meta: tracked state entries are malformed")
        saved = [e[0] for e in entries]
        if saved != list(self._objects):
            raise StateShapeError(
                f"tracked state names differ: the job tracks {list(self._objects)}, "
                f"the snapshot holds {saved}"
            )
        states = {}
        for name, tree, count in entries:
            found = [tensors[f"{PREFIX}{name}/{i}"] for i in range(count)]
            states[name] = _decode(tree, found, f"tracked state {name!r}", 0)
        return states

    def load(self, states: Mapping[str, Any]) -> None:
        """Hand each registered object its state dict (from ``decode``)."""
        for name, obj in self._objects.items():
            obj.load_state_dict(states[name])
            self._marks[name] = _mark(*_walk(name, obj))  # loaded is not moved

    def sha256(self, name: str | None = None) -> str:
        """sha256 over one object's state, or all of them in registration order.

        Independent of how the state is laid out in memory or encoded: dict items are
        hashed in key order and sets in sorted order, tensors by dtype, shape and bytes.
        """
        if name is not None and name not in self._objects:
            raise ConfigError(f"no tracked state named {name!r}; tracked: {list(self._objects)}")
        digest = hashlib.sha256()
        for key in self._objects if name is None else (name,):
            tree, found = _walk(key, self._objects[key])
            digest.update(f"{key}={_canonical(tree, found)};".encode())
        return digest.hexdigest()


def tensor_names(entries: object) -> set[str]:
    """The snapshot tensor names a meta entry list (from ``capture``) refers to."""
    if not isinstance(entries, list):
        raise SnapshotCorrupt("snapshot meta: tracked state entries are malformed")
    names = set()
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 3 and _is_count(entry[2])):
            raise SnapshotCorrupt(f"snapshot meta: bad tracked state entry {entry!r:.80}")
        names |= {f"{PREFIX}{entry[0]}/{i}" for i in range(entry[2])}
    return names


def _walk(name: str, obj: Stateful) -> tuple[Tree, list[torch.Tensor]]:
    """An object's state dict as a tree, and the tensors its ``T`` nodes index."""
    found: list[torch.Tensor] = []
    return _encode(obj.state_dict(), f"tracked state {name!r}", found, 0), found


def _mark(tree: Tree, tensors: list[torch.Tensor]) -> tuple[str, tuple[int, ...]]:
    return repr(tree), tuple(t._version for t in tensors)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2**20


def _encode(value: Any, where: str, tensors: list[torch.Tensor], depth: int) -> Tree:
    if depth > _MAX_DEPTH:
        raise ConfigError(f"{where}: nested deeper than {_MAX_DEPTH} levels")
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return ("T", len(tensors) - 1)
    if isinstance(value, _LEAVES):
        return ("V", value)
    if isinstance(value, set | frozenset):
        for item in value:
            if not isinstance(item, _LEAVES):
                raise _not_plain(f"{where} (a set) holds", item)
        return ("S" if isinstance(value, set) else "F", list(value))
    if isinstance(value, list | tuple):
        items = [_encode(v, f"{where}[{i}]", tensors, depth + 1) for i, v in enumerate(value)]
        return ("L" if isinstance(value, list) else "U", items)
    if isinstance(value, Mapping):
        pairs = []
        for k, v in value.items():
            if not isinstance(k, _LEAVES):
                raise _not_plain(f"{where} has a key that", k)
            pairs.append([k, _encode(v, f"{where}[{k!r}]", tensors, depth + 1)])
        return ("D", pairs)
    raise _not_plain(where, value)


def _not_plain(where: str, value: object) -> ConfigError:
    return ConfigError(
        f"{where} is a {type(value).__name__}: tracked state may hold tensors and plain "
        "Python values only (None, bool, int, float, complex, str, bytes, and lists, "
        "tuples, dicts and sets of them)"
    )


def _decode(tree: object, tensors: list[torch.Tensor], where: str, depth: int) -> Any:
    if not (isinstance(tree, tuple) and len(tree) == 2 and isinstance(tree[0], str)):
        raise SnapshotCorrupt(f"{where}: malformed tree node {tree!r:.80}")
    tag, body = tree
    if depth > _MAX_DEPTH:
        raise SnapshotCorrupt(f"{where}: nested deeper than {_MAX_DEPTH} levels")
    if tag == "V" and isinstance(body, _LEAVES):
        return body
    if tag == "T" and _is_count(body) and body < len(tensors):
        return tensors[body]
    if tag in ("S", "F") and isinstance(body, list) and all(isinstance(v, _LEAVES) for v in body):
        return set(body) if tag == "S" else frozenset(body)
    if tag in ("L", "U") and isinstance(body, list):
        items = [_decode(v, tensors, f"{where}[{i}]", depth + 1) for i, v in enumerate(body)]
        return items if tag == "L" else tuple(items)
    if tag == "D" and isinstance(body, list):
        out = {}
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], _LEAVES)):
                raise SnapshotCorrupt(f"{where}: malformed dict item {pair!r:.80}")
            out[pair[0]] = _decode(pair[1], tensors, f"{where}[{pair[0]!r}]", depth + 1)
        return out
    raise SnapshotCorrupt(f"{where}: malformed tree node {tag!r}")


def _canonical(tree: Tree, tensors: list[torch.Tensor]) -> str:
    """A text form equal for equal states (repr of a float is exact)."""
    tag, body = tree
    if tag == "V":
        return "V" + repr(body)
    if tag == "T":
        t = tensors[body].detach().cpu()
        raw = t.contiguous().reshape(-1).view(torch.uint8)  # a 0-dim tensor has no byte view
        data = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
        return f"T({t.dtype},{tuple(t.shape)},{data})"
    if tag in ("S", "F"):
        return tag + "{" + ",".join(sorted(repr(v) for v in body)) + "}"
    if tag in ("L", "U"):
        return tag + "[" + ",".join(_canonical(v, tensors) for v in body) + "]"
    items = sorted(f"{k!r}:{_canonical(v, tensors)}" for k, v in body)
    return "D{" + ",".join(items) + "}"
