"""`vllm serve` stopped on purpose (SIGTERM, Ctrl-C) logs no traceback:
AsyncLLM.shutdown() stops the engine core before it cancels the output
handler, which then sees the engine's end (EngineDeadError) and logged it as
a failure with a traceback (the soak's one failure, 2026-12-02; upstream
issue 48745). The handler runs here on an engine client whose outputs end
in that error; an engine that dies without a shutdown still logs it."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError


class _EngineCore:
    """An engine client whose output stream ends as a stopped engine's does."""

    async def get_output_async(self):
        raise EngineDeadError()

    def shutdown(self, timeout=None):  # AsyncLLM's __del__ calls it
        pass


def _handler_log(shutting_down: bool, caplog) -> tuple[list[logging.LogRecord], list]:
    # Only what _run_output_handler reads: the real one needs an engine.
    llm = object.__new__(AsyncLLM)
    propagated = []
    llm.engine_core = _EngineCore()
    llm.output_processor = SimpleNamespace(propagate_error=propagated.append)
    llm.log_stats = False
    llm.logger_manager = None
    llm.renderer = None
    llm.output_handler = None
    llm._shutting_down = [shutting_down]

    async def run():
        llm._run_output_handler()
        await llm.output_handler

    with caplog.at_level(logging.DEBUG, logger="vllm"):
        asyncio.run(run())
    return [r for r in caplog.records if r.name.startswith("vllm")], propagated


@pytest.mark.parametrize("shutting_down", [True, False])
def test_output_handler_logs_an_engine_end_as_a_failure_only_without_shutdown(
        shutting_down, caplog):
    records, propagated = _handler_log(shutting_down, caplog)
    failed = [r for r in records if "output_handler failed" in r.getMessage()]
    # the requests still waiting learn of the engine's end either way
    assert len(propagated) == 1 and isinstance(propagated[0], EngineDeadError)
    if shutting_down:
        assert not failed and not any(r.exc_info for r in records)
        assert any("engine core shut down" in r.getMessage() for r in records)
    else:
        assert len(failed) == 1 and failed[0].exc_info


def test_shutdown_marks_the_engine_end_as_expected():
    llm = object.__new__(AsyncLLM)
    llm._shutting_down = [False]
    stopped = []
    llm.engine_core = SimpleNamespace(shutdown=lambda timeout=None: stopped.append(
        llm._shutting_down[0]))
    llm.shutdown()
    # set before the engine core is stopped: the handler can never see the
    # engine's end first
    assert stopped == [True] and llm._shutting_down == [True]
