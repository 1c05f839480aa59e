"""Tensor parallelism on the CPU over gloo, with real spawned worker ranks: the split model serves what the whole one
does (greedy tokens equal, logprobs within 1e-4 in fp32), the scheduler's features are unchanged, quantized shards
hold the whole matrix's values, and a dead rank ends the engine with a clear error instead of a hang."""

from __future__ import annotations

import asyncio
import glob
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import compare_greedy, greedy

from pagedserve.engine import LLMEngine, SamplingParams, make_config
from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.config import ModelConfig
from pagedserve.engine.models.loader import RANDOM_SHAPES
from pagedserve.engine.parallel import shm_all_reduce, workers
from pagedserve.engine.parallel.group import check_tensor_parallel
from pagedserve.engine.parallel.workers import WorkerFailedError, free_port
from pagedserve.engine.quant.formats import quantize

LOGPROB_TOL = 1e-4  # fp32: only the all-reduce's summation order differs from the unsplit model
BOUND_S = 60.0  # a failure must end the engine within this (a dead rank's sockets close: it is seconds in practice)


def engine(model: str = "random:tiny", tp: int = 1, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_blocks", 64)
    return LLMEngine(make_config(model=model, dtype="float32", device="cpu", tensor_parallel_size=tp, **kwargs))


def generate(eng: LLMEngine, prompts: list, params) -> dict[str, dict]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    out: dict[str, dict] = {}
    while eng.has_unfinished():
        for o in eng.step():
            r = out.setdefault(o.request_id, {"tokens": [], "logprobs": []})
            r["tokens"] += o.new_token_ids
            r["logprobs"] += o.logprobs
    return out


def assert_same(ours: dict, ref: dict, where: str) -> None:
    """Greedy tokens equal (a divergence only at a genuine near-tie), logprobs within LOGPROB_TOL up to there."""
    assert ours.keys() == ref.keys()
    for rid in ref:
        a, b = ours[rid], ref[rid]
        result = compare_greedy(a["tokens"], b["tokens"], a["logprobs"])
        n = len(a["tokens"]) if result == "equal" else next(
            i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y)
        assert n > 0, f"{where} {rid}: nothing to compare"
        diff = max(abs(x.logprob - y.logprob) for x, y in zip(a["logprobs"][:n], b["logprobs"][:n]))
        assert diff <= LOGPROB_TOL, f"{where} {rid}: logprobs differ by {diff:.2e}"


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [100, 37, 250, 9], list(range(300, 340))]


@pytest.fixture(scope="module")
def tiny_reference() -> dict:
    eng = engine()
    return generate(eng, PROMPTS, greedy(64))


def our_segments() -> list[str]:
    return glob.glob(f"/dev/shm/{shm_all_reduce.PREFIX}{os.getpid()}-*")


def test_tiny_model_at_tp2_matches_tp1(tiny_reference):
    eng = engine(tp=2)
    try:
        assert eng.runner.num_kv_heads == 1 and eng.runner.model.layers[0].self_attn.num_heads == 2
        assert eng.runner.fused is None  # the fused decode layer has no all-reduce inside
        assert (eng.runner.tp.shm is not None) == shm_all_reduce.supported()
        assert not our_segments(), "the segment's name outlived start-up"
        assert_same(generate(eng, PROMPTS, greedy(64)), tiny_reference, "tp=2")
        procs = eng.workers.procs
    finally:
        eng.close()
    assert not any(p.is_alive() for p in procs), "workers outlived close()"
    assert not our_segments()


def test_gloo_only_at_tp2_matches_tp1(tiny_reference, monkeypatch):
    """PAGEDSERVE_TP_SHM=0: every all-reduce over gloo (the benchmark's baseline) serves the same tokens."""
    monkeypatch.setenv("PAGEDSERVE_TP_SHM", "0")
    eng = engine(tp=2)
    try:
        assert eng.runner.tp.shm is None
        ref = {k: {f: v[:32] for f, v in tiny_reference[k].items()} for k in ("r0", "r1")}
        assert_same(generate(eng, PROMPTS[:2], greedy(32)), ref, "gloo")
    finally:
        eng.close()


