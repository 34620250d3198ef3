"""Triton kernels of kernels.py against their PyTorch references.

On a CUDA machine the kernels are compiled for the GPU; elsewhere they run in Triton's CPU interpreter
(tests/conftest.py sets TRITON_INTERPRET=1), which is slow per program: shapes stay tiny there.
"""

import pytest
import torch
import triton  # pinned in requirements.txt: the kernel tests never skip for want of it
from tiny_models import agreeing_prompts, fitted_draft, left_pad, qwen3_target

import kernels
from dspark import kernels as dspark_kernels  # the copy generation_utils calls (the package's)
from dspark.generation_utils import dspark_generate
from kernels import counter_uniform, markov_block_sample, verify_block

tl = triton.language

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")  # log(0) = -inf

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
# The interpreter runs ~0.1 s per verify program: statistics over 20k rows are for the GPU. On CPU the
# reference's statistics plus per-seed equality of the kernel with the reference cover the kernel.
SLOW_IN_INTERPRETER = pytest.mark.skipif(not ON_GPU, reason="20k verify programs: too slow in the Triton interpreter")


@pytest.fixture
def device() -> str:
    return DEVICE


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Total-variation distance between the empirical distribution of `samples` and `probs` [V]."""
    empirical = torch.bincount(samples.cpu(), minlength=probs.numel()).double() / samples.numel()
    return 0.5 * (empirical - probs.cpu().double()).abs().sum().item()


def markov_inputs(batch, block, vocab, rank, device, dtype=torch.float32, markov=True, confidence=True, seed=0):
    """Random arguments of `markov_block_sample` (base logits sliced from a padded vocabulary, as lm_head gives)."""
    g = torch.Generator().manual_seed(seed)
    padded = torch.randn(batch, block, vocab + 5, generator=g) * 2
    args = {
        "base_logits": padded.to(device, dtype)[..., :vocab],
        "anchor_ids": torch.randint(0, vocab, (batch,), generator=g).to(device),
        "markov_w1": (torch.randn(vocab, rank, generator=g) * 0.6).to(device, dtype) if markov else None,
        "markov_w2": (torch.randn(vocab, rank, generator=g) * 0.6).to(device, dtype) if markov else None,
        "seeds": torch.randint(-(2**40), 2**40, (batch,), generator=g).to(device),
    }
    if confidence:
        args["confidence_base"] = torch.randn(batch, block, generator=g).to(device)
        args["confidence_markov_weight"] = (torch.randn(rank, generator=g) * 0.3).to(device, dtype) if markov else None
        args["confidence_temperatures"] = (torch.rand(block, generator=g) + 0.5).to(device)
    return args


def assert_same_block(triton_block, reference_block, dtype):
    assert torch.equal(triton_block.tokens, reference_block.tokens)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-4
    torch.testing.assert_close(triton_block.logits, reference_block.logits, rtol=tolerance, atol=tolerance)
    if reference_block.confidences is None:
        assert triton_block.confidences is None
    else:
        torch.testing.assert_close(triton_block.confidences, reference_block.confidences, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------- RNG
@triton.jit
def uniform_kernel(seeds_ptr, out_ptr, num_columns, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    columns = tl.arange(0, BLOCK)
    values = kernels._counter_uniform(tl.load(seeds_ptr + row), row, columns)
    tl.store(out_ptr + row * num_columns + columns, values, mask=columns < num_columns)


def test_counter_uniform_bit_exact(device):
    seeds = torch.tensor([0, 1, 2**31 + 7, 2**40 + 3, -5, -(2**45)], device=device)
    out = torch.empty(len(seeds), 50, device=device)
    uniform_kernel[(len(seeds),)](seeds, out, 50, BLOCK=64)
    rows = torch.arange(len(seeds), device=device)[:, None]
    expected = counter_uniform(seeds[:, None], rows, torch.arange(50, device=device)[None, :])
    assert torch.equal(out, expected)
    assert 0 < expected.min() and expected.max() < 1


# ------------------------------------------------------------------------------------------- Markov sampler
MARKOV_CASES = [  # (batch, block, vocab, rank, dtype, markov head, confidence head)
    (1, 7, 37, 8, torch.float32, True, True),
    (3, 4, 300, 12, torch.float32, True, True),
    (2, 3, 300, 16, torch.bfloat16, True, True),
    (2, 5, 100, 8, torch.bfloat16, False, True),
    (17, 2, 100, 4, torch.float32, True, False),
    (2, 3, 37, 4, torch.float32, False, False),
]


@pytest.mark.parametrize("case", MARKOV_CASES)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_markov_block_sample_matches_reference(device, case, temperature):
    batch, block, vocab, rank, dtype, markov, confidence = case
    args = markov_inputs(batch, block, vocab, rank, device, dtype, markov, confidence)
    expected = markov_block_sample(**args, temperature=temperature, backend="reference")
    actual = markov_block_sample(**args, temperature=temperature, backend="triton")
    assert_same_block(actual, expected, dtype)


def test_markov_confidence_without_temperatures(device):
    args = markov_inputs(2, 3, 100, 8, device)
    args["confidence_temperatures"] = None
    expected = markov_block_sample(**args, backend="reference")
    assert_same_block(markov_block_sample(**args, backend="triton"), expected, torch.float32)


def test_markov_greedy_ties_go_to_the_lowest_index(device):
    """Equal maxima in different vocab tiles (tile = 128): torch.argmax picks the first, so must the kernel."""
    args = markov_inputs(2, 3, 300, 4, device)
    base = torch.zeros(2, 3, 300, device=device)
    base[:, :, [7, 150, 299]] = 3.0
    base[1, 1, [200, 260]] = 4.0
    args["base_logits"] = base
    args["markov_w1"] = torch.zeros_like(args["markov_w1"])
    tokens = markov_block_sample(**args, backend="triton").tokens
    assert tokens.tolist() == [[7, 7, 7], [7, 200, 7]]
    assert torch.equal(tokens, markov_block_sample(**args, backend="reference").tokens)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_markov_sampling_distribution(device, backend):
    """d_1 and d_2 follow the exact Markov marginals:
    q_0 = softmax(l_0(anchor) / T) and P(d_2) = sum_i q_0(i) q_1(. | i)."""
    num_samples = 20_000 if backend == "reference" or ON_GPU else 512
    vocab, rank, temperature = 6, 4, 1.5
    args = markov_inputs(1, 2, vocab, rank, device, markov=True, confidence=False, seed=3)
    base, w1, w2 = args["base_logits"].float(), args["markov_w1"], args["markov_w2"]
    q0 = torch.softmax((base[0, 0] + w2 @ w1[args["anchor_ids"][0]]) / temperature, -1)
    q1 = torch.softmax((base[0, 1][None, :] + w1 @ w2.T) / temperature, -1)  # [prev, V]
    args["base_logits"] = base.expand(num_samples, -1, -1)
    args["anchor_ids"] = args["anchor_ids"].expand(num_samples)
    args["seeds"] = torch.arange(num_samples, device=device) * 7919 + 11
    tokens = markov_block_sample(**args, temperature=temperature, backend=backend).tokens
    tolerance = 0.03 if num_samples >= 20_000 else 0.1  # expected TV about 0.01 resp. 0.05
    assert total_variation(tokens[:, 0], q0) < tolerance
    assert total_variation(tokens[:, 1], q0 @ q1) < tolerance


# ------------------------------------------------------------------------------------------- verification
def verify_inputs(batch, block, vocab, device, dtype=torch.float32, seed=0):
    """Drafts sampled from q, a target p from close to far from q with some -inf (top-k style) entries."""
    g = torch.Generator().manual_seed(seed)
    draft = markov_block_sample(
        torch.randn(batch, block, vocab, generator=g).to(device) * 2,
        torch.zeros(batch, dtype=torch.long, device=device),
        None,
        None,
        temperature=1.0,
        seeds=torch.randint(0, 2**31, (batch,), generator=g).to(device),
        backend="reference",
    )
    target = torch.cat([draft.logits, torch.randn(batch, 1, vocab, generator=g).to(device)], dim=1)
    noise = torch.linspace(0.3, 3.0, batch)[:, None, None]  # row 0 accepts most drafts, the last row few
    target = target + (torch.randn(batch, block + 1, vocab, generator=g) * noise).to(device)
    target[torch.rand(batch, block + 1, vocab, generator=g).to(device) < 0.1] = float("-inf")
    target[..., 0] = 0.0  # every row keeps a finite entry
    num_drafts = torch.randint(0, block + 1, (batch,), generator=g).to(device)
    num_drafts[:2] = block
    seeds = torch.randint(-(2**40), 2**40, (batch,), generator=g).to(device)
    return target.to(dtype), draft.tokens, draft.logits, num_drafts, seeds


# (batch, block, vocab, dtype); on CPU the vocab is cut into 1, 1 and 2 splits.
VERIFY_CASES = [(2, 7, 37, torch.float32), (6, 3, 300, torch.float32), (3, 2, 500, torch.bfloat16)]


@pytest.mark.parametrize("batch,block,vocab,dtype", VERIFY_CASES)
def test_verify_sampled_matches_reference(device, batch, block, vocab, dtype):
    target, tokens, logits, num_drafts, seeds = verify_inputs(batch, block, vocab, device, dtype)
    expected = verify_block(target, tokens, logits, num_drafts, seeds, backend="reference")
    actual = verify_block(target, tokens, logits, num_drafts, seeds, backend="triton")
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    assert 0 < expected[0].sum() < num_drafts.sum()  # both accepts and rejections were exercised


@pytest.mark.parametrize("batch,block,vocab,dtype", VERIFY_CASES)
def test_verify_greedy_matches_reference(device, batch, block, vocab, dtype):
    target, _, _, num_drafts, _ = verify_inputs(batch, block, vocab, device, dtype)
    tokens = target[:, :-1].argmax(-1)
    tokens[:, -1] = (tokens[:, -1] + 1) % vocab  # the last draft is always wrong
    tokens[0, 1] = (tokens[0, 1] + 1) % vocab
    expected = verify_block(target, tokens, None, num_drafts, backend="reference")
    actual = verify_block(target, tokens, None, num_drafts, backend="triton")
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    assert expected[0][0] == 1


def test_verify_greedy_ties_go_to_the_lowest_index(device):
    target = torch.zeros(1, 3, 300, device=device)
    target[..., [150, 40, 299]] = 1.0
    tokens = torch.tensor([[40, 150]], device=device)
    num_accepted, next_tokens = verify_block(target, tokens, None, torch.tensor([2], device=device), backend="triton")
    assert num_accepted.item() == 1 and next_tokens.item() == 40


def test_verify_accepts_everything_when_target_is_draft(device):
    target, tokens, logits, _, seeds = verify_inputs(4, 3, 100, device)
    target = torch.cat([logits, target[:, -1:]], dim=1)
    num_drafts = torch.full((4,), 3, device=device)
    num_accepted, next_tokens = verify_block(target, tokens, logits, num_drafts, seeds, backend="triton")
    assert num_accepted.tolist() == [3] * 4
    assert torch.equal(next_tokens, verify_block(target, tokens, logits, num_drafts, seeds, backend="reference")[1])


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=SLOW_IN_INTERPRETER)])
def test_verify_output_follows_target_distribution(device, backend):
    """Speculative sampling is lossless: the first committed token follows p_0 and, after an accepted first
    draft, the second follows p_1, whatever q is (here far from p)."""
    num_samples = 20_000
    vocab = 5
    q_logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 2.5], [2.0, 0.0, 0.0, 0.0, 0.0]], device=device)
    p_logits = torch.tensor([[2.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 2.0], [0.0] * 5], device=device)
    seeds = torch.arange(num_samples, device=device) * 104729 + 1
    draft = markov_block_sample(
        q_logits.expand(num_samples, -1, -1), torch.zeros(num_samples, dtype=torch.long, device=device), None, None,
        temperature=1.0, seeds=seeds, backend=backend,
    )  # fmt: skip
    num_accepted, next_tokens = verify_block(
        p_logits.expand(num_samples, -1, -1), draft.tokens, draft.logits,
        torch.full((num_samples,), 2, device=device), seeds + 1, backend=backend,
    )  # fmt: skip
    first = torch.where(num_accepted > 0, draft.tokens[:, 0], next_tokens)
    second = torch.where(num_accepted > 1, draft.tokens[:, 1], next_tokens)[num_accepted > 0]
    p = torch.softmax(p_logits, -1)
    assert total_variation(first, p[0]) < 0.03  # expected about 0.01; TV(p, q) > 0.5
    assert total_variation(second, p[1]) < 0.04


# ------------------------------------------------------------------------------------------- dispatch
class TritonPathTaken(Exception):
    pass


def test_dispatch(monkeypatch):
    def triton_path(*args):
        raise TritonPathTaken

    args = markov_inputs(1, 2, 37, 4, "cpu")
    monkeypatch.setattr(kernels, "_markov_block_sample_triton", triton_path)
    markov_block_sample(**args)  # auto: CPU tensors take the reference
    monkeypatch.setenv("DSPARK_KERNELS", "triton")
    with pytest.raises(TritonPathTaken if kernels._INTERPRETED else RuntimeError):  # CPU without interpreter
        markov_block_sample(**args)
    markov_block_sample(**args, backend="reference")  # the argument overrides the environment
    with pytest.raises(ValueError, match="backend"):
        verify_block(torch.zeros(1, 3, 37), torch.zeros(1, 2, dtype=torch.long), None, torch.ones(1), backend="cuda")


@pytest.mark.skipif(ON_GPU, reason="runs the kernels on CPU tensors, in the interpreter (gpu_check.sh covers CUDA)")
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_generation_through_the_triton_kernels_equals_the_reference_kernels(monkeypatch, do_sample):
    """Whole DSpark calls, a left-padded batch of 2 under threshold truncation (verify windows shorter than the
    block: the verified drafts' logits are a strided slice of the block's), through the Triton kernels and
    through the PyTorch references, with the same seeds: the same tokens."""
    target, draft = qwen3_target(), fitted_draft("qwen3")
    input_ids, attention_mask = left_pad(agreeing_prompts("qwen3", 2, seed=7))
    outputs, verify_lengths = {}, set()
    for backend in ("reference", "triton"):
        monkeypatch.setenv("DSPARK_KERNELS", backend)
        if backend == "triton":  # the references must not run then
            for reference in ("markov_block_sample_reference", "verify_block_reference"):
                monkeypatch.setattr(dspark_kernels, reference, lambda *args, **kwargs: pytest.fail("a reference ran"))
        torch.manual_seed(0)
        outputs[backend] = dspark_generate(target, draft, input_ids, attention_mask=attention_mask, max_new_tokens=12,
                                           do_sample=do_sample, truncation="threshold", confidence_threshold=0.9)
        verify_lengths |= set(draft.last_stats.verify_lengths)
    assert torch.equal(outputs["triton"], outputs["reference"])
    assert verify_lengths & set(range(1, draft.config.block_size))  # some window shorter than the block
