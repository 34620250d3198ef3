"""DSpark calls are scoped to their context (thread): the recurrent-state interception (a wrapper of the target's
chunked kernel) and the feature capture (forward hooks) are in place only while DSpark calls run, and act only for
the DSpark call running in the calling thread. Threads decoding with their own pairs, or sharing one target and one
draft, each get the output they get alone; once no call runs, nothing of DSpark is left on the model, also after a
call that raised."""

import copy
import functools
import itertools
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tiny_models import TARGETS, agreeing_prompts, fitted_draft, kimi_linear_target, qwen3_target, random_prompts
from transformers import AutoModel

from dspark import generation_utils
from dspark.generation_utils import TargetFeatureCapture, decoder_layers, dspark_generate

CALLS_PER_THREAD, NEW_TOKENS = 3, 24


def _thread_prompts(name: str, thread: int) -> list[torch.Tensor]:
    return agreeing_prompts(name, CALLS_PER_THREAD, seed=10 + thread)


def _decode_with(generate, target, draft, prompts) -> tuple[list[torch.Tensor], tuple[float, float]]:
    """Greedy DSpark outputs of `prompts`, one call after another, and the (start, end) time of the run."""
    start = time.perf_counter()
    outputs = [generate(target, draft, p[None], max_new_tokens=NEW_TOKENS, do_sample=False) for p in prompts]
    return outputs, (start, time.perf_counter())


_decode = functools.partial(_decode_with, dspark_generate)


@functools.cache
def _single_threaded(name: str, thread: int) -> list[torch.Tensor]:
    return _decode(TARGETS[name](), fitted_draft(name), _thread_prompts(name, thread))[0]


def _in_threads(*jobs):
    """The results of the jobs (callables), each run in its own thread, all started together."""
    barrier = threading.Barrier(len(jobs))

    def run(job):
        barrier.wait()
        return job()

    with ThreadPoolExecutor(len(jobs)) as pool:
        return [future.result() for future in [pool.submit(run, job) for job in jobs]]


def _routes(kernel) -> list:
    """The DSpark routing states along a kernel's chain of `functools.wraps` wrappers."""
    chain = [kernel]
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    return [getattr(function, generation_utils._KERNEL_ROUTE) for function in chain
            if hasattr(function, generation_utils._KERNEL_ROUTE)]


def _assert_nothing_installed(target) -> None:
    """No wrapper on the target's chunked delta-rule kernel (if it has one) and no capture hook."""
    kernels = generation_utils._delta_rule_kernels(target)
    if kernels is not None:
        module, chunk_name, _ = kernels
        assert not _routes(getattr(module, chunk_name))
    for layer in decoder_layers(target):
        assert not [hook for hook in layer._forward_hooks.values() if hook.__name__ == "_record_layer_output"]
    assert not generation_utils._capture_hooks


def _assert_overlapping(spans) -> None:
    """The threads' runs overlapped in time (torch ops release the GIL, so their forwards interleave)."""
    assert max(start for start, _ in spans) < min(end for _, end in spans)


def test_two_threads_with_their_own_kimi_linear_pairs_get_their_single_threaded_outputs():
    """Two pairs of the same model type share one modeling module, hence one chunked kernel to intercept."""
    pair = (TARGETS["kimi_linear"](), fitted_draft("kimi_linear"))
    pairs = [pair, copy.deepcopy(pair)]
    results = _in_threads(*(functools.partial(_decode, *pairs[i], _thread_prompts("kimi_linear", i)) for i in (0, 1)))
    _assert_overlapping([span for _, span in results])
    for thread, (outputs, _) in enumerate(results):
        for actual, expected in zip(outputs, _single_threaded("kimi_linear", thread)):
            assert torch.equal(actual, expected), thread
    _assert_nothing_installed(pair[0])


@pytest.mark.parametrize("name", ["kimi_linear", "qwen3"])
def test_two_threads_sharing_one_target_and_draft_get_their_single_threaded_outputs(name):
    target, draft = TARGETS[name](), fitted_draft(name)
    results = _in_threads(*(functools.partial(_decode, target, draft, _thread_prompts(name, i)) for i in (0, 1)))
    _assert_overlapping([span for _, span in results])
    for thread, (outputs, _) in enumerate(results):
        for actual, expected in zip(outputs, _single_threaded(name, thread)):
            assert torch.equal(actual, expected), thread
    _assert_nothing_installed(target)


