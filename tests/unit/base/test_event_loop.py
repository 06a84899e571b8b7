"""The services' event loop: uvloop unless FERRY_EVENT_LOOP=asyncio asks for asyncio's own."""
import asyncio

import pytest

from base import event_loop


async def running_loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_services_run_on_uvloop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")
    monkeypatch.delenv("FERRY_EVENT_LOOP", raising=False)
    assert event_loop.run(running_loop_module()).startswith("uvloop")


def test_asyncio_loop_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_EVENT_LOOP", "asyncio")
    assert event_loop.run(running_loop_module()).startswith("asyncio")