needs_shm = pytest.mark.skipif(not shm_all_reduce.supported(), reason="shared-memory all-reduce: Linux x86-64 only")


@needs_shm
def test_shm_all_reduce_sums_bit_identically_on_every_rank():
    """3 ranks (threads here), calls of varied shapes and dtypes alternating the slot parities: every rank holds the
    same bits, the sum in rank order; a tensor larger than a slot does not fit (the group sends it to gloo)."""
    size = 3
    name = shm_all_reduce.create_segment(size, slot_bytes=4096)
    try:
        ranks = [shm_all_reduce.ShmAllReduce(name, r, size, timeout_s=30) for r in range(size)]
    finally:
        shm_all_reduce.unlink_segment(name)
    assert not os.path.exists(f"/dev/shm/{name}")
    calls = [((4, 7), torch.float32), ((1, 896 // 4), torch.float32), ((3, 5), torch.bfloat16), ((2,), torch.int64)]
    calls = calls * 3
    inputs = [[(torch.randn(shape) * 100).to(dtype) for shape, dtype in calls] for _ in range(size)]
    results: list = [None] * size

    def run(r: int) -> None:
        results[r] = [ranks[r](x.clone()) for x in inputs[r]]

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an all-reduce hung"
    for i in range(len(calls)):
        want = inputs[0][i].clone()
        for r in range(1, size):
            want += inputs[r][i]
        for r in range(size):
            assert torch.equal(results[r][i], want), (i, r)
    assert ranks[0].fits(torch.zeros(1024)) and not ranks[0].fits(torch.zeros(1025))
    assert not ranks[0].fits(torch.zeros(8, 8).t())


@needs_shm
def test_shm_all_reduce_fails_on_a_dead_peer_instead_of_spinning():
    name = shm_all_reduce.create_segment(2, slot_bytes=4096)
    try:
        mine = shm_all_reduce.ShmAllReduce(name, 0, 2, timeout_s=30)
        peer = shm_all_reduce.ShmAllReduce(name, 1, 2, timeout_s=30)
    finally:
        shm_all_reduce.unlink_segment(name)
    dead = subprocess.Popen(["true"])
    dead.wait()
    peer._pids[1] = dead.pid  # rank 1's process has exited
    t0 = time.monotonic()
    with pytest.raises(shm_all_reduce.PeerDiedError, match=f"rank 1 \\(pid {dead.pid}\\) died"):
        mine(torch.ones(4))
    assert time.monotonic() - t0 < 5
    peer._pids[1] = os.getpid()  # alive, but never arrives: the timeout ends the wait
    mine.timeout_s = 0.3
    with pytest.raises(shm_all_reduce.PeerDiedError, match="did not arrive"):
        mine(torch.ones(4))


@pytest.mark.slow
def test_kv_heads_replicated_when_fewer_than_ranks(tiny_reference):
    """4 ranks over 2 KV heads: each KV head on two ranks, each rank one query head."""
    eng = engine(tp=4)
    try:
        assert eng.runner.num_kv_heads == 1 and eng.runner.model.layers[0].self_attn.num_heads == 1
        assert_same(generate(eng, PROMPTS, greedy(64)), tiny_reference, "tp=4")
    finally:
        eng.close()


@pytest.mark.slow
def test_smollm2_at_tp3_matches_tp1(smollm, make_engine):
    """9 heads and 3 KV heads over 3 ranks, fp32: the bundled model's greedy text is the unsplit one's."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    ref = generate(make_engine(), prompts, greedy(64))
    eng = engine(smollm.path, tp=3, quantization="none", num_blocks=256)
    try:
        assert eng.runner.num_kv_heads == 1 and eng.runner.model.layers[0].self_attn.num_heads == 3
        assert_same(generate(eng, prompts, greedy(64)), ref, "smollm2 tp=3")
    finally:
        eng.close()


def test_prefix_caching_preemption_and_speculation_unchanged():
    """A small KV cache (preemptions), prompts sharing two blocks (prefix hits), n-gram drafts (verification):
    the same greedy tokens and the same counters at TP=2 as at TP=1."""
    shared = list(range(10, 42))
    prompts = [shared + [50 + i, 60 + i, 70 + i] * 4 for i in range(4)]
    params = greedy(40, logprobs=None)  # requests that ask for logprobs do not speculate
    kwargs = dict(num_blocks=14, speculative_method="ngram", num_speculative_tokens=3, max_num_seqs=4)
    results, stats = [], []
    for tp in (1, 2):
        eng = engine(tp=tp, **kwargs)
        eng.speculator.adaptive = False  # always draft
        try:
            results.append(generate(eng, prompts, params))
            s = eng.stats()
            stats.append((s.num_preemptions, s.prefix_cache_hits, s.spec_decode.num_draft_tokens,
                          s.spec_decode.num_accepted_tokens))
        finally:
            eng.close()
    assert {r: o["tokens"] for r, o in results[1].items()} == {r: o["tokens"] for r, o in results[0].items()}
    preemptions, hits, drafted, _ = stats[0]
    assert preemptions > 0 and hits > 0 and drafted > 0, stats[0]
    assert stats[1] == stats[0]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_at_tp2_matches_tp1(tiny_hf_dir, quantization):
    """A real checkpoint quantized on load: whole, then narrowed along its groups, so TP=2 serves TP=1's values."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [100, 37, 250, 9]]
    outs = []
    for tp in (1, 2):
        eng = engine(str(tiny_hf_dir), tp=tp, quantization=quantization, quant_group_size=32)
        try:
            proj = eng.runner.model.layers[0].self_attn.o_proj
            assert proj.qweight is not None and proj.qweight.format == quantization
            outs.append(generate(eng, prompts, greedy(64)))
        finally:
            eng.close()
    assert_same(outs[1], outs[0], f"{quantization} tp=2")


@pytest.mark.parametrize("fmt", ["int8", "int4", "int8-tensor", "int4-tensor"])
def test_quantized_weights_narrow_along_their_groups(fmt):
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    qw = quantize(w, fmt, 32)
    whole = qw.dequantize()
    assert torch.equal(qw.narrow(0, 16, 32).dequantize(), whole[16:48])
    assert torch.equal(qw.narrow(1, 64, 64).dequantize(), whole[:, 64:])
    if fmt == "int4":
        with pytest.raises(ValueError, match="groups of 32"):
            qw.narrow(1, 16, 64)


def test_bad_splits_are_refused_with_one_line():
    tiny = ModelConfig(**RANDOM_SHAPES["tiny"])  # 4 heads, 2 KV heads
    check_tensor_parallel(tiny, 4)
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        check_tensor_parallel(tiny, 3)
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        check_tensor_parallel(tiny, 8)
    smol = ModelConfig(**RANDOM_SHAPES["smollm2-135m"])  # 9 heads, 3 KV heads
    with pytest.raises(ValueError, match="9 attention heads"):
        check_tensor_parallel(smol, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        make_config(model="random:tiny", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="names 3 CPU lists"):
        make_config(model="random:tiny", tensor_parallel_size=2, cpu_bind="0|1|2")
    with pytest.raises(ValueError, match=r"CPUs \[99999\] are not available here"):  # it hung start-up for 300 s
        make_config(model="random:tiny", tensor_parallel_size=2, cpu_bind="0|99999")
    with pytest.raises(ValueError, match="does not divide"):
        engine(tp=3)
    cli = subprocess.run([sys.executable, "-m", "pagedserve.server.cli", "generate", "--model", "random:tiny",
                          "--device", "cpu", "--tensor-parallel-size", "3", "hi"], capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 1
    assert cli.stderr.strip().splitlines()[-1] == \
        "pagedserve: error: tensor_parallel_size=3 does not divide the model's 4 attention heads"


def _loopback_port() -> int:
    """A free port whose successor is free too (rank 0's rendezvous and step channel)."""
    for _ in range(50):
        port = free_port("127.0.0.1")
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def _node_command(addr: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "pagedserve.server.cli", "serve", "--model", "random:tiny", "--device", "cpu",
            "--dtype", "float32", "--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", addr, *flags]


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
def test_two_nodes_on_loopback_match_tp1(tiny_reference, host):
    """TP=2 over two 'nodes' (separate commands, gloo over TCP, each node one rank): node 1 is `pagedserve serve
    --node-rank 1` (no server), started first; node 0 is an engine here. The same tokens as TP=1; node 1 exits 0
    when node 0 closes. Over IPv4 and IPv6."""
    addr = f"{host}:{_loopback_port()}"
    node1 = subprocess.Popen(_node_command(addr, "--node-rank", "1"), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        eng = engine(tp=2, nnodes=2, dist_init_addr=addr)
        try:
            assert eng.workers.procs == [None] and eng.runner.tp.shm is None  # shared memory: one host only
            ref = {k: {f: v[:32] for f, v in tiny_reference[k].items()} for k in ("r0", "r1")}
            assert_same(generate(eng, PROMPTS[:2], greedy(32)), ref, "2 nodes")
        finally:
            eng.close()
        out, _ = node1.communicate(timeout=BOUND_S)
        assert node1.returncode == 0, out[-3000:]
        assert "no server on this node" in out
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.communicate()


def test_step_channel_refuses_strangers_and_wrong_ranks_then_takes_the_right_one(caplog):
    """Rank 0's listener for other nodes' ranks: a wrong key, a rank of another group size and a rank it does not
    wait for are refused (logged), and start-up goes on to take the rank it waits for."""
    port = free_port()
    got: dict = {}
    listener = threading.Thread(target=lambda: got.update(workers._accept("127.0.0.1", port, range(1, 2), 2)),
                                daemon=True)
    listener.start()
    try:
        for rank, size in [(1, 4), (5, 2)]:  # (_dial waits for the listener to be up)
            with pytest.raises((EOFError, OSError)):
                workers._dial("127.0.0.1", port, rank, size).recv()  # closed by rank 0 after the hello
        with pytest.raises(multiprocessing.AuthenticationError):  # another PAGEDSERVE_DIST_KEY
            multiprocessing.connection.Client(("127.0.0.1", port), authkey=b"not-the-key")
        conn = workers._dial("127.0.0.1", port, 1, 2)
    finally:
        listener.join(timeout=30)
    assert list(got) == [1]
    got[1].send("setup")
    assert conn.recv() == "setup"
    refusals = [r.getMessage() for r in caplog.records if "refused a step-channel connection" in r.getMessage()]
    assert len(refusals) == 3 and "expected ranks 1..1 of 2" in refusals[0] and "rank 5 of" in refusals[1]


def test_cpu_bind_pins_a_single_rank_too():
    """Without tensor parallelism --cpu-bind pins the engine's own process (it was checked, then ignored)."""
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    first = min(cpus)
    try:
        engine(cpu_bind=str(first))
        assert os.sched_getaffinity(0) == {first} and torch.get_num_threads() == 1
    finally:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)


def test_bad_multi_node_flags_are_refused_with_one_line():
    addr = "127.0.0.1:29500"
    for kwargs, message in [(dict(nnodes=2), "nnodes=2 needs dist_init_addr"),
                            (dict(nnodes=2, node_rank=2, dist_init_addr=addr), "node_rank=2 must be in 0..1"),
                            (dict(nnodes=2, dist_init_addr="127.0.0.1"), "is not host:port"),
                            (dict(nnodes=3, dist_init_addr=addr), "nnodes=3 must divide tensor_parallel_size=2"),
                            (dict(nnodes=0), "nnodes must be >= 1, got 0")]:
        with pytest.raises(ValueError, match=message):
            make_config(model="random:tiny", tensor_parallel_size=2, **kwargs)
    cli = subprocess.run(_node_command(addr, "--node-rank", "2"), capture_output=True, text=True, timeout=120)
    assert cli.returncode == 1
    assert cli.stderr.strip().splitlines()[-1] == "pagedserve: error: node_rank=2 must be in 0..1 (nnodes=2)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_check_says_plainly_that_there_is_no_gpu():
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("gpu_check: no CUDA device here")


def _in_thread(fn, timeout: float):
    """Run fn in a thread; return what it raised (or returned). Fails if it has not ended within `timeout`."""
    box: list = []

    def target():
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout} s: a hang"
    return box[0]


def test_killed_worker_fails_the_next_step_cleanly():
    eng = engine(tp=2)
    try:
        generate(eng, PROMPTS[:1], greedy(4))
        pid = eng.workers.procs[0].pid
        os.kill(pid, signal.SIGKILL)
        eng.add_request("after", PROMPTS[0], greedy(8))
        err = _in_thread(lambda: [eng.step() for _ in range(8)], BOUND_S)
        assert isinstance(err, WorkerFailedError), err
        assert f"rank 1 (pid {pid}) was killed by signal 9" in str(err)
        with pytest.raises(WorkerFailedError):  # and it stays failed
            eng.step()
    finally:
        eng.close()


def test_worker_dead_before_joining_ends_start_up_at_once(monkeypatch):
    """A worker that dies before it joins the group (killed here as soon as it is spawned): rank 0 stops waiting for
    it and names it, instead of sitting in the rendezvous until CONNECT_TIMEOUT_S (cut to 30 s here, so the old
    wait ends as a store timeout, which this test tells apart)."""
    spawn = workers.spawn_ranks

    def spawn_and_kill(*args, **kwargs):
        procs = spawn(*args, **kwargs)
        for proc in procs:
            proc.kill()
        return procs

    monkeypatch.setattr(workers, "spawn_ranks", spawn_and_kill)
    monkeypatch.setattr("pagedserve.engine.parallel.group.CONNECT_TIMEOUT_S", 30.0)
    segments = set(our_segments())
    with pytest.raises(WorkerFailedError, match="rank 1 .*killed by signal 9"):
        engine(tp=2)
    assert set(our_segments()) == segments  # its shared-memory segment went too


def test_killed_worker_fails_mid_decode_and_an_idle_server_notices():
    """A worker killed while rank 0 waits in a collective: the step raises (no hang); and an AsyncEngine (the
    server's loop, whose `alive` /health reads) stops when a worker dies while it is idle."""
    eng = engine(tp=2)
    try:
        eng.add_request("long", PROMPTS[0], SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
        eng.step()
        pid = eng.workers.procs[0].pid
        threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
        err = _in_thread(lambda: [eng.step() for _ in range(100000)], BOUND_S)
        assert isinstance(err, WorkerFailedError) and f"pid {pid}" in str(err), err
    finally:
        eng.close()

    eng = engine(tp=2)
    loop = asyncio.new_event_loop()
    aeng = AsyncEngine(eng)
    try:
        aeng.start(loop)
        assert aeng.alive
        os.kill(eng.workers.procs[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + BOUND_S
        while aeng.alive and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not aeng.alive and isinstance(aeng.error, WorkerFailedError)
    finally:
        aeng.shutdown()
        eng.close()
        loop.close()


def test_workers_exit_when_rank0_dies():
    script = ("from pagedserve.engine import LLMEngine, make_config\n"
              "import os, sys\n"
              "if __name__ == '__main__':\n"
              "    e = LLMEngine(make_config(model='random:tiny', device='cpu', dtype='float32', num_blocks=16,"
              " tensor_parallel_size=2))\n"
              "    print(*[p.pid for p in e.workers.procs], flush=True)\n"
              "    os.kill(os.getpid(), 9)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "a worker outlived its rank 0"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
