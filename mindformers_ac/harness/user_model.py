"""``--model MODULE:FUNCTION``: the user's own model for ``train``, ``plan`` and ``explain``.

The contract:

* MODULE is imported with the current directory on the import path, as
  ``python -m`` would;
* ``FUNCTION()`` takes no arguments and returns ``(model, make_inputs)``:
  ``model`` is a ``mindspore.nn.Cell`` and ``model(*make_inputs(step))``
  returns the scalar loss of step ``step`` (0, 1, ...);
* every call of FUNCTION builds the same initial weights (``train`` builds
  the model in several processes, ``plan`` several times in one);
* a FUNCTION that returns only a model keeps the older meaning: it is called
  as ``model(tokens, labels)`` with the reference synthetic batch
  (``models.SyntheticBatches``, shaped by ``--batch --seq --vocab --seed``).

Every breach is a ``ConfigError`` naming what is wrong: the module cannot be
imported, the function is missing, the return value has the wrong shape, the
loss is not a scalar, or the layer list is not found (``--layer-list PATH``
names it). Exceptions raised by the user's code, ``sys.exit`` included, are
reported as one line with the place they were raised, never as a traceback
(nor as a silent exit, which would read as a verdict).

Harness code: the library (config, plan, apply, engines, accounting) never
imports it.
"""
import importlib
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import ConfigError

FLAG = "--model"
_MAX_MESSAGE = 400   # characters of a user exception's message kept in an error (bounded output)
_MAX_NAMES = 12      # functions listed when the one asked for is missing


def describe_exception(exc):
    """``Type: message (at file.py:line)`` of an exception, on one bounded line (a user's, or MindSpore's).

    The place is the innermost frame outside installed packages (the user's
    code rather than MindSpore's), or where a ``SyntaxError`` is.
    """
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f" (at {os.path.basename(exc.filename)}:{exc.lineno})"
    else:
        frames = traceback.extract_tb(exc.__traceback__)
        own = [f for f in frames if "site-packages" not in f.filename and not f.filename.startswith("<")]
        frame = (own or frames or [None])[-1]
        where = f" (at {os.path.basename(frame.filename)}:{frame.lineno})" if frame else ""
    if isinstance(exc, SystemExit):   # str() would be the bare code: "0", or "" for sys.exit()
        message = f"sys.exit({exc.code!r})" if exc.code is not None else "sys.exit()"
    else:   # MindSpore frames its messages with lines of dashes: drop them, keep the words
        message = " ".join(word for word in str(exc).split() if word.strip("-"))
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + " ..."
    return f"{type(exc).__name__}: {message}{where}" if message else f"{type(exc).__name__}{where}"


def import_factory(spec):
    """The function ``spec`` (``"MODULE:FUNCTION"``) names, MODULE imported with the current directory
    first on ``sys.path`` (added there once, as ``python -m`` does, so the module's own imports work too).

    Raises ``ConfigError`` (field ``--model``) for a malformed spec, a module
    that is not found or fails to import, and a missing or non-callable FUNCTION.
    """
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(FLAG, f"expected MODULE:FUNCTION (e.g. my_models:build), got {str(spec)[:200]!r}")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigError(FLAG, f"cannot import module {module_name!r}: not found in the current directory "
                                    f"({cwd}) or on the Python path") from None
        raise ConfigError(FLAG, f"cannot import module {module_name!r}: importing it raised "
                                f"{describe_exception(exc)}") from None
    except (Exception, SystemExit) as exc:   # anything the module's own code raises (or exits) while imported
        raise ConfigError(FLAG, f"cannot import module {module_name!r}: importing it raised "
                                f"{describe_exception(exc)}") from None
    function = getattr(module, attr, None)
    if function is None:
        defined = sorted(name for name, value in vars(module).items()
                         if callable(value) and not name.startswith("_")
                         and getattr(value, "__module__", None) == module.__name__)
        listed = ", ".join(defined[:_MAX_NAMES]) + (" ..." if len(defined) > _MAX_NAMES else "")
        raise ConfigError(FLAG, f"module {module_name!r} ({getattr(module, '__file__', '?')}) has no function "
                                f"{attr!r}; it defines: {listed or 'no functions'}")
    if not callable(function):
        raise ConfigError(FLAG, f"{module_name}:{attr} is a {type(function).__name__}, not a function")
    return function


def _kind(value):
    return type(value).__name__