def test_feature_capture_records_only_the_forwards_of_its_own_thread():
    """Two threads capture the same layers of one target around forwards of different lengths, many times."""
    target = qwen3_target()
    inputs = [prompt[None] for prompt in random_prompts(2, 5, 9, seed=3)]
    with torch.no_grad():
        expected = []
        for input_ids in inputs:
            with TargetFeatureCapture(target, [0, 2]) as capture:
                target(input_ids)
                expected.append(capture.features())

    def capture_repeatedly(thread: int):
        start = time.perf_counter()
        for _ in range(100):
            with TargetFeatureCapture(target, [0, 2]) as capture, torch.no_grad():
                target(inputs[thread])
                assert torch.equal(capture.features(), expected[thread]), thread
        return start, time.perf_counter()

    _assert_overlapping(_in_threads(*(functools.partial(capture_repeatedly, i) for i in (0, 1))))


def _plain_greedy(target, prompt):
    output = target.generate(prompt[None], max_new_tokens=12, do_sample=False, return_dict_in_generate=True,
                             output_logits=True)
    return output.sequences, torch.stack(output.logits)


def test_two_copies_of_the_code_share_the_interception_and_leave_plain_generate_bitwise_unchanged(tmp_path):
    """The package and a remote-code copy of it decode with one target in two threads at once (they share one
    kernel wrapper); afterwards nothing is left installed, and plain greedy generate gives the same tokens and
    logits as before any DSpark call."""
    target = kimi_linear_target.__wrapped__()  # a fresh instance
    prompt = agreeing_prompts("kimi_linear", 1, seed=5)[0]
    expected_tokens, expected_logits = _plain_greedy(target, prompt)

    draft = fitted_draft("kimi_linear")
    draft.save_pretrained(tmp_path)
    remote_draft = AutoModel.from_pretrained(tmp_path, trust_remote_code=True).eval()
    remote = sys.modules[type(remote_draft).__module__.rsplit(".", 1)[0] + ".generation_utils"]
    assert remote.dspark_generate is not dspark_generate
    prompts = [_thread_prompts("kimi_linear", thread) for thread in (0, 1)]
    results = _in_threads(functools.partial(_decode, target, draft, prompts[0]),
                          lambda: _decode_with(remote.dspark_generate, target, remote_draft, prompts[1]))
    _assert_overlapping([span for _, span in results])
    for thread, (outputs, _) in enumerate(results):
        for actual, expected in zip(outputs, _single_threaded("kimi_linear", thread)):
            assert torch.equal(actual, expected), thread
    _assert_nothing_installed(target)

    tokens, logits = _plain_greedy(target, prompt)
    assert torch.equal(tokens, expected_tokens) and torch.equal(logits, expected_logits)


def test_plain_generate_in_another_thread_is_unchanged_while_dspark_calls_run():
    """While one thread decodes with DSpark (the kernel wrapper and capture hooks in place), another runs plain
    greedy generate on the same target, many times: the same tokens and logits as alone."""
    target, draft = TARGETS["kimi_linear"](), fitted_draft("kimi_linear")
    prompt = agreeing_prompts("kimi_linear", 1, seed=8)[0]
    expected_tokens, expected_logits = _plain_greedy(target, prompt)

    def plain_repeatedly():
        start = time.perf_counter()
        for _ in range(4):
            tokens, logits = _plain_greedy(target, prompt)
            assert torch.equal(tokens, expected_tokens) and torch.equal(logits, expected_logits)
        return start, time.perf_counter()

    (outputs, dspark_span), plain_span = _in_threads(
        functools.partial(_decode, target, draft, _thread_prompts("kimi_linear", 0)), plain_repeatedly)
    _assert_overlapping([dspark_span, plain_span])
    for actual, expected in zip(outputs, _single_threaded("kimi_linear", 0)):
        assert torch.equal(actual, expected)
    _assert_nothing_installed(target)


class Interrupted(Exception):
    pass


@pytest.mark.parametrize("stage, forward", [("prefill", 0), ("verify", 2), ("draft", 1)])
@pytest.mark.parametrize("name", ["kimi_linear", "qwen3_next"])
def test_a_call_interrupted_anywhere_leaves_nothing_installed(name, stage, forward):
    """An exception inside the prefill, the second verify forward (a linear-attention layer, mid-replay) or the
    second draft forward: nothing stays installed, and the next call gives the uninterrupted output."""
    target, draft = TARGETS[name](), fitted_draft(name)
    prompt = agreeing_prompts(name, 1, seed=6)[0][None]
    expected = dspark_generate(target, draft, prompt, max_new_tokens=16, do_sample=False)
    forwards = itertools.count()

    def interrupt(module, args, output):
        if next(forwards) == forward:
            raise Interrupted

    module = draft if stage == "draft" else decoder_layers(target)[1]  # layer 1: linear attention in both
    handle = module.register_forward_hook(interrupt)
    try:
        with pytest.raises(Interrupted):
            dspark_generate(target, draft, prompt, max_new_tokens=16, do_sample=False)
    finally:
        handle.remove()
    _assert_nothing_installed(target)
    assert torch.equal(dspark_generate(target, draft, prompt, max_new_tokens=16, do_sample=False), expected)
