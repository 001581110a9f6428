"""kvscope.store's public names load their modules lazily and all resolve."""

from __future__ import annotations

import importlib

import kvscope.store as store


def test_every_public_name_resolves_from_its_module() -> None:
    assert sorted(store.__all__) == sorted(store._MODULE_OF)
    for name in store.__all__:
        module = importlib.import_module(f"kvscope.store.{store._MODULE_OF[name]}")
        assert getattr(store, name) is getattr(module, name)


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        store.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("kvscope.store.no_such_name resolved")
