"""Where an excluded op is reached, so that the light path can keep it without intercepting every op.

``exclude_op`` (an ``exclude_policy``) decides by the op's name and where it
runs, nothing else: once a first, intercepted call has seen which ops it
keeps, the same ops are kept in every later call of that call signature. The
light path sees no op, so the decision is installed where the op is reached,
a *keep site*:

* ``attr``: an op attribute of a cell of the region (``self.bmm_qk``,
  ``self.softmax = mint.nn.functional.softmax``), reached through the policy's
  ``AttrProxy``;
* ``item``: a Primitive a cell holds in a dict attribute (the lazily built
  collectives of ``harness.tp``: ``self._prims["AllGather"]``), the cells held
  in dicts (MindFormers' ``_comm_ops`` slots) counting as the region's
  (``region_cells``);
* ``function``: a MindSpore function that a cell's ``construct`` calls by a
  global name (``ops.matmul``, ``mint.nn.functional.softmax``, ``matmul``
  imported by name). That construct is run, for this cell, as a copy whose
  globals see a proxy under that name (``RedirectedMethod``); every other
  global is the module's, checked for a change on every call.

A site holds a ``KeepProxy``. In a light run whose signature keeps the site it
hands the call to the region (``LightRegion.keep_call``: forward keeps the
outputs and whatever the call saved; the recompute returns those outputs
without running the op); everywhere else it calls the op.

``find_site`` names the site of one dispatched op from the Python stack: the
frame of the first caller outside MindSpore and this package (the model's
code) and the frame it called. A site qualifies only if every op dispatched
under it in the checking call was kept (``Region.settle_sites``). What has no
site keeps its signature on the intercepting path, with the reason in
``RecomputeStats.intercept_reasons``: an op called as a Tensor method or an
operator (C code: no Python frame between the model and the op), from a
module-level function (no cell holds it), inside a MindSpore cell (``nn.Dense``:
a whole cell is not kept), from a sub-cell whose construct another wrapper
replaced, or from a construct that assigns module globals.
"""
import dis
import sys
import types

from mindspore import nn
from mindspore.ops import Primitive

from ..construct_patch import ConstructPatch
from .op_slot import OpSlotProxy
from .state import ENGINE
from .tracking import AttrProxy

KEEP_SITE_KIND = "keep_site"
_MAX_PATH = 3   # ops.matmul, mint.nn.functional.softmax
_ENGINE_PACKAGE = __name__.split(".")[0] + "."
_MODEL_CODE = (_ENGINE_PACKAGE + "harness",)   # the package's own reference models are model code


def decides_by_site(policy_fn):
    """Whether ``policy_fn`` says its answers depend on the op's name and place only (``exclude_policy``'s
    do): its kept ops may then be installed at their keep sites."""
    return getattr(policy_fn, "decides_by_site", False) is True


def _is_engine_frame(frame):
    module = frame.f_globals.get("__name__", "")
    if module == "mindspore" or module.startswith("mindspore."):
        return True
    return module.startswith(_ENGINE_PACKAGE) and not module.startswith(_MODEL_CODE)


class KeepProxy(OpSlotProxy):
    """Stands where an excluded op is reached; in a light run that keeps it, the region takes the call."""

    def __init__(self, inner, description):
        self.mac_inner, self.mac_description = inner, description

    def __call__(self, *args, **kwargs):
        run = ENGINE.top()
        if run is None or run.keeps is None or self not in run.keeps:
            return self.mac_inner(*args, **kwargs)
        return run.region.keep_call(run, self, args, kwargs)


class Site:
    """One place an excluded op is reached (see the module docstring); ``key`` identifies it."""

    __slots__ = ("kind", "key", "cell", "where", "callee", "description")

    def __init__(self, kind, key, cell, where, callee, description):
        self.kind, self.key, self.cell, self.where, self.callee = kind, key, cell, where, callee
        self.description = description


class NoSite:
    """An op reached where no proxy can stand; ``why`` says where, for ``intercept_reasons``.

    ``held``: the object whose ``id`` is in ``key``, kept alive until the check ends, so that no object
    made later in the same forward (a primitive built on first use) takes its address and its key.
    """

    __slots__ = ("key", "why", "held")

    def __init__(self, key, why, held=None):
        self.key, self.why, self.held = key, why, held


