"""In a batch, logits processors and stopping criteria see every row as plain `generate` shows it at that step, and
rows that finished early are scored as `generate` scores them, on left-padded batches of the tiny float32 targets.

Rows accept different numbers of drafts per round. Processors and criteria known to act row by row are called on
the rows of equal length; any other one makes the rows step-aligned and is called on the whole batch.
"""

import pytest
import torch
from tiny_models import (
    BOS, EOS, PAD, TARGETS, agreeing_prompts, fitted_draft, left_pad, letters_tokenizer, random_prompts,
)
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers import generation as stock

from dspark.generation_utils import ROW_WISE, _rows_of, dspark_generate

MAX_NEW_TOKENS = 16


def _batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts: two the fitted draft agrees with (long accepts), one random (short accepts)."""
    return left_pad(agreeing_prompts(name, 2, seed=8) + random_prompts(1, 3, 5, seed=8))


def _row_tokens(target, input_ids, attention_mask, steps: list[int], **kwargs) -> list[int]:
    """Per row b, the token plain greedy decoding (no EOS) generates at new-token index steps[b]."""
    plain = target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                            eos_token_id=None, **kwargs)
    return [int(plain[row, input_ids.shape[1] + step]) for row, step in enumerate(steps)]


class StopAtRowToken(StoppingCriteria):
    """Row b stops once it generates `tokens[b]`: a criterion with one entry per batch row. Records its calls."""

    def __init__(self, tokens: list[int]):
        self.tokens = torch.tensor(tokens)
        self.calls = []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append(input_ids.clone())
        return input_ids[:, -1] == self.tokens


class BanRowToken(LogitsProcessor):
    """Row b may never generate `tokens[b]`, nor the token after its last one (`input_ids[b, -1] + 1`): a processor
    with one entry per batch row that reads the sequences. Records the sequences it is called on."""

    def __init__(self, tokens: list[int]):
        self.tokens = torch.tensor(tokens)
        self.calls = []

    def __call__(self, input_ids, scores):
        self.calls.append(input_ids.clone())
        banned = torch.stack([self.tokens, (input_ids[:, -1] + 1) % scores.shape[-1]], dim=-1)
        return scores.scatter(1, banned, float("-inf"))


def test_a_per_row_stopping_criterion_is_called_exactly_as_plain_generate_calls_it():
    """Each row stops at its own token (new tokens 6, 7 and 8): the criterion gets the whole batch, finished rows
    padded, once per step, the same calls as from plain `generate`."""
    target, draft = TARGETS["qwen3"](), fitted_draft("qwen3")
    input_ids, attention_mask = _batch("qwen3")
    stop_tokens = _row_tokens(target, input_ids, attention_mask, steps=[5, 6, 7])
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=EOS)

    plain_criterion, dspark_criterion = StopAtRowToken(stop_tokens), StopAtRowToken(stop_tokens)
    expected = target.generate(input_ids, **kwargs, stopping_criteria=StoppingCriteriaList([plain_criterion]))
    actual = dspark_generate(target, draft, input_ids, **kwargs,
                             stopping_criteria=StoppingCriteriaList([dspark_criterion]))

    assert torch.equal(actual, expected)
    new_tokens = (expected[:, input_ids.shape[1]:] != PAD).sum(-1)
    assert len(set(new_tokens.tolist())) == 3  # the rows stop at three different steps
    assert len(dspark_criterion.calls) == len(plain_criterion.calls)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(dspark_criterion.calls, plain_criterion.calls))


def _processor_kwargs(processor: str, banned: list[int]) -> dict:
    """Fresh `generate` arguments that add `processor` (user processors record their calls: one per run)."""
    if processor == "per_row_logits_processor":
        return {"logits_processor": LogitsProcessorList([BanRowToken(banned)])}
    if processor == "prefix_allowed_tokens_fn":  # row b draws from its own third of the vocabulary (and EOS)
        return {processor: lambda batch_id, ids: [EOS, *range(4 + 160 * batch_id, 164 + 160 * batch_id)]}
    values = {"repetition_penalty": 1.3, "encoder_repetition_penalty": 1.5, "no_repeat_ngram_size": 2}
    return {processor: values[processor]}


@pytest.mark.parametrize(
    "processor",
    ["repetition_penalty", "encoder_repetition_penalty", "per_row_logits_processor", "prefix_allowed_tokens_fn"],
)
def test_processors_with_per_row_state_see_each_row_as_plain_generate_does(processor):
    """Stock processors holding per-row state (the prompts' padding, the prompts), a user processor with one entry
    per row, and `prefix_allowed_tokens_fn` (called with each row's batch index) give plain `generate`'s tokens while
    rows accept different counts and finish at different steps."""
    target, draft = TARGETS["qwen3"](), fitted_draft("qwen3")
    input_ids, attention_mask = _batch("qwen3")
    banned = _row_tokens(target, input_ids, attention_mask, steps=[2, 3, 4])
    eos_token_id = _row_tokens(target, input_ids, attention_mask, steps=[4, 7, 10],
                               **_processor_kwargs(processor, banned))
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                  eos_token_id=eos_token_id)

    plain_kwargs, dspark_kwargs = _processor_kwargs(processor, banned), _processor_kwargs(processor, banned)
    expected = target.generate(input_ids, **kwargs, **plain_kwargs)
    actual = dspark_generate(target, draft, input_ids, **kwargs, **dspark_kwargs)

    assert torch.equal(actual, expected)
    assert (actual[:, -1] == PAD).any()  # a row finished early
    if processor == "per_row_logits_processor":  # called on the whole batch, as plain generate calls it at each step
        ours, theirs = dspark_kwargs["logits_processor"][0].calls, plain_kwargs["logits_processor"][0].calls
        assert all(call.shape[0] == 3 for call in ours)
        assert all(any(torch.equal(call, mine) for mine in ours) for call in theirs)  # and at rejected drafts


@pytest.mark.parametrize(
    "name, processor",
    [("qwen3", "no_repeat_ngram_size"), ("qwen3", "per_row_logits_processor"),
     ("kimi_linear", "per_row_logits_processor")],
    ids=["dense_row_wise", "dense_whole_batch", "stateful_whole_batch"],
)
def test_scores_and_logits_of_finished_rows_equal_plain_generate(name, processor):
    """`generate` keeps computing finished rows: their scores are the processors' output for the sequence extended
    by pad tokens. With ragged rows (a stock processor) and step-aligned ones (a per-row user processor)."""
    target, draft = TARGETS[name](), fitted_draft(name)
    input_ids, attention_mask = _batch(name)
    banned = _row_tokens(target, input_ids, attention_mask, steps=[2, 3, 4])
    eos_token_id = _row_tokens(target, input_ids, attention_mask, steps=[3, 6, 9],
                               **_processor_kwargs(processor, banned))
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                  eos_token_id=eos_token_id, return_dict_in_generate=True, output_scores=True, output_logits=True)

    expected = target.generate(input_ids, **kwargs, **_processor_kwargs(processor, banned))
    actual = dspark_generate(target, draft, input_ids, **kwargs, **_processor_kwargs(processor, banned))

    assert torch.equal(actual.sequences, expected.sequences)
    assert (actual.sequences[:, -1] == PAD).any()  # a row finished early
    assert len(actual.scores) == len(expected.scores) and len(actual.logits) == len(expected.logits)
    for ours, theirs in zip(actual.scores + actual.logits, expected.scores + expected.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def _row_wise_instances(prompts: torch.Tensor) -> list:
    """One instance of every class in ROW_WISE, for 4 rows whose prompts are `prompts` [4, 4] and which have 6 more
    tokens each (the per-row attributes as `generate` sets them: a [B] tensor, the [B, P] prompts)."""
    return [
        stock.MinLengthLogitsProcessor(12, EOS), stock.MinNewTokensLengthLogitsProcessor(4, 8, EOS),
        stock.TemperatureLogitsWarper(0.7), stock.TopPLogitsWarper(0.8), stock.TopKLogitsWarper(5),
        stock.TopHLogitsWarper(0.4), stock.MinPLogitsWarper(0.1), stock.TypicalLogitsWarper(0.9),
        stock.EpsilonLogitsWarper(0.02), stock.EtaLogitsWarper(0.02), stock.NoRepeatNGramLogitsProcessor(2),
        stock.SequenceBiasLogitsProcessor([[[5, 6], -3.0], [[7], 2.0]]),
        stock.NoBadWordsLogitsProcessor([[5], [6, 7]], EOS),
        stock.ForcedBOSTokenLogitsProcessor(BOS), stock.ForcedEOSTokenLogitsProcessor(11, EOS),
        stock.InfNanRemoveLogitsProcessor(), stock.ExponentialDecayLengthPenalty((2, 1.5), EOS, 4),
        stock.LogitNormalization(), stock.SuppressTokensAtBeginLogitsProcessor([5, 6], 10),
        stock.SuppressTokensLogitsProcessor([5, 6]),
        stock.RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=torch.tensor([0, 1, 2, 3])),
        stock.EncoderRepetitionPenaltyLogitsProcessor(1.5, encoder_input_ids=prompts),
        stock.MaxLengthCriteria(10), stock.MaxTimeCriteria(60.0), stock.EosTokenCriteria(EOS),
        stock.StopStringCriteria(letters_tokenizer(), ["cd", "xyz"]),
    ]


def test_row_wise_functions_give_each_group_of_rows_what_the_whole_batch_call_gives_it():
    """The claim behind ROW_WISE: called on any group of rows (per-row attributes sliced by `_rows_of`), each of its
    processors and criteria returns exactly those rows of its whole-batch output, on rows with different texts."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, 12, (4, 10), generator=generator)  # few distinct tokens: n-grams and words repeat
    input_ids[1, -1] = 6  # the first token of a banned and of a biased sequence
    input_ids[2, -2:] = torch.tensor([4 + 2, 4 + 3])  # "cd" in letters_tokenizer: row 2 hits a stop string
    input_ids[3, -1] = EOS
    scores = torch.randn(4, 64, generator=generator) * 3
    scores[0, 9] = float("-inf")  # a masked token (InfNanRemove has something to replace)
    instances = _row_wise_instances(input_ids[:, :4])
    assert {type(function) for function in instances} == set(ROW_WISE)  # every listed class is checked
    for function in instances:
        whole = function(input_ids, scores.clone())
        for rows in (torch.tensor([0]), torch.tensor([1, 3]), torch.tensor([2, 0])):
            part = _rows_of(function, rows)(input_ids[rows], scores[rows].clone())
            assert torch.equal(part, whole[rows]), function
