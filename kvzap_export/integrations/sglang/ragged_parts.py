"""What ragged mode builds in one SGLang process, each piece through one of SGLang's extension points, held by one
object that hands each piece to what reads it (no module globals).

``ragged.register`` makes one ``RaggedParts`` per process and binds it to the hooks that fill it; the plugin hands it
to the runtime it builds (``plugin.runtime``). In the order SGLang builds them:

- ``plan``: the KV budget's split (``ragged_budget.BudgetPlan``), set by the budget hook when SGLang sizes its pool;
  read by the allocator hook, the backend (its decode buffers' share) and the readings;
- ``store``: the per-head ``RaggedStore``, set by the allocator hook when SGLang builds its pool (the allocator owns
  it too); read by the attention backend and the runtime;
- ``backend``: the ``kvzap_ragged`` attention backend, set by its constructor. It owns the step of the forward
  running now (``step``, laid out before the forward) and hands it over: ``forward_step()`` to the scoring hook,
  ``take_step()`` once to the step end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvzap_export.errors import ConfigError

if TYPE_CHECKING:
    from kvzap_export.integrations.ragged_store import RaggedStore
    from kvzap_export.integrations.sglang.ragged_budget import BudgetPlan


@dataclass
class RaggedParts:
    """One process's ragged-mode pieces (module docstring); each is None until SGLang builds it."""

    plan: BudgetPlan | None = None
    store: RaggedStore | None = None
    backend: object | None = None  # ragged.backend_class()'s instance: ``forward_step()``, ``take_step()``

    def built_store(self) -> RaggedStore:
        """The store, or a one-line ConfigError when SGLang's pool was not built through the ragged hooks."""
        if self.store is None:
            raise ConfigError("the ragged KV store does not exist in this process: SGLang's pool was not built "
                              "through the ragged mode's hooks (is KVZAP_MODE=ragged set in every SGLang process?)")
        return self.store

    def forward_step(self):
        """The step laid out for the forward running now (what the scoring hook writes against), or None."""
        return self.backend.forward_step() if self.backend is not None else None

    def take_step(self):
        """The step of the forward that just ran, handed to the step end once (None after, until the next layout)."""
        return self.backend.take_step() if self.backend is not None else None
