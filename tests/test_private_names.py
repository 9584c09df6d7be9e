"""The project reaches few private Lightning/torch names, counted by scanning its code (not from a registry).

A private name is one with a single leading underscore (not a dunder) that comes from lightning (and its
torchmetrics) or torch: an imported name (``from torch.x import _y``), a private segment of an imported module's
path (``torch._dynamo``), an attribute (``obj._x``), a string that names an attribute (``getattr(obj, "_x")``,
``vars(obj).get("_x")``), a base class. The project's own private names do not count: names it defines
(``def _x``, class attributes, ``self._x = ...``, module-level ``_x``), unless the class that defines one subclasses
(or is mixed into) a Lightning/torch class that has the name too: an override of ``_configure_launcher`` is
Lightning's name.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGET = 15  # issue 48: at most 15 private names
# The count reached so far (52 when this test was written): a ratchet, lowered as names go, until it is TARGET.
# What remains and why: the launcher hook and slot (_configure_launcher, _launcher) and the launchers' base
# classes; the agreed SIGTERM stop (the per-batch broadcast and the handler it replaces); the loop state behind
# last.ckpt's save points and epoch rows; dp's CPU replicas; fsdp's mesh sizes and sub-groups; torch's collective
# counter; a metric's reductions; the sync_batchnorm slot; see the
# assertion message.
REACHED = 22
EXTERNAL_ROOTS = {"lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities", "torch", "torchmetrics",
                  "torchvision"}
PRIVATE = re.compile(r"_[A-Za-z0-9]\w*")


def _is_private(name: str) -> bool:
    # "_target_"-style keys (Hydra's) end in an underscore: they name no attribute
    return bool(PRIVATE.fullmatch(name)) and not name.endswith("_")


def _is_external(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in EXTERNAL_ROOTS


def _init_names(cls: type) -> set[str]:
    """The names the ``__init__`` methods of ``cls``'s MRO refer to (the instance attributes they set)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = inspect.unwrap(klass.__dict__.get("__init__", None) or (lambda: None))
        code = getattr(init, "__code__", None)
        if code is not None:
            names |= {n for n in (*code.co_names, *code.co_consts) if isinstance(n, str)}
    return names


def _external_bases(cls: type) -> list[type]:
    return [k for k in cls.__mro__ if _is_external(getattr(k, "__module__", None))]


def _has(cls: type, name: str) -> bool:
    return hasattr(cls, name) or name in _init_names(cls)


