"""Drafting strategies, one module each behind `base.DraftingStrategy` (each module's docstring says which mode or
request it drafts; docs/design.md has the table).

`STRATEGIES` maps each strategy's `name` (for a mode: its `speculation.mode` value) to its class. The modules here
are found and registered on import, so a new strategy is its module (plus its config entry and its test), with no
list to edit; `strategies(setup)` builds those the configuration uses, in the order they claim requests.
"""

from __future__ import annotations

import importlib
import pkgutil

from speculation.strategies.base import DraftingStrategy, Setup


def _discover() -> dict[str, type[DraftingStrategy]]:
    found: dict[str, type[DraftingStrategy]] = {}
    for m in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{m.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, DraftingStrategy) and obj is not DraftingStrategy \
                    and obj.__module__ == module.__name__:
                if obj.name in found:
                    raise RuntimeError(f"two drafting strategies are named {obj.name!r}: {found[obj.name]}, {obj}")
                found[obj.name] = obj
    return found


STRATEGIES = _discover()


def strategy_class(mode: str) -> type[DraftingStrategy] | None:
    """The strategy a `speculation.mode` names (None for off)."""
    return STRATEGIES.get(mode)


def strategies(setup: Setup) -> list[DraftingStrategy]:
    """The strategies this configuration uses, in the order they claim requests."""
    built = [s for cls in STRATEGIES.values() if (s := cls.build(setup)) is not None]
    return sorted(built, key=lambda s: s.rank)