def region_cells(root):
    """``(id -> cell, id -> path)`` of the cells a region rooted at ``root`` runs: its sub-cells, and cells
    held in dict attributes (MindFormers' ``_comm_ops`` slots, which the cell tree does not list)."""
    cells, paths = {}, {}
    todo = [("", root)] if root is not None else []
    while todo:
        prefix, top = todo.pop()
        for name, cell in top.cells_and_names():
            if id(cell) in cells:
                continue
            path = f"{prefix}.{name}" if prefix and name else (prefix or name)
            cells[id(cell)], paths[id(cell)] = cell, path
            for attr, value in vars(cell).items():
                if isinstance(value, dict):
                    todo.extend((f"{path + '.' if path else ''}{attr}[{k!r}]", v) for k, v in value.items()
                                if isinstance(v, nn.Cell))
    return cells, paths


def find_site(cells, paths, resolve):
    """The ``Site`` (or ``NoSite``) of the op being dispatched now, from the stack.

    ``cells``: the region's cells (``id`` -> cell); ``paths``: ``id`` -> the
    cell's path in the region, for descriptions. Without ``resolve`` only the
    key is sure (a Primitive is not looked up among the cells' dicts): enough
    to tell which site a recomputed op runs under.
    """
    frame, callee = sys._getframe(1), None   # pylint: disable=protected-access
    while frame is not None and _is_engine_frame(frame):
        callee, frame = frame, frame.f_back
    if frame is None or callee is None:
        return NoSite(("none",), "it runs outside the model's code")
    code, target = frame.f_code, callee.f_locals.get("self")
    if callee.f_code is KeepProxy.__call__.__code__:   # a site installed for another signature
        return Site("proxy", ("keep", id(target)), None, target, None, target.mac_description)
    if callee.f_code is AttrProxy.__call__.__code__:
        return Site("attr", ("slot", id(target)), None, target, None,
                    f"attribute {getattr(target, 'mac_path', '')}".rstrip())
    if isinstance(target, Primitive) and callee.f_code.co_name == "__call__":
        key = ("prim", id(target))
        return _item_site(key, target, cells, paths) if resolve else NoSite(key, "", target)
    if callee.f_code.co_name == "__ms_dispatch__":
        return NoSite(("c", code, frame.f_lasti),
                      f"it is called as a Tensor method, an operator or a C function in {code.co_name}")
    if isinstance(target, nn.Cell) and callee.f_code.co_name == "__call__":
        return NoSite(("cell", id(target)), f"it runs inside the MindSpore cell {type(target).__name__} "
                                            f"(a whole cell is not kept)", target)
    owner = frame.f_locals.get("self")
    cell = owner if isinstance(owner, nn.Cell) and id(owner) in cells else None
    if cell is None or code.co_name != "construct":
        return NoSite(("fn", code, callee.f_code),
                      f"{callee.f_code.co_name} is called from {code.co_name}, which is not a construct of the "
                      f"region's cells")
    path = paths[id(cell)]
    return Site("function", ("fn", id(cell), code, callee.f_code), cell, code, callee.f_code,
                f"{callee.f_code.co_name} in {type(cell).__name__}.construct" + (f" ({path!r})" if path else ""))


def _item_site(key, prim, cells, paths):
    for cell_id, cell in cells.items():
        for attr, value in vars(cell).items():
            if isinstance(value, dict):
                for k, v in value.items():
                    if v is prim or (isinstance(v, KeepProxy) and v.mac_inner is prim):
                        path = paths[cell_id]
                        return Site("item", key, cell, (attr, k), prim,
                                    f"{(path + '.') if path else ''}{attr}[{k!r}]")
    return NoSite(key, f"its primitive {prim.name} is not held by a cell of the region", prim)


