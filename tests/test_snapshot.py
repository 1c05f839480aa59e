"""The live view's snapshot (engine/snapshot.py): exact block ids, owners and states, from the scheduler alone."""

from conftest import EOS
from test_scheduler import make, step

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.sequence import Sequence
from pagedserve.engine.snapshot import StepRecord, take


def seq(sid: int, prompt: list[int]) -> Sequence:
    return Sequence(sid, f"r{sid}", prompt, SamplingParams(max_tokens=8), 8, frozenset({EOS}))


def test_pool_picture_owners_shared_and_cached_blocks():
    s = make(num_blocks=12, block_size=4, budget=64)
    a = seq(0, list(range(1, 11)))
    s.add(a)
    step(s)  # a: 10 prompt tokens in blocks 0, 1, 2 (two full, published)
    b = seq(1, list(range(1, 11)))  # a's prompt
    s.add(b)
    step(s)  # b hits a's two full blocks and takes one of its own
    c = seq(2, [50, 51, 52, 53, 54])  # another prompt
    s.add(c)
    step(s)
    snap = take(s, num_inbox=2, step=StepRecord(3, 1.5, 64, 5, 2, 3, 1, 0))
    by_id = {q.seq_id: q for q in snap.sequences}
    assert [q.seq_id for q in snap.sequences] == [0, 1, 2] and all(q.running for q in snap.sequences)
    assert by_id[0].block_table == (0, 1, 2) and by_id[1].block_table[:2] == (0, 1)
    assert by_id[1].num_cached_tokens == 8 and by_id[1].request_id == "r1"
    own_b, own_c = by_id[1].block_table[2], by_id[2].block_table
    expected = ["."] * 12
    expected[0] = expected[1] = "s"
    for x in (2, own_b, *own_c):
        expected[x] = "u"
    assert snap.pool == "".join(expected) and snap.count("s") == 2 and snap.num_inbox == 2
    s.block_manager.check_integrity(list(s.running))
    s.abort("r0")
    s.abort("r1")
    snap = take(s, 0, None)
    assert [q.seq_id for q in snap.sequences] == [2]
    # full blocks stay as cached prefixes (a's third filled up with its decodes: 12 tokens computed); partial ones
    # are free again
    assert snap.pool[:3] == "ccc" and snap.pool[own_b] == "."
    assert snap.count("u") == len(own_c) and snap.count("c") + snap.count(".") + snap.count("u") == 12
    assert snap.prefix_cache_hits == 8 and snap.prefix_cache_queries == 25
