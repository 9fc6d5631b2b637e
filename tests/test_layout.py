"""The package's architecture, checked: no import cycles, the library apart from its harness, one name per thing."""
import ast
import os
import subprocess
import sys

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mindformers_ac")
# Tools around the library: they may import it, it never imports them. The planner stands on the
# library alone (the harness drives it, not the other way round).
HARNESS = ("mindformers_ac.harness", "mindformers_ac.planner")
PLANNER, CLI_HARNESS = "mindformers_ac.planner", "mindformers_ac.harness"


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


def test_the_planner_stands_on_the_library_not_on_the_harness():
    graph = _graph()
    planner = [m for m in graph if m.startswith(PLANNER)]
    assert "mindformers_ac.planner.profile" in planner
    assert {m: sorted(d for d in graph[m] if d.startswith(CLI_HARNESS)) for m in planner} == \
        {m: [] for m in planner}


def test_engines_live_in_their_subpackages():
    graph = _graph()
    for name in ("recompute.region", "recompute.dispatch", "recompute.output", "recompute.api",
                 "swap.api", "swap.install", "swap.scheduler", "swap.executor", "swap.backends",
                 "harness.cli", "harness.train", "harness.models", "budget.solver"):
        assert f"mindformers_ac.{name}" in graph
    modules = _modules()
    flat = [m for m in graph if m.count(".") == 1 and m.split(".")[1].startswith(("recompute_", "swap_", "planner"))
            and not modules[m].endswith("__init__.py")]   # a flat module, not the subpackage itself
    assert flat == []


def test_import_loads_no_plotting_library():
    code = "import sys, mindformers_ac; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# A public name that several modules define on purpose: each entry point's ``main``.
ENTRY_POINT_NAMES = {"main"}
# The one module that may name MindSpore's private API (a MindSpore upgrade is audited there).
MINDSPORE_DOOR = "mindformers_ac.mindspore_compat"


def _top_level_names(tree):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                yield from (t.id for t in ast.walk(target) if isinstance(t, ast.Name))


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def test_every_public_name_is_defined_once():
    where = {}
    for name, path in _modules().items():
        for defined in _top_level_names(ast.parse(open(path, encoding="utf-8").read())):
            if not _private(defined) and defined not in ("logger", "__all__") and defined not in ENTRY_POINT_NAMES:
                where.setdefault(defined, []).append(name)
    assert {n: m for n, m in where.items() if len(m) > 1} == {}


def test_no_module_imports_a_private_name():
    """Inside the package nothing imports another module's private name; MindSpore's only in the door."""
    offenders = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.ImportFrom):
                module_private = any(_private(part) for part in (node.module or "").split("."))
                offenders += [(name, node.module, a.name) for a in node.names if _private(a.name) or module_private]
            elif isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name) \
                    and node.value.id in ("ms", "mindspore"):
                offenders.append((name, node.value.id, node.attr))
    assert [o for o in offenders if o[0] != MINDSPORE_DOOR] == []
    assert {o[2] for o in offenders if o[0] == MINDSPORE_DOOR} == {"_pynative_executor", "_no_grad",
                                                                   "MixedPrecisionType", "_DispatchGuardStack",
                                                                   "pyboost_view"}


def test_the_checker_sees_a_private_import(tmp_path):
    tree = ast.parse("from .region import _Helper\nimport mindspore as ms\nms._no_grad()\n")
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    attrs = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    assert [n for n in names + attrs if _private(n)] == ["_Helper", "_no_grad"]


