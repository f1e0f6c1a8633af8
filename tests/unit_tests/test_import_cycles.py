"""No import cycles between the modules of megatron/.

Every `import` and `from ... import` in megatron/ is read with `ast`, the ones inside functions
too (a cycle hidden in a function-level import still couples the two modules; only imports under
`if TYPE_CHECKING:` are left out). `from package import name` counts as an import of the
submodule `package.name` when that is a module, else of the package (its `__init__.py`). Each
strongly connected component of more than one module is a cycle.
"""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Cycles that remain for now (each a frozenset of module names): none. A new cycle fails this
#: test.
KNOWN_CYCLES = set()


def _modules():
    """{module name: path} of every .py under megatron/."""
    out = {}
    for root, _, files in os.walk(os.path.join(REPO, 'megatron')):
        for name in files:
            if not name.endswith('.py'):
                continue
            path = os.path.join(root, name)
            parts = os.path.relpath(path, REPO)[:-3].split(os.sep)
            if parts[-1] == '__init__':
                parts = parts[:-1]
            out['.'.join(parts)] = path
    return out


def _is_type_checking(node):
    test = node.test
    return (isinstance(test, ast.Name) and test.id == 'TYPE_CHECKING') or (
        isinstance(test, ast.Attribute) and test.attr == 'TYPE_CHECKING'
    )


def _imports(tree, module, is_package, modules):
    """Modules of megatron/ that `tree` (module `module`) imports."""
    targets = set()

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    targets.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ''
            if node.level:
                package = module.split('.') if is_package else module.split('.')[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = '.'.join(package + ([base] if base else []))
            for alias in node.names:
                sub = f'{base}.{alias.name}'
                if sub in modules:
                    targets.add(sub)
                elif base in modules:
                    targets.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    targets.discard(module)
    return targets


def import_graph():
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(open(path).read(), path)
        graph[module] = _imports(tree, module, path.endswith('__init__.py'), modules)
    return graph


def cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def strongconnect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return out


def test_detector_finds_a_cycle():
    graph = {'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}
    assert cycles(graph) == [frozenset({'a', 'b', 'c'})]


def test_no_import_cycles_in_megatron():
    graph = import_graph()
    assert 'megatron.core.parallel_state' in graph and len(graph) > 100
    found = set(cycles(graph)) - KNOWN_CYCLES
    assert not found, '\n'.join(' <-> '.join(sorted(c)) for c in sorted(found, key=sorted))
