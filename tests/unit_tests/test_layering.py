"""The folder tree is the architecture: these rules keep the layers pointing one way.

- `megatron/core` never imports the training layer nor reads CLI args (`get_args()` & co.).
- `megatron/` never imports `tools/`, `tasks/` or `examples/`.
"""

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TRAINING_GLOBALS = {"get_args", "get_tokenizer", "get_timers", "get_tensorboard_writer"}


def _python_files(folder: pathlib.Path):
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def _imported_modules(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def test_core_does_not_reach_into_training_layer():
    offences = []
    for path in _python_files(REPO / "megatron" / "core"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for lineno, module in _imported_modules(tree):
            if module == "megatron.training" or module.startswith("megatron.training."):
                offences.append(f"{path.relative_to(REPO)}:{lineno} imports {module}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in TRAINING_GLOBALS:
                    offences.append(f"{path.relative_to(REPO)}:{node.lineno} calls {name}()")
    assert not offences, "megatron/core must take configs, not the training layer:\n" + "\n".join(
        offences
    )


@pytest.mark.parametrize("top", ["tools", "tasks", "examples"])
def test_megatron_does_not_import_scripts(top):
    offences = []
    for path in _python_files(REPO / "megatron"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for lineno, module in _imported_modules(tree):
            if module == top or module.startswith(top + "."):
                offences.append(f"{path.relative_to(REPO)}:{lineno} imports {module}")
    assert not offences, "\n".join(offences)


def test_layering_rule_catches_an_offence(tmp_path):
    """The scan itself must see a violation (guards against a scan that silently finds nothing)."""
    bad = "from megatron.training.global_vars import get_args\nargs = get_args()\n"
    tree = ast.parse(bad)
    modules = [m for _, m in _imported_modules(tree)]
    calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert "megatron.training.global_vars" in modules
    assert "get_args" in calls
    assert len(_python_files(REPO / "megatron" / "core")) > 0