# What trainers call (the README's "In a trainer": MindFormers, HyperParallel, MindSpeed; docs/architecture.md's rule
# that __all__ is what trainers call) and the types they get back; engine internals live in their subpackages.
PUBLIC_API = {
    "AcConfig", "AcPlan", "CheckpointPolicy", "ConfigError", "LayerPlan", "RecomputeCommConfig", "RecomputeConfig",
    "RecomputeError",
    "RecomputeStats", "StepMemory", "SwapConfig", "SwapManager", "SwapReport", "ac_state", "apply_ac",
    "async_save_on_cpu", "checkpoint", "checkpoint_wrapper", "get_recompute_metadata", "get_single_layer_whitelist",
    "is_in_recompute", "measure_step", "parse_layer_specs", "plan_ac", "remove_ac", "remove_swap_wrapper",
    "save_for_recompute", "swap",
    "swap_tensor_wrapper", "swap_wrapper", "unwrap",
}


def test_public_api_is_what_users_call():
    import mindformers_ac as mac
    import mindformers_ac.swap as swap_pkg

    assert set(mac.__all__) == PUBLIC_API and len(mac.__all__) == len(PUBLIC_API)
    assert all(getattr(mac, name) is not None for name in mac.__all__)
    assert swap_pkg is mac.swap and swap_pkg.__name__ == "mindformers_ac.swap"
    assert callable(mac.swap) and hasattr(swap_pkg, "install_layer_swap")   # the engine, callable as HP's swap


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

    from mindformers_ac.mindspore_compat import MIN_MINDSPORE, require_mindspore

    require_mindspore()   # the installed one is recent enough
    monkeypatch.delattr(mindspore.utils, "MsDispatchMode")   # as in MindSpore 2.8
    with pytest.raises(ImportError) as err:
        require_mindspore()
    assert MIN_MINDSPORE == "2.9.0"
    assert f"needs MindSpore >= {MIN_MINDSPORE}" in str(err.value)
    assert f"pip install 'mindspore>={MIN_MINDSPORE}'" in str(err.value)


# -- the action registry: plan.py, apply.py and model_checks.py loop over actions and know none by name ---------

@pytest.mark.parametrize("module", ["plan", "apply", "model_checks"])
def test_the_loops_over_actions_import_no_action(module):
    import mindformers_ac.actions as actions
    from mindformers_ac.actions import ACTIONS, Action

    known = _modules()
    name, path = f"mindformers_ac.{module}", known[f"mindformers_ac.{module}"]
    action_names = {cls.__name__ for cls in vars(actions).values() if isinstance(cls, type) and issubclass(cls, Action)}
    action_names |= {cls.__name__ for cls in ACTIONS} | {"RegionAction"}
    tree = ast.parse(open(path, encoding="utf-8").read())
    from_actions = [d for d in _imports(name, path, known) if d.startswith("mindformers_ac.actions")]
    assert from_actions == ([] if module == "model_checks" else ["mindformers_ac.actions"])   # the registry only
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert sorted(used & action_names) == []


# -- MindSpore's private names: only in mindspore_compat.py ---------------------------------------------------------

# Python's own names that MindSpore objects also carry (not MindSpore's private API).
_PYTHON_NAMES = {"__deepcopy__", "__copy__", "__getstate__", "__setstate__", "__reduce__", "__reduce_ex__",
                 "__metaclass__", "__del__", "__wrapped__", "__annotations__", "__abstractmethods__", "__slots__",
                 "__weakref__", "__dict__", "__getattr__", "__signature__"}


def _mindspore_private_names():
    """The ``_``-names MindSpore's objects carry (a Cell, a Tensor, a Parameter, a Primitive, an ms.jit function,
    instances and classes) that no Python builtin type has: MindSpore's private API."""
    import functools

    import mindspore as ms
    import numpy as np
    from mindspore import nn

    python = set(_PYTHON_NAMES)
    for x in (object, type, int, float, complex, str, bytes, list, dict, set, tuple, functools.partial, property,
              classmethod, staticmethod, Exception, np.ndarray, lambda: 0):
        python |= set(dir(x))

    def plain(x):
        return x

    objects = [nn.Cell(), nn.Cell, ms.Tensor([1.0]), ms.Tensor, ms.Parameter(ms.Tensor([1.0]), name="p"),
               ms.ops.Add(), ms.ops.Primitive, ms.jit(plain)]
    found = set()
    for obj in objects:
        found |= {n for n in set(dir(obj)) | set(getattr(obj, "__dict__", {})) if n.startswith("_")}
    return found - python


