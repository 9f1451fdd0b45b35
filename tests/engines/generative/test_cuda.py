"""The engine on a CUDA device keeps its main promise: greedy output equal to `transformers`'
`generate()` (the reference runs on the CPU in float32), batched, with prefix-cache hits and with
preemptions. Skipped without a GPU (CI has none); run on one with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from sluice.engines.generative import EngineConfig, LLMEngine
from tests.engines.generative.conftest import check_batch, check_batched_prefix_hits_and_preemptions, prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _engine(model_dir, **config: int | bool) -> LLMEngine:
    engine = LLMEngine(model_dir, EngineConfig(block_size=8, device="cuda", **config))  # type: ignore[arg-type]
    assert engine._runner.cache.k.device.type == "cuda"  # the KV cache (and so the model) is on the GPU
    return engine


def test_batched_requests_prefix_hits_and_preemptions_on_cuda_match_transformers(model_dir, hf_greedy):
    """Every step eager (the default replays pure decode steps from CUDA graphs: below)."""
    def eager(blocks: int) -> LLMEngine:
        return _engine(model_dir, num_kv_blocks=blocks, cuda_graphs=False)

    check_batched_prefix_hits_and_preemptions(eager, model_dir, hf_greedy)


def test_mixtures_of_experts_on_cuda_match_transformers(moe_dir, hf_greedy):
    """Mixtral and Qwen3-MoE, every step eager (a mixture picks its experts on the host, so its
    engine captures no graphs even when asked to)."""
    engine, _ = check_batched_prefix_hits_and_preemptions(lambda blocks: _engine(moe_dir, num_kv_blocks=blocks),
                                                          moe_dir, hf_greedy)
    assert engine.spec.num_experts == 4


def test_qwen3_on_cuda_with_decode_graphs_matches_transformers(qwen3_dir, hf_greedy):
    """Qwen3's per-head query and key norms inside the captured decode graphs too."""
    check_batched_prefix_hits_and_preemptions(lambda blocks: _engine(qwen3_dir, num_kv_blocks=blocks), qwen3_dir,
                                              hf_greedy)


def test_logprobs_penalties_and_prompt_logprobs_on_cuda_match_transformers(model_dir):
    from sluice.engines.generative import SamplingParams
    from tests.engines.generative.test_logprobs import _check_prompt_logprobs, _outputs, _reference

    engine = _engine(model_dir, num_kv_blocks=256)
    prompt = prompts(21, 1, 40, 40)[0]
    engine.add_request("scored", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3,
                                                        prompt_logprobs=2))
    engine.add_request("steered", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                         frequency_penalty=1.0, logit_bias=((17, 5.0),)))
    outs = _outputs(engine)
    reported = [lp for o in outs["scored"] for lp in o.logprobs]
    expected = _reference(model_dir, prompt, [lp.token_id for lp in reported])
    assert [lp.logprob for lp in reported] == pytest.approx(
        [expected[i, lp.token_id].item() for i, lp in enumerate(reported)], abs=1e-3)
    _check_prompt_logprobs(model_dir, prompt, outs["scored"][0].prompt_logprobs, 2)
    assert len([t for o in outs["steered"] for t in o.new_token_ids]) == 8  # penalties and bias ran on the GPU


def test_structured_outputs_on_cuda_fit_their_schema(tmp_path):
    """The grammar's bitmasks are unpacked on the device: sampled JSON still fits its schema."""
    import json

    from sluice import wire
    from sluice.engines.generative import SamplingParams
    from sluice.engines.generative.tiny import make_tiny_lm
    from tests.engines.generative.conftest import run_to_completion
    from tests.engines.generative.test_structured import SCHEMA, fits_schema

    engine = _engine(make_tiny_lm(tmp_path / "tiny-lm"), num_kv_blocks=256)
    assert engine.grammars is not None and engine.tokenizer is not None
    for seed in range(4):
        engine.add_request(f"j{seed}", [5, 6, 7], SamplingParams(max_tokens=120, temperature=1.0, seed=seed),
                           matcher=engine.grammars.matcher(wire.OutputFormat("json_schema", json.dumps(SCHEMA))))
    outputs = run_to_completion(engine)
    assert all(fits_schema(json.loads(engine.tokenizer.decode(outputs[f"j{seed}"]))) for seed in range(4))


def test_gpu_memory_utilization_sizes_the_cache_from_what_the_device_has(model_dir, hf_greedy):
    """The KV cache takes what is left of a share of the device after what is in use and a measured
    step's activations (here a share 512 MiB above what is in use now), and output stays exact."""
    import gc

    import torch

    gc.collect()  # earlier tests' engines, and the allocator's cache of their memory, are not in use
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    share = (total - free + (512 << 20)) / total
    engine = LLMEngine(model_dir, EngineConfig(block_size=8, device="cuda", gpu_memory_utilization=share))
    cache_bytes = engine.num_blocks * engine._runner.cache.bytes_per_block(engine.spec, 8, torch.float32)
    assert (256 << 20) < cache_bytes <= (512 << 20), cache_bytes  # the rest: weights and the probe's activations
    check_batch(engine, model_dir, hf_greedy, prompts(1, 4, 3, 60), [12] * 4, join_every=2)


