"""`springback.storage` loads each exported name from its module on first use
(PEP 562). A submodule that shares an exported name would shadow it once
imported (the import system binds a submodule to its package's attribute):
`from springback.storage import restore` once gave the module `restore.py`
instead of its function. Every exported name must stay its module's object
after every submodule is imported."""

from __future__ import annotations

import importlib
import pkgutil

import springback.storage as storage


def test_every_exported_name_is_its_modules_object_after_every_submodule_is_imported():
    for info in pkgutil.iter_modules(storage.__path__):
        importlib.import_module(f"springback.storage.{info.name}")
    wrong = {name: type(getattr(storage, name)).__name__ for name in storage.__all__
             if getattr(storage, name) is not getattr(
                 importlib.import_module(f"springback.storage.{storage._EXPORTS[name]}"), name)}
    assert not wrong, f"exported names shadowed by a submodule: {wrong}"
    submodules = {info.name for info in pkgutil.iter_modules(storage.__path__)}
    assert not submodules & set(storage.__all__)