@dataclass(frozen=True)
class UserModel:
    """The user's model behind ``--model``: build it and check it against the contract.

    ``layers``: the layer-list path (``--layer-list``), None to find it
    automatically. ``synthetic``: ``make_inputs`` for a FUNCTION that returns a
    model only. ``data_flags``: the data flags (``batch``, ``seq`` ...) the
    user gave; they shape only that synthetic batch, so they are an error for a
    FUNCTION that returns its own ``make_inputs``.
    """

    spec: str
    layers: Optional[str]
    synthetic: Callable
    data_flags: tuple = ()

    def build(self):
        """Call FUNCTION once; return ``(model, make_inputs)``.

        Checks what can be checked without running the model: the import, the
        return value's shape, the layer list. Raises ``ConfigError``. The
        ``make_inputs`` returned checks each of its results: a ``ConfigError``
        when the user's function raises or returns no tuple.
        """
        function = import_factory(self.spec)
        try:
            returned = function()
        except (Exception, SystemExit) as exc:   # the user's code: report it, don't crash or exit silently
            raise ConfigError(FLAG, f"{self.spec}() raised {describe_exception(exc)}") from None
        model, make_inputs = self._unpack(returned)
        self._check_layers(model)
        return model, self._checked_inputs(make_inputs)

    def _checked_inputs(self, make_inputs):
        spec = self.spec

        def checked(step):
            try:
                inputs = make_inputs(step)
            except (Exception, SystemExit) as exc:
                raise ConfigError(FLAG, f"make_inputs({step}) of {spec} raised {describe_exception(exc)}") from None
            if not isinstance(inputs, (tuple, list)):
                raise ConfigError(FLAG, f"make_inputs({step}) of {spec} returned a {_kind(inputs)}; expected a tuple "
                                        f"of the model's inputs (the loss is model(*make_inputs(step)))")
            return inputs
        return checked

    def _unpack(self, returned):
        from mindspore import nn
        if isinstance(returned, nn.Cell):
            return returned, self.synthetic
        expected = ("expected (model, make_inputs): a mindspore.nn.Cell and a function of the step number "
                    "returning the model's inputs, or a model alone")
        if not isinstance(returned, (tuple, list)):
            raise ConfigError(FLAG, f"{self.spec}() returned a {_kind(returned)}; {expected}")
        if len(returned) != 2:
            raise ConfigError(FLAG, f"{self.spec}() returned a {_kind(returned)} of {len(returned)} items; {expected}")
        model, make_inputs = returned
        if not isinstance(model, nn.Cell):
            raise ConfigError(FLAG, f"{self.spec}() returned ({_kind(model)}, {_kind(make_inputs)}): the model "
                                    f"is a {_kind(model)}, not a mindspore.nn.Cell; {expected}")
        if not callable(make_inputs):
            raise ConfigError(FLAG, f"{self.spec}() returned ({_kind(model)}, {_kind(make_inputs)}): make_inputs "
                                    f"is a {_kind(make_inputs)}, not a function of the step number; {expected}")
        if self.data_flags:
            flag = self.data_flags[0]
            raise ConfigError(f"--{flag}", f"{self.spec}() returns its own make_inputs, which makes the inputs; "
                                           f"--{flag} shapes only the synthetic batch of a factory that returns "
                                           f"a model alone")
        return model, make_inputs

    def _check_layers(self, model):
        from ..layers import find_layer_stack
        try:
            find_layer_stack(model, self.layers)
        except ConfigError as exc:
            if self.layers is not None:
                raise ConfigError("--layer-list", exc.reason) from None
            raise ConfigError(FLAG, f"{self.spec}: {exc.reason}; on the command line: --layer-list PATH") from None

    def check_loss(self, model, make_inputs):
        """Run ``model(*make_inputs(0))`` once, forward only, and check it returns a floating-point scalar.

        ``make_inputs`` is the one ``build`` returned. Raises ``ConfigError``
        when ``make_inputs(0)`` fails or returns no tuple, when the forward
        raises, or when the result is not a one-element float Tensor. Call it
        on a model that is thrown away after (the forward may change its state:
        BatchNorm statistics, counters), and not in a process that then times
        other models: ``train`` calls it before its runs start in their own
        processes; ``plan`` checks its first profiled step's loss instead
        (``check_loss_value``), because a model run in the profiling process
        besides the profiled ones was measured to slow every profiled step
        about 15-fold.
        """
        inputs = make_inputs(0)
        try:
            loss = model(*inputs)
        except (Exception, SystemExit) as exc:
            raise ConfigError(FLAG, f"model(*make_inputs(0)) of {self.spec} raised "
                                    f"{describe_exception(exc)}") from None
        self.check_loss_value(loss)

    def check_loss_value(self, loss):
        """Raise ``ConfigError`` unless ``loss`` (what ``model(*make_inputs(0))`` returned) is a
        one-element floating-point Tensor."""
        from mindspore import Tensor
        if isinstance(loss, Tensor) and loss.size == 1 and loss.is_floating_point():
            return
        found = (f"a {loss.dtype} Tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor)
                 else f"a {_kind(loss)}")
        raise ConfigError(FLAG, f"model(*make_inputs(0)) of {self.spec} returned {found}; expected the step's "
                                f"loss: a floating-point scalar Tensor")
