"""The router's response stream as HTTP needs it: started (so a refusal still gets its status) or collected whole."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from protos import router_pb2
from router.http.errors import api_error
from router.http.formats import Choice, Collected


async def started(responses: AsyncIterator[router_pb2.GenerateResponse]) -> AsyncIterator[router_pb2.GenerateResponse]:
    """Wait for the first response, so that a rejected request still gets its HTTP status."""
    try:
        first = await anext(responses)
    except StopAsyncIteration:
        first = None
    except Exception as e:
        raise api_error(e) from e
    return prepend(first, responses)


async def prepend(first: router_pb2.GenerateResponse | None,
                  rest: AsyncIterator[router_pb2.GenerateResponse]) -> AsyncIterator[router_pb2.GenerateResponse]:
    async with contextlib.aclosing(rest):
        if first is not None:
            yield first
        async for response in rest:
            yield response


async def collect(responses: AsyncIterator[router_pb2.GenerateResponse], num_samples: int) -> Collected:
    """The whole answer. num_samples is the client's `n`, checked only once the stream starts: a choice is made when
    its first response comes, so an `n` of 2**31 is refused (400) instead of filling memory with empty choices."""
    choices: dict[int, Choice] = {}
    usage = None
    async with contextlib.aclosing(responses):
        try:
            async for response in responses:
                if response.index not in choices:
                    choices[response.index] = Choice(response.index)
                choices[response.index].add(response)
                if response.HasField("usage"):
                    usage = response.usage
        except Exception as e:
            raise api_error(e) from e
    return Collected([choices.get(i) or Choice(i) for i in range(num_samples)], usage)
