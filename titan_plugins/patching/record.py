"""The declarative patch record and its status."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from titan_plugins.patching.signature import Signature
from titan_plugins.patching.status import APPLIED, FAILED, PENDING, SKIPPED

__all__ = ["APPLIED", "FAILED", "MISSING", "PENDING", "SKIPPED", "Patch", "Signature"]


class _Missing:
    """Sentinel handed to a ``create=True`` factory when the attribute does not exist yet."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "MISSING"

    def __bool__(self) -> bool:
        return False


MISSING: Any = _Missing()


@dataclass
class Patch:
    """One lazy monkeypatch, declared by a plugin in ``titan_register_patches``.

    :param id: unique id, ``<plugin>.<what>``.
    :param target: ``"module:attr"`` or ``"module:Class.attr"``: the namespace where the name is
        *used* (many megatron modules copy names with ``from x import f``).
    :param replace: factory ``replace(original) -> replacement``, called once per application with
        the current value (``MISSING`` for an absent attribute when ``create=True``).
    :param requires: version gates, e.g. ``SUPPORTED_MEGATRON`` (``"megatron-core>=0.16,<0.20"``, every supported line) or ``megatron_lines("0.18")`` for a variant;
        judged when the target module has executed, against the version of the imported code
        (``megatron.core.package_info``), never by importing (see :mod:`.gates`).
    :param signature: what the replacement relies on in the target (:class:`.Signature`, or
        several); checked against the imported module before any factory runs. A mismatch
        skips the patch with what differed. A pre-release of the supported line passes the
        version gate only if the patch declares a signature and every check passes.
    :param rationale: why the patch exists. Required.
    :param remove_when: when the patch can be deleted. Required.
    :param upstream: the upstream code or issue it works around.
    :param optional: a missing target module or attribute is ``skipped`` rather than ``failed``.
    :param create: the attribute may be absent (the factory gets ``MISSING``; undo deletes it).
    :param rebind_aliases: on late application, also rebind module-level ``from x import f``
        copies of the original under ``megatron.`` (functions and classes only).
    """

    id: str
    target: str
    replace: Callable[[Any], Any]
    rationale: str
    remove_when: str
    requires: tuple[str, ...] = ()
    signature: Signature | tuple[Signature, ...] = ()
    upstream: str = ""
    optional: bool = False
    create: bool = False
    rebind_aliases: bool = True
    plugin: str = ""
    status: str = field(default=PENDING, compare=False)
    detail: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if ":" not in self.target:
            raise ValueError(f"patch {self.id}: target {self.target!r} must be 'module:attr'")
        if not self.rationale.strip() or not self.remove_when.strip():
            raise ValueError(f"patch {self.id}: rationale and remove_when are required")
        if isinstance(self.requires, str):
            self.requires = (self.requires,)
        if isinstance(self.signature, Signature):
            self.signature = (self.signature,)
        self.signature = tuple(self.signature)

    @property
    def module(self) -> str:
        """The module whose execution triggers the patch."""
        return self.target.split(":", 1)[0]

    @property
    def attr_path(self) -> str:
        """``attr`` or ``Class.attr`` inside the module."""
        return self.target.split(":", 1)[1]

    def set_status(self, status: str, detail: str = "") -> None:
        """Record the outcome of the last application attempt."""
        self.status, self.detail = status, detail

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable view for reports."""
        return {
            "id": self.id,
            "plugin": self.plugin,
            "target": self.target,
            "status": self.status,
            "detail": self.detail,
            "requires": list(self.requires),
            "signature": [s.describe(self.attr_path) for s in self.signature],
            "rationale": self.rationale,
            "upstream": self.upstream,
            "remove_when": self.remove_when,
            "optional": self.optional,
        }
