"""The package's architecture, checked: no import cycles, the library apart from its harness, one name per thing."""
import ast
import os
import subprocess
import sys

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mindformers_ac")
# Tools around the library: they may import it, it never imports them.
HARNESS = ("mindformers_ac.harness", "mindformers_ac.planner")


def _module_name(path):
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _modules():
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                found[_module_name(path)] = path
    return found


def _imports(name, path, known):
    """Package modules imported by ``name`` (at any depth of the file, lazy imports included)."""
    is_pkg = path.endswith("__init__.py")
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[:len(base) - node.level + 1]
                target = ".".join(parent + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for c in candidates:
            while c and c not in known:
                c = c.rpartition(".")[0]
            if c and c != name:
                out.add(c)
    return out


def _graph():
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _cycle(graph):
    """One import cycle between modules (a package importing its own submodules is not one), or None."""
    def edges(m):
        return [d for d in graph[m] if not m.startswith(d + ".") and not d.startswith(m + ".")]

    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in edges(m):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"p": {"p.x"}, "p.x": {"p.y"}, "p.y": set()}) is None


def test_no_import_cycles():
    assert _cycle(_graph()) is None


def test_library_never_imports_the_harness():
    graph = _graph()
    library = [m for m in graph if not m.startswith(HARNESS)]
    assert "mindformers_ac.recompute.region" in library and "mindformers_ac.apply" in library
    offenders = {m: sorted(d for d in graph[m] if d.startswith(HARNESS)) for m in library}
    assert {m: d for m, d in offenders.items() if d} == {}


def test_engines_live_in_their_subpackages():
    graph = _graph()
    for name in ("recompute.region", "recompute.dispatch", "recompute.output", "recompute.api",
                 "swap.api", "swap.install", "swap.scheduler", "swap.executor", "swap.backends",
                 "harness.cli", "harness.train", "harness.models", "planner.solver"):
        assert f"mindformers_ac.{name}" in graph
    modules = _modules()
    flat = [m for m in graph if m.count(".") == 1 and m.split(".")[1].startswith(("recompute_", "swap_", "planner"))
            and not modules[m].endswith("__init__.py")]   # a flat module, not the subpackage itself
    assert flat == []


def test_import_loads_no_plotting_library():
    code = "import sys, mindformers_ac; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_one_name_one_thing():
    import mindformers_ac as mac
    import mindformers_ac.swap as swap_pkg
    from mindformers_ac.recompute import dispatch
    from mindformers_ac.planner import profile

    assert swap_pkg is mac.swap and swap_pkg.__name__ == "mindformers_ac.swap"
    assert callable(mac.swap) and hasattr(swap_pkg, "install_layer_swap")
    assert not hasattr(dispatch, "_Run") and not hasattr(profile, "_Run")
    assert not hasattr(mac.meter, "measure_step")
    assert not hasattr(mac.recompute, "remove_checkpoint")


@pytest.mark.parametrize("first", ["checkpoint", "swap"])
def test_checkpoint_and_swap_wrappers_refuse_each_other_alike(first):
    from mindspore import nn
    import mindformers_ac as mac

    cell = nn.Dense(4, 4)
    wrap = {"checkpoint": mac.checkpoint_wrapper, "swap": mac.swap_wrapper}
    wrap[first](cell)
    second = "swap" if first == "checkpoint" else "checkpoint"
    with pytest.raises(ValueError) as err:
        wrap[second](cell)
    assert "checkpoint_wrapper and swap_wrapper can't wrap the same cell" in str(err.value)
    (mac.unwrap if first == "checkpoint" else mac.remove_swap_wrapper)(cell)
    assert "construct" not in cell.__dict__


def test_too_old_mindspore_fails_at_import_naming_the_version(monkeypatch):
    import mindspore.utils
    from mindformers_ac.mindspore_version import MIN_MINDSPORE, require_mindspore

    require_mindspore()   # the installed one is recent enough
    monkeypatch.delattr(mindspore.utils, "MsDispatchMode")   # as in MindSpore 2.8
    with pytest.raises(ImportError) as err:
        require_mindspore()
    assert MIN_MINDSPORE == "2.9.0"
    assert f"needs MindSpore >= {MIN_MINDSPORE}" in str(err.value)
    assert f"pip install 'mindspore>={MIN_MINDSPORE}'" in str(err.value)