def test_decode_steps_replayed_from_cuda_graphs_match_transformers(model_dir, hf_greedy):
    """Pure decode steps replay graphs captured at load (padded to a bucket: padding rows, longer
    block tables, the scratch block): the output equals transformers', batched, through prefix
    hits and preemptions."""
    def graphed(blocks: int) -> LLMEngine:
        return _engine(model_dir, num_kv_blocks=blocks, max_num_seqs=16)  # graphs: the default

    engine, tight = check_batched_prefix_hits_and_preemptions(graphed, model_dir, hf_greedy, longest_prompt=120)
    for each in (engine, tight):
        graphs = each._runner._graphs
        assert graphs is not None and graphs.graphs and all(g._graph is not None for g in graphs.graphs)
    assert sum(g.num_runs for g in engine._runner._graphs.graphs) > 20  # type: ignore[union-attr]
    assert sum(g.num_runs for g in tight._runner._graphs.graphs) > 0  # type: ignore[union-attr]


def test_cuda_graphs_on_a_numbered_device(llama_dir, hf_greedy):
    """A worker's device is named `cuda:N`: the graphs are captured and replayed there."""
    engine = LLMEngine(llama_dir, EngineConfig(block_size=8, num_kv_blocks=64, max_num_seqs=4, device="cuda:0"))
    graphs = engine._runner._graphs
    assert graphs is not None and all(g._graph is not None for g in graphs.graphs)
    check_batch(engine, llama_dir, hf_greedy, prompts(7, 3, 5, 40), [12] * 3, join_every=1)
    assert sum(g.num_runs for g in graphs.graphs) > 0



def test_a_worker_loading_two_models_at_once_while_a_third_generates_records_every_graph(tmp_path, hf_greedy):
    """A worker loads its versions two at a time while its other models serve. Recording a CUDA
    graph fails if another thread uses the device meanwhile (seen on an H200: neither of two models
    loaded at once recorded its graphs, so both ran eagerly): the device gate and one
    CUDA load at a time keep them apart. Every graph is recorded, and every model's greedy output
    still equals transformers'."""
    import asyncio
    import shutil
    import threading

    from sluice.engines.device_gate import DEVICE_GATE
    from sluice.engines.generative.runner import GenerativeRunner
    from sluice.engines.generative.tiny import make_tiny_lm
    from sluice.repository import MANIFEST, scan_repository, write_manifest
    from sluice.worker.loading import Loaded, VersionLoad
    from sluice.worker.main import RepositorySource, WorkerConfig
    from tests.engines.generative.conftest import greedy, run_to_completion

    tiny = make_tiny_lm(tmp_path / "tiny-lm")
    for name in ("first", "second"):
        weights = shutil.copytree(tiny, tmp_path / "models" / name / "1")
        write_manifest(weights, weights / MANIFEST)
        (tmp_path / "models" / name / "model.toml").write_text(
            'kind = "generative"\n[params]\nkv_cache_mb = 8\nmax_num_seqs = 8\n')
    serving = LLMEngine(tiny, EngineConfig(block_size=16, num_kv_blocks=128, max_num_seqs=8, device="cuda:0"))
    prompt = prompts(11, 1, 30, 30)[0]
    expected = hf_greedy(tiny, prompt, 24)
    stop, served = threading.Event(), []

    def serve() -> None:  # a model already serving: its steps hold the gate, as GenerationLoop's do
        while not stop.is_set():
            serving.add_request(f"r{len(served)}", prompt, greedy(24))
            tokens: list[int] = []
            while serving.has_unfinished():
                with DEVICE_GATE.shared():
                    tokens += [t for out in serving.step() for t in out.new_token_ids]
            served.append(tokens)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    loads = VersionLoad(RepositorySource(WorkerConfig("w", "tcp://127.0.0.1:1", tmp_path / "models",
                                                      device="cuda:0")))

    async def load_both() -> list:
        return await asyncio.gather(*(loads.load(v) for v in scan_repository(tmp_path / "models").versions))

    try:
        loaded = asyncio.run(load_both())
    finally:
        stop.set()
        server.join(60)
    assert len(loaded) == 2 and served and all(tokens == expected for tokens in served)
    for each in loaded:
        assert isinstance(each, Loaded), each
        runner = each.model.runner
        assert isinstance(runner, GenerativeRunner)
        graphs = runner.engine._runner._graphs
        assert graphs is not None and all(g._graph is not None for g in graphs.graphs)
        runner.engine.add_request("check", prompt, greedy(24))
        assert run_to_completion(runner.engine)["check"] == expected
        assert sum(g.num_runs for g in graphs.graphs) > 0