def _read_names(code):
    """The names ``code`` reads as globals or attributes, its comprehensions' and lambdas' included (they
    share its globals)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _read_names(const)
    return names


def _global_paths(code, globals_, target):
    """Global name paths (``("ops", "matmul")``) that ``code`` may read to reach the function ``target``."""
    names = _read_names(code)
    found = []

    def walk(obj, path):
        if getattr(obj, "__code__", None) is target:
            found.append(path)
            return
        if len(path) < _MAX_PATH and isinstance(obj, types.ModuleType):
            for name in names:
                sub = getattr(obj, name, None)
                if sub is not None:
                    walk(sub, path + (name,))

    for name in names:
        if name in globals_:
            walk(globals_[name], (name,))
    return found


def _writes_globals(code):
    for instr in dis.get_instructions(code):
        if instr.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            return True
    return any(isinstance(c, types.CodeType) and _writes_globals(c) for c in code.co_consts)


class _Namespace:
    """A module as a redirected construct sees it: the kept names answer with proxies, the rest as the module."""

    def __init__(self, module):
        object.__setattr__(self, "mac_module", module)

    def __getattr__(self, name):
        return getattr(self.__dict__["mac_module"], name)


class RedirectedMethod:
    """A cell's ``construct`` run as a copy of its code whose globals show ``KeepProxy`` objects.

    The copy's globals are a copy of the module's, with each redirected name
    replaced; the other names the code reads are compared with the module's on
    every call and refreshed when the module rebound one (a flag set later).
    """

    def __init__(self, function):
        self.function, self.module_globals = function, function.__globals__
        self.globals = dict(function.__globals__)
        self.watched = _read_names(function.__code__)   # less the redirected heads: compared on every call
        self.copy = types.FunctionType(function.__code__, self.globals, function.__name__,
                                       function.__defaults__, function.__closure__)
        self.copy.__kwdefaults__ = function.__kwdefaults__
        self.patch = None   # the ConstructPatch that runs it on a sub-cell (the root's wrapper runs it itself)

    def redirect(self, path, proxy):
        head = path[0]
        self.watched.discard(head)
        if len(path) == 1:
            self.globals[head] = proxy
            return
        ns = self.globals.get(head)
        if not isinstance(ns, _Namespace):
            ns = self.globals[head] = _Namespace(self.module_globals[head])
        for name in path[1:-1]:
            sub = ns.__dict__.get(name)
            if not isinstance(sub, _Namespace):
                sub = _Namespace(getattr(ns.mac_module, name))
                object.__setattr__(ns, name, sub)
            ns = sub
        object.__setattr__(ns, path[-1], proxy)

    def __call__(self, cell, *args, **kwargs):
        module, mine = self.module_globals, self.globals
        for name in self.watched:
            if name in module and mine.get(name) is not module[name]:
                mine[name] = module[name]
        return self.copy(cell, *args, **kwargs)


def install_site(site, installed, root, redirects):
    """Put a ``KeepProxy`` at ``site``; returns it, or None when the site can't take one now.

    ``installed``: site key -> (proxy, undo) of the wrapper, shared by its
    signatures; ``root``: the region's root cell; ``redirects``: ``id(cell)``
    -> ``RedirectedMethod`` of the wrapper (the root's wrapper runs the root's).
    """
    if site.kind == "proxy":
        return site.where
    held = installed.get(site.key)
    if held is not None:
        return held[0]
    if site.kind == "attr":
        slot = site.where
        if isinstance(slot.mac_inner, KeepProxy):
            proxy = slot.mac_inner
            undo = None
        else:
            proxy = KeepProxy(slot.mac_inner, site.description)
            slot.mac_inner = proxy

            def undo(slot=slot, proxy=proxy):
                if slot.mac_inner is proxy:
                    slot.mac_inner = proxy.mac_inner
    elif site.kind == "item":
        attr, k = site.where
        table = vars(site.cell).get(attr)
        if not isinstance(table, dict) or table.get(k) is not site.callee:
            return None
        proxy = table[k] = KeepProxy(site.callee, site.description)

        def undo(table=table, k=k, proxy=proxy):
            if table.get(k) is proxy:
                table[k] = proxy.mac_inner
    else:
        proxy, undo = _install_function(site, root, redirects)
        if proxy is None:
            return None
    installed[site.key] = (proxy, undo)
    return proxy


def _install_function(site, root, redirects):
    cell, code = site.cell, site.where
    function = getattr(type(cell).construct, "__func__", type(cell).construct)
    if getattr(function, "__code__", None) is not code or _writes_globals(code):
        return None, None
    paths = _global_paths(code, function.__globals__, site.callee)
    if not paths:
        return None, None
    redirect = redirects.get(id(cell))
    if redirect is None:
        if cell is not root and "construct" in vars(cell):
            return None, None   # another wrapper replaced it: the copy would skip that wrapper
        redirect = RedirectedMethod(function)
        if cell is not root:
            redirect.patch = ConstructPatch(cell, KEEP_SITE_KIND, lambda _inner, *a, **k: redirect(cell, *a, **k))
        redirects[id(cell)] = redirect
    proxy = KeepProxy(_resolve(function.__globals__, paths[0]), site.description)
    for path in paths:
        redirect.redirect(path, proxy)

    def undo():
        gone = redirects.pop(id(cell), None)
        if gone is not None and gone.patch is not None:
            gone.patch.remove()
    return proxy, undo


def _resolve(globals_, path):
    obj = globals_[path[0]]
    for name in path[1:]:
        obj = getattr(obj, name)
    return obj
