"""Sampling by the build's sampler graph (``common.model.builder_export.write_sampler``, run by
``edge.compute.decoder.DeviceSampler`` on the step's logits) against the host's sampler
(``edge.compute.local.sample_token``), on SmolLM2's prepared ``edge-decoder/`` with ONNX Runtime's CPU
provider: a copy of the build with the sampler returns the token ids the graph without
it gives through the host, for seeded turns alone and in batches, under several temperature / top-k
/ top-p settings, through a binding per run and through the fixed-address buffers a CUDA graph
replays; where the graph samples, no logits come back."""

from __future__ import annotations

import asyncio
import os
import shutil

import numpy as np
import pytest

from tandem.common.model.builder_export import write_sampler
from tandem.common.protocol.chat import prompt_token_ids
from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.params import Sampling
from tandem.edge.compute.decoder import DecoderGraph
from tandem.edge.compute.local import LocalEngine, draw_uniform, sample_token, sampling_rng
from tandem.edge.compute.localmodel import Draw
from tandem.edge.compute.prefill import PrefillPlan

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
NEW = 10
SETTINGS = [
    Sampling(max_new_tokens=NEW, temperature=1.0, seed=1, ignore_eos=True),
    Sampling(max_new_tokens=NEW, temperature=0.7, top_k=40, seed=2, ignore_eos=True),
    Sampling(max_new_tokens=NEW, temperature=1.2, top_p=0.9, seed=3, ignore_eos=True),
    Sampling(max_new_tokens=NEW, temperature=0.8, top_k=50, top_p=0.95, seed=-5, ignore_eos=True),
    Sampling(max_new_tokens=NEW, temperature=2.0, seed=4, ignore_eos=True),  # the largest temperature taken
]


@pytest.fixture(scope="module")
def sampler_dir(decoder_dir, tmp_path_factory):
    """A copy of the prepared graph with the sampler's graph beside it, as a CUDA build has it (the
    weights hard-linked where the file system allows; ONNX Runtime refuses external data that a
    symbolic link leads out of the folder)."""
    out = tmp_path_factory.mktemp("sampler") / "edge-decoder"
    out.mkdir()
    for f in decoder_dir.iterdir():
        if f.name.endswith(".data"):
            try:
                os.link(f.resolve(), out / f.name)
            except OSError:
                shutil.copy(f, out / f.name)
        elif f.is_file():
            shutil.copy(f, out / f.name)
    write_sampler(out)
    return out


@pytest.fixture(scope="module")
def host_engine(decoder_dir, manifest):
    return LocalEngine(decoder_dir, manifest.shape, (), intra_op_threads=2)


@pytest.fixture(scope="module")
def device_engine(sampler_dir, manifest):
    return LocalEngine(sampler_dir, manifest.shape, (), intra_op_threads=2)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [prompt_token_ids(tokenizer, m) for m in CHATS]


async def turn(engine, ids, sampling) -> list[int]:
    return [t.token_id async for t in engine.generate(ids, sampling)]


@pytest.mark.parametrize("s", [Sampling(temperature=0.9, top_k=60, top_p=0.92), Sampling(temperature=100.0)])
def test_the_graph_samples_the_host_token_and_returns_no_logits(host_engine, device_engine, prompts, s):
    host, device = host_engine.model, device_engine.model
    assert device.has_sampling and not host.has_sampling
    ids = prompts[1]
    a, b = host.new_kv(len(ids) + 8), device.new_kv(len(ids) + 8)
    try:
        rng = sampling_rng(17)
        new, seen = ids, list(ids)
        for _ in range(6):
            d = Draw(s.temperature, s.top_k, s.top_p, draw_uniform(rng))
            none, logits, _ = host.run(a, new, greedy=False, draw=d)
            tok, no_logits, _ = device.run(b, new, greedy=False, draw=d)
            assert none is None and no_logits is None and tok is not None
            assert tok == sample_token(logits, s, d.uniform)
            new = [tok]
            seen.append(tok)
        greedy, _, _ = device.run(b, new, greedy=True)  # the argmax output, beside the sampler
        fresh = device.new_kv(len(seen))
        assert greedy == int(np.argmax(device.run_rows(fresh, seen)[-1]))  # logits where asked for
        device.release(fresh)
    finally:
        host.release(a)
        device.release(b)


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: f"t{s.temperature}-k{s.top_k}-p{s.top_p}")
async def test_a_seeded_turn_gives_the_same_tokens_sampled_on_the_device_and_on_the_host(
    host_engine, device_engine, prompts, s
):
    for ids in prompts[1:]:
        assert await turn(device_engine, ids, s) == await turn(host_engine, ids, s)


