"""Decode steps through `graphs.DecodeGraph`: padded to a captured bucket, output still exact.

On the CPU nothing is captured: the padded step runs eagerly, the same forward a CUDA graph
records, so these tests check what the padding does (rows that are not sequences, block tables
longer than a sequence's, the scratch block) against `transformers`. `test_cuda.py` checks the
replayed graphs on a GPU."""

from __future__ import annotations

from sluice.engines.generative import EngineConfig, LLMEngine
from sluice.engines.generative.graphs import DecodeGraphs
from sluice.engines.generative.scheduler import ScheduledChunk
from tests.engines.generative.conftest import check_batched_prefix_hits_and_preemptions


def _graphed(model_dir, num_kv_blocks: int) -> LLMEngine:
    engine = LLMEngine(model_dir, EngineConfig(block_size=8, num_kv_blocks=num_kv_blocks, max_num_seqs=16))
    assert engine._runner.use_decode_graphs(16, 512)
    return engine


def _runs(engine: LLMEngine) -> int:
    graphs = engine._runner._graphs
    assert graphs is not None
    return sum(g.num_runs for g in graphs.graphs)


def test_padded_decode_steps_match_transformers_through_prefix_hits_and_preemptions(model_dir, hf_greedy):
    """Batches of 1-8 sequences padded to 1, 2, 4, 8 rows; contexts from 4 to ~150 tokens padded to
    128 or 256 slots."""
    engine, tight = check_batched_prefix_hits_and_preemptions(lambda blocks: _graphed(model_dir, blocks), model_dir,
                                                              hf_greedy, longest_prompt=120)
    assert _runs(engine) > 10 and _runs(tight) > 0  # most steps were pure decodes


def _decode(start: int, blocks: int = 40) -> ScheduledChunk:
    return ScheduledChunk("r", (5,), start, tuple(range(blocks)), True)


def test_a_step_takes_the_smallest_bucket_it_fits_and_only_a_pure_decode_step_has_one():
    graphs = DecodeGraphs(max_seqs=64, max_len=1000, block_size=16, scratch_block=999, device="cpu")
    assert {g.context for g in graphs.graphs} == {128, 256, 512, 1024}  # the first size reaching 1000 too
    assert max(g.num_seqs for g in graphs.graphs) == 64
    graph = graphs.find([_decode(10)] * 3)
    assert graph is not None and (graph.num_seqs, graph.context) == (4, 128)
    graph = graphs.find([_decode(10), _decode(300)])
    assert graph is not None and (graph.num_seqs, graph.context) == (2, 512)
    prompt_chunk = ScheduledChunk("p", (5, 6, 7), 0, (0,), True)
    assert graphs.find([_decode(10), prompt_chunk]) is None
    assert graphs.find([ScheduledChunk("p", (5,), 3, (0,), False)]) is None  # a prompt token that samples nothing
    assert graphs.find([_decode(10)] * 65) is None  # more sequences than any graph
    assert graphs.find([]) is None


def test_no_graph_gathers_more_than_its_slot_budget():
    from sluice.engines.generative.graphs import MAX_SLOTS

    graphs = DecodeGraphs(max_seqs=256, max_len=8192, block_size=16, scratch_block=0, device="cpu")
    assert all(g.num_seqs * g.context <= MAX_SLOTS for g in graphs.graphs)
    assert graphs.find([_decode(4095, 256)] * 64) is not None  # 64 x 4,096 slots: the budget itself
    assert graphs.find([_decode(4095, 256)] * 65) is None
    assert graphs.find([_decode(5000, 400)]) is None  # longer than any captured context: eager


def test_a_model_with_sliding_window_layers_keeps_eager_steps(windowed_dir):
    engine = LLMEngine(windowed_dir, EngineConfig(block_size=8, num_kv_blocks=64))
    assert not engine._runner.use_decode_graphs(16, 512)
    assert engine._runner._graphs is None