class _Defined(ast.NodeVisitor):
    """Names a module defines, and for each class (by qualified name) the names its body defines."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.by_class: dict[str, set[str]] = {}
        self._classes: list[str] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:  # noqa: N802
        self.names.add(node.name)
        self._add(node.name, outer=True)
        self._classes.append(node.name)
        for stmt in node.body:
            for target in _targets(stmt):
                if isinstance(target, ast.Name):
                    self._add(target.id)
        self.generic_visit(node)
        self._classes.pop()

    def _add(self, name: str, outer: bool = False) -> None:
        self.names.add(name)
        classes = self._classes[:-1] if outer else self._classes
        if classes:
            self.by_class.setdefault(".".join(classes), set()).add(name)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:  # noqa: N802
        if self._classes:  # a method; a module-level or local function is no object's attribute
            self._add(node.name)
        for sub in ast.walk(node):
            for target in _targets(sub):
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and \
                        target.value.id in ("self", "cls"):
                    self._add(target.attr)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815

    def visit_Module(self, node: ast.Module) -> None:  # noqa: N802
        for stmt in node.body:
            for target in _targets(stmt):
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        self.names.add(name.id)
        self.generic_visit(node)


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return [node.target]
    return []


def private_names(modules: dict[str, tuple[str, dict]]) -> dict[str, set[str]]:
    """``private name -> {"module: how"}`` for the Lightning/torch private names the modules reach.

    ``modules`` maps a module's name to its source and its namespace (the classes it defines, as objects, so that
    their Lightning/torch bases can be asked whether they have a name the module defines).
    """
    trees = {name: ast.parse(source) for name, (source, _) in modules.items()}
    defined: set[str] = set()
    owners: dict[str, _Defined] = {}
    for name, tree in trees.items():
        owners[name] = visitor = _Defined()
        visitor.visit(tree)
        defined |= visitor.names

    # project classes as objects; a mixin is judged with the Lightning/torch classes it is mixed into
    classes = {(mod, qual): obj for mod, (_, namespace) in modules.items() for qual in owners[mod].by_class
               if isinstance(obj := _lookup(namespace, qual), type)}
    found: dict[str, set[str]] = {}

    def add(name: str, where: str) -> None:
        found.setdefault(name, set()).add(where)

    for (mod, qual), cls in classes.items():
        users = [c for c in classes.values() if cls in c.__mro__]
        bases = {b for c in users for b in _external_bases(c)}
        for name in owners[mod].by_class.get(qual, ()):
            if _is_private(name) and any(_has(b, name) for b in bases):
                add(name, f"{mod}: {qual} overrides or sets it")

    lightnings = {name for name, where in found.items()}
    for mod, tree in trees.items():
        imported: dict[str, str] = {}  # local name -> dotted module or object it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    imported[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                        alias.name.split(".")[0]
                    _module_path(alias.name, mod, add)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                _module_path(node.module, mod, add)
                for alias in node.names:
                    imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    if _is_external(node.module) and _is_private(alias.name):
                        add(alias.name, f"{mod}: from {node.module} import")

        def theirs(name: str) -> bool:
            return _is_private(name) and (name not in defined or name in lightnings)

        not_names = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
        for node in ast.walk(tree):  # ("numpy.core.multiarray", "_reconstruct"): a pickle global of another library
            if isinstance(node, ast.Tuple) and len(node.elts) == 2 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts) and \
                    "." in node.elts[0].value and not _is_external(node.elts[0].value):
                not_names.add(id(node.elts[1]))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and theirs(node.attr):
                base = node.value
                if isinstance(base, ast.Name) and base.id in imported and not _is_external(imported[base.id]):
                    continue  # os._exit, sys._getframe: another library's
                add(node.attr, f"{mod}: attribute")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and theirs(node.value) and \
                    id(node) not in not_names and node.value not in sys.stdlib_module_names:
                add(node.value, f"{mod}: string")
            elif isinstance(node, ast.ClassDef):
                for base in node.bases:
                    last = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                    if theirs(last):
                        add(last, f"{mod}: base class of {node.name}")
    # an attribute the project sets on another object (``module._flag = True``), or names in a module constant, is
    # the project's own unless lightning/torch has that name too
    unsure = {name for name, where in found.items() if all(w.endswith((": attribute", ": string")) for w in where)}
    unsure &= set().union(*(_set_by(tree) for tree in trees.values()))
    missing = unsure - _names_in_library_sources(unsure)
    return {name: where for name, where in found.items() if name not in missing}


def _set_by(tree: ast.Module) -> set[str]:
    """Private names a module assigns as attributes of any object, or holds as module-level string constants."""
    names = {t.attr for node in ast.walk(tree) for t in _targets(node) if isinstance(t, ast.Attribute)}
    names |= {n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
              and isinstance(n.value.value, str)}
    return {name for name in names if _is_private(name)}


def _names_in_library_sources(names: set[str]) -> set[str]:
    """Which of ``names`` occur as identifiers in the installed lightning, torchmetrics and torch sources."""
    return names & _library_private_identifiers()


@functools.cache
def _library_private_identifiers() -> frozenset[str]:
    pattern = re.compile(r"\b_[A-Za-z0-9]\w*")
    seen: set[str] = set()
    for root in sorted(EXTERNAL_ROOTS):
        spec = importlib.util.find_spec(root)
        for location in (spec.submodule_search_locations or ()) if spec else ():
            for path in (*Path(location).rglob("*.py"), *Path(location).rglob("*.pyi")):
                seen.update(pattern.findall(path.read_text(errors="ignore")))
    return frozenset(seen)


def _lookup(namespace: dict, qualname: str) -> object:
    obj: object = namespace.get(qualname.split(".")[0])
    for part in qualname.split(".")[1:]:
        obj = getattr(obj, part, None)
    return obj


def _module_path(module: str, where: str, add: Callable[[str, str], None]) -> None:
    if _is_external(module):
        for segment in module.split("."):
            if _is_private(segment):
                add(segment, f"{where}: module {module}")


def _src_modules(paths: Iterable[Path]) -> dict[str, tuple[str, dict]]:
    modules = {}
    for path in paths:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = (path.read_text(), vars(importlib.import_module(name)))
    return modules


def _report(found: dict[str, set[str]]) -> str:
    return "\n".join(f"  {name}: {'; '.join(sorted(where))}" for name, where in sorted(found.items()))


FIXTURE = '''
import os
import torch
import torch._dynamo
from torch.distributed import _functional_collectives as fc
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.loops.fit_loop import _FitLoop

_MINE = "_helper"  # a string naming the project's own method


def _parameters(module):  # a module-level function: it does not make torch's attribute below the project's
    return module._parameters


class Mixin:
    def _configure_launcher(self):  # mixed into a DDPStrategy below: Lightning's hook
        self._launcher = None  # Lightning's attribute (set in Strategy.__init__)


class Mine(Mixin, DDPStrategy):
    def __init__(self):
        super().__init__()
        self._mine = 1  # the project's own

    def _helper(self):  # the project's own
        os._exit(0)  # another library's
        getattr(self, "_start_method")
        self.trainer.lightning_module._flag_set_elsewhere = True  # neither the project's def nor Lightning's
        return self._mine, self._helper, torch._C, fc, _FitLoop, _MINE


class _Private(_FitLoop):
    pass
'''
FIXTURE_NAMES = {"_dynamo", "_functional_collectives", "_FitLoop", "_configure_launcher", "_launcher",
                 "_start_method", "_C", "_parameters"}


@pytest.mark.fast
def test_the_scanner_finds_exactly_the_private_names_of_a_known_snippet():
    namespace: dict = {"__name__": "fixture"}
    exec(compile(FIXTURE, "fixture", "exec"), namespace)  # noqa: S102 - the snippet above
    found = private_names({"fixture": (FIXTURE, namespace)})
    assert set(found) == FIXTURE_NAMES, _report(found)
    assert "fixture: base class of _Private" in found["_FitLoop"]


@pytest.mark.fast
def test_private_lightning_or_torch_names_only_go_down():
    """Issue 48 asks for at most 15; the test holds the count reached so far, and wants it lowered when it drops."""
    found = private_names(_src_modules(sorted((ROOT / "src").rglob("*.py"))))
    listing = f"{len(found)} private Lightning/torch names (ratchet {REACHED}, target {TARGET}):\n{_report(found)}"
    assert len(found) <= REACHED, listing
    assert len(found) == REACHED or len(found) <= TARGET, f"fewer than the ratchet: lower REACHED to {len(found)}\n"