def _own_names(tree):
    """Names a module gives its own objects: ``self.x = ...`` targets, defined functions and methods, class
    attributes and ``__slots__`` entries (a class of ours may call an attribute what MindSpore does)."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            own |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
    return own


def _private_uses(source, private):
    """``(name, line)`` of each MindSpore private name ``source`` reads: an attribute (``cell._recompute_cell``)
    or a string (``getattr(fn, "__wrapped_by_jit__")``), unless the module names its own objects so."""
    tree = ast.parse(source)
    own = _own_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            name = node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value
        else:
            continue
        if name in private and name not in own:
            found.append((name, node.lineno))
    return found


def test_mindspore_private_names_are_read_in_mindspore_compat_only():
    private = _mindspore_private_names()
    found = {name: _private_uses(open(path, encoding="utf-8").read(), private) for name, path in _modules().items()}
    assert {m: uses for m, uses in found.items() if uses and m != MINDSPORE_DOOR} == {}
    assert {"_recompute_cell", "__wrapped_by_jit__", "_lazy_forward_hook", "_requires_grad"} <= \
        {name for name, _ in found[MINDSPORE_DOOR]}


def test_the_private_name_scan_finds_a_planted_use():
    private = _mindspore_private_names()
    source = ("class Mine:\n    def __init__(self):\n        self._cells = {}\n    def size(self):\n"
              "        return len(self._cells)\n"
              "def check(cell, fn):\n    return cell._recompute_cell, getattr(fn, '__wrapped_by_jit__', False)\n")
    assert {"_cells", "_recompute_cell", "__wrapped_by_jit__"} <= private
    assert _private_uses(source, private) == [("_recompute_cell", 7), ("__wrapped_by_jit__", 7)]


# -- ... nor rebinds MindSpore's attributes by a string name (setattr, delattr, object.__setattr__) ---------------

_REBINDERS = {"setattr", "delattr", "__setattr__", "__delattr__"}


def _mindspore_attribute_names():
    """MindSpore's private names, and every name of the PyNative executor (its methods are what a patch on it
    replaces): an attribute of these rebound by a string is a change to MindSpore."""
    from mindformers_ac.mindspore_compat import pynative_executor

    python = set(_PYTHON_NAMES)
    for x in (object, type):
        python |= set(dir(x))
    return _mindspore_private_names() | (set(dir(pynative_executor)) - python)


def _string_constants(tree):
    """Module-level ``NAME = "text"`` assignments: a rebinder's name argument is often such a constant."""
    return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for t in node.targets if isinstance(t, ast.Name)}