async def test_the_edge_settings_give_the_greedy_tokens(device_engine, prompts):
    ids = prompts[2]
    greedy = await turn(device_engine, ids, Sampling(max_new_tokens=NEW, ignore_eos=True))
    top1 = Sampling(max_new_tokens=NEW, temperature=1.5, top_k=1, seed=9, ignore_eos=True)
    tiny_p = Sampling(max_new_tokens=NEW, temperature=1.5, top_p=1e-6, seed=9, ignore_eos=True)
    assert await turn(device_engine, ids, top1) == greedy
    assert await turn(device_engine, ids, tiny_p) == greedy


async def test_seeded_turns_in_a_batch_give_the_host_tokens(host_engine, device_engine, prompts):
    """Three seeded turns and a greedy one decoding together on the device-sampling graph (batched
    steps) each give what the host path gives it alone."""
    sampling = [*SETTINGS[1:4], Sampling(max_new_tokens=NEW, ignore_eos=True)]
    turns = list(zip([*prompts, prompts[0]], sampling, strict=True))
    alone = [await turn(host_engine, p, s) for p, s in turns]
    sizes: list[int] = []
    run_batch = device_engine.model.run_batch

    def counted(kvs, *args, **kw):
        sizes.append(len(kvs))
        return run_batch(kvs, *args, **kw)

    device_engine.model.run_batch = counted
    try:
        got = await asyncio.gather(*(turn(device_engine, p, s) for p, s in turns))
    finally:
        del device_engine.model.run_batch
    assert list(got) == alone and max(sizes) == len(turns)


@pytest.mark.parametrize(
    "bad",
    [Sampling(temperature=-0.1), Sampling(temperature=1.0, top_p=0.0), Sampling(temperature=1.0, top_k=-2)],
)
async def test_bad_sampling_values_are_refused(device_engine, prompts, bad):
    with pytest.raises(InvalidRequest):
        await turn(device_engine, prompts[0], bad)


async def test_top_k_minus_one_is_off_as_zero_is(device_engine, host_engine, prompts):
    """vLLM's two ways of turning top-k off give one reply, on the device's sampler and the host's."""
    off = [Sampling(temperature=0.9, top_k=k, seed=5, max_new_tokens=8) for k in (-1, 0)]
    for engine in (device_engine, host_engine):
        a, b = [await turn(engine, prompts[2], s) for s in off]
        assert a == b


def test_the_preparation_check_passes_a_build_with_the_sampler(sampler_dir, manifest, split_dir, prompts):
    """``check_decoder`` on a build with ``sampler.onnx`` beside its graph: the graph's logits still
    match HF's."""
    from tandem.common.model.builder_export import check_decoder

    checked = check_decoder(manifest.resolve(split_dir, manifest.full_checkpoint), sampler_dir, prompts[1])
    assert checked.passed and checked.checked_tokens == len(prompts[1])


