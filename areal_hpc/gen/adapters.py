"""Which LoRA adapter a request names (``weight_update_mode: adapter``).

Each weight version v >= 1 of a LoRA actor reaches the servers as an adapter loaded under the name
``adapter_name(v)`` (``weights.publisher.AdapterPublisher``), after which the server reports v as its
weight_version. A request must name the adapter it runs on (SGLang's ``lora_path``); version 0 is the base
model itself (PEFT starts B at zero), so it names none. Each client learns its server's version from its
publisher (the controller's clients) or from the run directory's published version (the rollout role's), and
asks ``/model_info`` at its first request, after an answer came back interrupted (a weight update does that)
and after the server refused the adapter it named (gone since); it labels every answer with the version of the adapter it named: on SGLang that is exactly what ran
(a request keeps its adapter to its end, even across an update), on the built-in engine, which holds one
adapter, an answer may have gone on under the next one, so the label is the older of the two, as a paused
request's is across a full-weight update.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


def version_of(label) -> int:
    """The weight version a response was generated with: SGLang reports a string, the label of our version
    number we sent with the weights ("0" at launch, `--weight-version 0`); "default" is SGLang's label when
    it was launched without one and never updated."""
    if label is None or label == "default":
        return 0
    if not str(label).isdigit():
        raise ValueError(f"weight_version {label!r} is not a label this run gives its weights")
    return int(label)


class ServedAdapter:
    """The weight version one server serves, as its clients in this process last learned it."""

    def __init__(self, ask: Callable[[], int]):
        self._ask, self._lock = ask, threading.Lock()
        self._version: int | None = None  # None: ask the server

    def version(self) -> int:
        """The server's version as last learned; asked of the server when unknown."""
        with self._lock:
            if self._version is None:
                self._version = self._ask()
            return self._version

    def advance(self, version: int) -> None:
        """The server holds ``version`` now (its publisher, or the run directory, says so)."""
        with self._lock:
            if self._version is None or version >= self._version:
                self._version = version

    def expire(self) -> None:
        """The next request asks first (an answer came back interrupted, or a name was refused: a new version
        may be there)."""
        with self._lock:
            self._version = None
