"""``apply_ac`` says what it applied once, where a user sees it.

Through the application's logging config when there is one (the
``mindformers_ac`` logger, INFO), on stderr when logging is not configured
at all, and through MindFormers' logger when MindFormers is loaded.
Per-layer detail is debug level.
"""
import logging
import sys
import types

import pytest

import mindformers_ac as mac

CONFIG = {"recompute": {"mode": "select", "full_recompute_layer": ["0-1"], "select_module": {"mlp": ["2-3"]}},
          "swap": {"enable": True, "default_prefetch": 1, "layer_swap": [{"layers": ["4-6"]}]}}
SUMMARY = "apply_ac: full recompute on layers 0-1; select recompute on layers 2-3 (mlp); layer swap on layers 4-6 " \
          "(prefetch 1)"


@pytest.fixture
def model(gpt8):
    yield gpt8
    if mac.ac_state(gpt8) is not None:
        mac.remove_ac(gpt8)


def test_one_summary_at_info_and_the_per_layer_detail_at_debug(model, caplog):
    with caplog.at_level(logging.INFO, logger="mindformers_ac"):
        mac.apply_ac(model, config=CONFIG)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == [SUMMARY]
    assert caplog.records[0].name == "mindformers_ac" and caplog.records[0].funcName == "apply_ac"
    mac.remove_ac(model)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="mindformers_ac"):
        mac.apply_ac(model, config=CONFIG)
    assert "Set full recompute at layer 1" in caplog.text and "Set select recompute at layer 3: mlp" in caplog.text


def test_summary_of_nothing_and_of_warnings(model, caplog):
    with caplog.at_level(logging.INFO, logger="mindformers_ac"):
        mac.apply_ac(model, config={"recompute": {"mode": "select", "select_module": {"nothing": [0]}}})
    assert caplog.records[-1].getMessage() == \
        "apply_ac: nothing to install (no layer is recomputed or swapped) (1 warning: see plan.explain())"


def _unconfigure(monkeypatch):
    """Logging as in a script that never configured it (pytest's own handlers taken off the root)."""
    monkeypatch.setattr(logging.root, "handlers", [])
    for name in ("mindformers_ac", "mindformers_ac.recompute", "mindformers_ac.swap"):
        monkeypatch.setattr(logging.getLogger(name), "handlers", [])
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)


def test_unconfigured_logging_still_shows_the_summary_on_stderr(model, monkeypatch, capsys):
    _unconfigure(monkeypatch)
    mac.apply_ac(model, config=CONFIG)
    err = capsys.readouterr().err
    assert err.splitlines() == [f"[INFO] mindformers_ac: {SUMMARY}"]
    assert not logging.root.handlers and not logging.getLogger("mindformers_ac").handlers   # nothing left behind


def test_a_level_or_handler_the_user_set_is_respected(model, monkeypatch, capsys):
    _unconfigure(monkeypatch)
    monkeypatch.setattr(logging.getLogger("mindformers_ac"), "level", logging.WARNING)   # "keep it quiet"
    mac.apply_ac(model, config=CONFIG)
    assert capsys.readouterr().err == ""
    mac.remove_ac(model)
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    monkeypatch.setattr(logging.getLogger("mindformers_ac"), "level", logging.NOTSET)
    monkeypatch.setattr(logging.root, "handlers", [handler])   # a configured application, root at WARNING
    mac.apply_ac(model, config=CONFIG)
    assert capsys.readouterr().err == "" and seen == []


def test_mindformers_logger_is_used_when_mindformers_is_loaded(model, monkeypatch, caplog):
    said = []

    class _Logger:   # MindFormers' ``logger``: a class with classmethods info / warning / ...
        @classmethod
        def info(cls, msg, *args):
            said.append(msg % args if args else msg)
    package = types.ModuleType("mindformers")
    package.__path__ = []
    tools = types.ModuleType("mindformers.tools")
    tools.__path__ = []
    logger_module = types.ModuleType("mindformers.tools.logger")
    logger_module.logger = _Logger
    monkeypatch.setitem(sys.modules, "mindformers", package)
    monkeypatch.setitem(sys.modules, "mindformers.tools", tools)
    monkeypatch.setitem(sys.modules, "mindformers.tools.logger", logger_module)
    with caplog.at_level(logging.INFO, logger="mindformers_ac"):
        mac.apply_ac(model, config=CONFIG)
    assert said == [SUMMARY]
    assert SUMMARY not in caplog.text   # once, in the host's log

    class _Broken:
        @classmethod
        def info(cls, msg):
            raise OSError("log directory is read-only")
    logger_module.logger = _Broken
    mac.remove_ac(model)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mindformers_ac"):
        mac.apply_ac(model, config=CONFIG)   # a broken host logger never fails apply_ac
    assert SUMMARY in caplog.text