def _string_rebinds(source, names):
    """``(name, line)`` of each ``setattr`` / ``delattr`` / ``object.__setattr__`` / ``object.__delattr__`` call
    whose attribute name (a literal or a module-level string constant) is one of MindSpore's ``names``, unless
    the module names its own objects so."""
    tree = ast.parse(source)
    own, constants = _own_names(tree), _string_constants(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or len(node.args) < 2:
            continue
        func = node.func
        called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if called not in _REBINDERS:
            continue
        arg = node.args[1]
        name = arg.value if isinstance(arg, ast.Constant) else constants.get(arg.id) if isinstance(arg, ast.Name) \
            else None
        if isinstance(name, str) and name in names and name not in own:
            found.append((name, node.lineno))
    return found


def _rebinds_outside_the_door():
    names = _mindspore_attribute_names()
    found = {m: _string_rebinds(open(path, encoding="utf-8").read(), names) for m, path in _modules().items()
             if m != MINDSPORE_DOOR}
    return {(m, name) for m, uses in found.items() for name, _ in uses}


def test_mindspore_attributes_are_rebound_by_string_in_mindspore_compat_only():
    assert _rebinds_outside_the_door() == set()


def test_the_rebind_scan_finds_a_planted_setattr():
    names = _mindspore_attribute_names()
    source = ('_HOOK = "push_saved_tensor_hook"\n'
              "def patch(ex, cell, fn):\n    setattr(ex, _HOOK, fn)\n    object.__setattr__(cell, '_cells', {})\n"
              "    setattr(cell, 'mac_mark', True)\n    delattr(ex, 'set_mixed_precision_type')\n")
    assert _string_rebinds(source, names) == [("push_saved_tensor_hook", 3), ("_cells", 4),
                                              ("set_mixed_precision_type", 6)]


# -- every module of a subpackage is named in its __init__ docstring (or none is) -----------------------------------

def _named_modules(package_dir):
    doc = ast.get_docstring(ast.parse(open(os.path.join(package_dir, "__init__.py"), encoding="utf-8").read())) or ""
    modules = sorted(f[:-3] for f in os.listdir(package_dir) if f.endswith(".py") and f != "__init__.py")
    return modules, [m for m in modules if f"``{m}``" in doc or f"``{m}.py``" in doc]


def test_a_subpackage_docstring_names_all_its_modules_or_none():
    packages = [os.path.join(PACKAGE, d) for d in sorted(os.listdir(PACKAGE))
                if os.path.isfile(os.path.join(PACKAGE, d, "__init__.py"))]
    assert len(packages) >= 6
    partial = {}
    for package in packages:
        modules, named = _named_modules(package)
        if named and named != modules:
            partial[os.path.basename(package)] = sorted(set(modules) - set(named))
    assert partial == {}


# Frame walking (issue 37): no module of the package takes a frame or walks to its caller. The one place that
# reads the Python stack at all, checkpoint(debug=True)'s op log (the line of model code that ran each op, by
# request: docs/exactness.md, "What the package reads"), takes the stdlib's summary of it.
_FRAME_WALKS = {"_getframe", "f_back", "currentframe", "f_locals", "f_globals", "walk_stack", "stack"}
STACK_READERS = {"mindformers_ac.recompute.debug_log"}
# live-stack reads (a traceback of a caught exception, as the harness reports it, is not one)
_FRAME_NAMES = _FRAME_WALKS | {"extract_stack", "format_stack", "print_stack"}


def _frame_reads(tree):
    """Each use of a live-stack-reading name: as an attribute (``sys._getframe``, ``frame.f_back``,
    ``inspect.stack``) or imported by name (``from inspect import currentframe``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ((node.attr in _FRAME_NAMES and node.attr != "stack") or (
                node.attr == "stack" and getattr(node.value, "id", None) == "inspect")):
            found.append(node.attr)
        elif isinstance(node, ast.ImportFrom) and node.module in ("sys", "inspect", "traceback"):
            found += [a.name for a in node.names if a.name in _FRAME_NAMES]
    return sorted(found)


def test_no_frame_walking_in_the_package():
    """Issue 37: no frame walking in the package (engine decisions come from what it tracks); the op log
    of debug=True reads the stdlib's stack summary, and nothing else reads the stack."""
    readers = {name: reads for name, path in _modules().items()
               if (reads := _frame_reads(ast.parse(open(path, encoding="utf-8").read())))}
    assert not {name: reads for name, reads in readers.items() if set(reads) & _FRAME_WALKS}, readers
    assert set(readers) == STACK_READERS, readers


def test_the_frame_scan_sees_a_frame_walk():
    walk = "import sys\ndef f():\n    frame = sys._getframe(1)\n    return frame.f_back.f_locals\n"
    assert _frame_reads(ast.parse(walk)) == ["_getframe", "f_back", "f_locals"]
    assert _frame_reads(ast.parse("import inspect\nx = inspect.stack()\n")) == ["stack"]
    assert _frame_reads(ast.parse("from inspect import currentframe\n")) == ["currentframe"]
    assert _frame_reads(ast.parse("import traceback\nx = traceback.extract_tb(e.__traceback__)\n")) == []
