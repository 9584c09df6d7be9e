"""The boundary between the user's rooms and the machinery (``src/engine/``).

The user's rooms (``src/data/``, ``src/models/``, the entry points) reach the machinery only through
``src.engine`` and the names its ``__all__`` lists; the machinery never imports a user room; the old
import paths of the moved modules still answer, with the very module at the new path.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import src
import src.engine as engine

ROOT = Path(__file__).resolve().parents[1]
USER_ROOMS = ["src/data", "src/models", "src/train.py", "src/eval.py", "src/predict.py", "src/export.py"]

pytestmark = pytest.mark.fast


def _files(rooms: list[str]) -> list[Path]:
    paths = [ROOT / room for room in rooms]
    return sorted(f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py")))


def boundary_breaches(path: Path, public: set[str]) -> list[str]:
    """``file:line: import`` for each import in ``path`` of ``src.engine`` other than ``from src.engine import
    <a public name>``."""
    wrong = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name == "src.engine" or a.name.startswith("src.engine.")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("src.engine"):
            private = [a.name for a in node.names if a.name not in public]
            names = [node.module] if node.module != "src.engine" else [f"src.engine.{n}" for n in private]
        else:
            continue
        wrong += [f"{path.name}:{node.lineno}: {name}" for name in names]
    return wrong


def user_room_imports(path: Path) -> list[str]:
    """The imports of a user room (``src.data``, ``src.models``) in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                   else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [f"{path.name}:{node.lineno}: {m}" for m in modules if m.split(".")[:2] in (["src", "data"], ["src", "models"])]
    return found


def test_the_users_rooms_import_the_machinery_only_through_src_engine():
    wrong = [breach for path in _files(USER_ROOMS) for breach in boundary_breaches(path, set(engine.__all__))]
    assert wrong == [], "import these through `from src.engine import ...` (add the name to src/engine/__init__.py)"


def test_the_boundary_check_catches_a_deep_import_and_an_unlisted_name(tmp_path):
    room = tmp_path / "my_module.py"
    room.write_text("from src.engine import StepModule\nfrom src.engine.utils.errors import DataError\n"
                    "import src.engine.strategies.ddp\nfrom src.engine import _WHERE\n")
    assert boundary_breaches(room, set(engine.__all__)) == [
        "my_module.py:2: src.engine.utils.errors", "my_module.py:3: src.engine.strategies.ddp",
        "my_module.py:4: src.engine._WHERE"]


def test_the_machinery_imports_no_user_room():
    assert [hit for path in _files(["src/engine"]) for hit in user_room_imports(path)] == []


def test_every_public_name_resolves_and_an_unknown_one_says_where_the_list_is():
    missing = [name for name in engine.__all__ if getattr(engine, name, None) is None]
    assert missing == []
    with pytest.raises(AttributeError, match="src/engine/__init__.py"):
        engine.NoSuchThing  # noqa: B018


def test_a_light_public_name_does_not_import_lightning():
    code = "import sys; from src.engine import DataError, ConfigError; print('lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("old", "new"), [
    ("src.strategies.ddp", "src.engine.strategies.ddp"),
    ("src.utils.errors", "src.engine.utils.errors"),
    ("src.models.step_module", "src.engine.steps.step_module"),
    ("src.data.in_memory_datamodule", "src.engine.data.in_memory_datamodule"),
    ("src.data.components.resumable_loader", "src.engine.data.resumable_loader"),
])
def test_an_old_import_path_is_the_module_at_its_new_one_with_a_warning(old, new):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)


def test_the_user_rooms_that_did_not_move_are_not_aliased():
    assert src.moved_to("src.models.classification_module") is None
    assert src.moved_to("src.data.mnist_datamodule") is None
    assert src.moved_to("src.strategies.ps.strategy") == "src.engine.strategies.ps.strategy"