def fixed_and_fresh_tokens(sampler_dir, fixed: bool) -> list[list[int]]:
    """Three sessions sampled on a graph with the sampler: one alone, two in batched steps (one of
    them greedy); ``fixed``: the steps run through the buffers at fixed addresses that a CUDA graph
    replays (ONNX Runtime's CPU provider ignores the graph id), else with a binding per run."""
    graph = DecoderGraph(sampler_dir, providers=["CPUExecutionProvider"], intra_op_threads=2)
    graph.cuda_graph = fixed
    rng = sampling_rng(3)
    slots = [graph.new_kv(64) for _ in range(3)]
    toks = []
    for i, s in enumerate(slots):
        tok, _, _ = graph.run(
            s, list(range(1 + i, 20 + 3 * i)), greedy=False, draw=Draw(0.9, 40, 0.9, draw_uniform(rng))
        )
        toks.append([tok])
    for _ in range(6):
        tok, logits, _ = graph.run(slots[0], [toks[0][-1]], greedy=False, draw=Draw(1.0, 0, 0.95, draw_uniform(rng)))
        assert logits is None
        toks[0].append(tok)
        draws = [Draw(0.8, 0, 1.0, draw_uniform(rng)), None]
        out, rows, _ = graph.run_batch(slots[1:], [toks[1][-1], toks[2][-1]], [False, True], draws)
        assert rows == [None, None]
        toks[1].append(out[0])
        toks[2].append(out[1])
    return toks


def test_the_fixed_address_steps_sample_what_a_fresh_binding_samples(sampler_dir):
    assert fixed_and_fresh_tokens(sampler_dir, True) == fixed_and_fresh_tokens(sampler_dir, False)


def test_only_a_sampled_row_runs_the_sampler(sampler_dir):
    """The sampler's graph runs on a step only where a row samples: greedy steps, alone and batched,
    leave its run count alone (ONNX Runtime would run a sampler inside the model's graph on each)."""
    graph = DecoderGraph(sampler_dir, providers=["CPUExecutionProvider"], intra_op_threads=2)
    assert graph.sampler is not None
    a, b = graph.new_kv(64), graph.new_kv(64)
    tok, _, _ = graph.run(a, list(range(1, 12)), greedy=True)
    out, _, _ = graph.run_batch([a], [tok], [True])
    assert graph.sampler.runs == 0
    graph.run(b, list(range(3, 9)), greedy=False, draw=Draw(0.9, 40, 0.9, 0.5))
    assert graph.sampler.runs == 1 and graph.sampler.last_ms > 0
    assert graph.sampler.top_runs == 1  # top-k 40: the top-k sampler's sort of the 64 largest
    graph.run_batch([a, b], [out[0], 7], [True, False], [None, Draw(1.0, 0, 1.0, 0.25)])
    assert graph.sampler.runs == 2  # one run for the batch's sampled row
    assert graph.sampler.top_runs == 1  # top-k off: the whole sort


def test_a_chunked_padded_run_samples_its_last_real_row(sampler_dir, host_engine, prompts):
    """With runs cut into 16 tokens and padded to 4, 8 or 16 (the CUDA provider's plan at a size
    these prompts cross), the sampler reads the last real row of the padded logits, not the
    padding's: a prompt's first 30 or 31 tokens (runs of 16 and 14 or 15, padded to 16), then its
    last 7 (padded to 8); each sample is the host's from the exact run's logits."""
    plan = PrefillPlan(16, (4, 8, 16), capacity_mask=True)
    device = DecoderGraph(sampler_dir, providers=["CPUExecutionProvider"], intra_op_threads=2, prefill=plan)
    host, s = host_engine.model, Sampling(temperature=0.9, top_k=60, top_p=0.92)
    rng = sampling_rng(23)
    for ids in prompts[1:]:
        assert 16 < len(ids) - 7 < 32 and len(ids) - 7 != 24  # a chunk, then a padded run
        a, b = host.new_kv(len(ids)), device.new_kv(len(ids))
        try:
            for new in (ids[:-7], ids[-7:]):
                d = Draw(s.temperature, s.top_k, s.top_p, draw_uniform(rng))
                _, logits, _ = host.run(a, new, greedy=False, draw=d)
                tok, none, _ = device.run(b, new, greedy=False, draw=d)
                assert none is None and tok == sample_token(logits, s, d.uniform)
        finally:
            host.release(a)
            device.release(b)
