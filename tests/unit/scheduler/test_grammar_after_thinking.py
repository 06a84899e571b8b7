"""A reasoning model's grammar holds only after its thinking (SamplingParams.structured_output_after): the row
finds the end of thinking however the output's tokens arrive, and a prompt that closed the thinking already leaves
the grammar on from the start."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.grammar_masks import ConstrainedRow, thinking_end

END = (7, 8, 9)   # </think> as three tokens; a real model's is one added token


def after_thinking(output: list[int], cuts: list[int]) -> list[int] | None:
    """What the grammar is handed once the row sees the end, with the output arriving in pieces at the cuts."""
    row = ConstrainedRow(thinking_end=END)
    bounds = [0, *sorted({c % (len(output) + 1) for c in cuts}), len(output)]
    handed = None
    for start, stop in zip(bounds, bounds[1:]):
        if handed is not None:
            handed += output[start:stop]
        elif (after := row.thoughts_end(output[start:stop])) is not None:
            handed = after
    assert row.thinking() == (handed is None)
    return handed


@given(thought=st.lists(st.integers(1, 12), max_size=12), answer=st.lists(st.integers(1, 12), max_size=6),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_the_grammar_gets_exactly_the_tokens_after_the_first_end_of_thinking(thought, answer, cuts):
    output = [*thought, *END, *answer]
    first = next(i for i in range(len(output)) if tuple(output[i:i + len(END)]) == END)
    assert after_thinking(output, cuts) == output[first + len(END):]


def test_an_output_that_never_ends_its_thinking_stays_unconstrained():
    assert after_thinking([7, 8, 1, 9, 7], [1, 2, 3]) is None


@pytest.mark.parametrize("prompt, waits", [([1, 2, 3], True), ([1, 7, 8, 9, 4], False), ([7, 8], True), ([], True)])
def test_a_prompt_that_closed_the_thinking_leaves_nothing_to_wait_for(prompt, waits):
    assert thinking_end(END, prompt) == (END if waits else ())
    assert thinking_end((), prompt) == ()
