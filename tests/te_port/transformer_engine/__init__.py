"""Import shim for running TransformerEngine's own JAX tests on lowbit: ``transformer_engine.jax``
and its submodules resolve to ``lowbit.te`` (the same module objects), ``transformer_engine.common.
recipe`` to ``lowbit.recipe``. Names lowbit.te lacks that only TE's test harness needs (its native
extension module, version queries) come from :mod:`te_port.standins`. Put ``tests/te_port`` first
on ``PYTHONPATH`` (scripts/te_tests.sh does)."""

import importlib
import importlib.abc
import importlib.util
import sys

import standins

_ALIASES = {"transformer_engine.jax": "lowbit.te", "transformer_engine.common.recipe": "lowbit.recipe"}


def _target(fullname):
    for te, ours in _ALIASES.items():
        if fullname == te or fullname.startswith(te + "."):
            return ours + fullname[len(te) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, module):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        pass


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        ours = _target(fullname)
        if ours is None:
            return None
        try:
            module = importlib.import_module(ours)
        except ImportError:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(module))


sys.meta_path.insert(0, _AliasFinder())
standins.install()
