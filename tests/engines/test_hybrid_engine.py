"""3D-HybridEngine: layout arithmetic on many layouts, and real transitions on spawned gloo processes."""
import itertools
from fractions import Fraction

import pytest
import torch
from support import reshard_baselines as base
from support.reshard_baselines import decoder_specs, model_bytes
from support.reshard_harness import MegatronGather, Transition, megatron_weights, run_cases

from hybridflow.engines.bridge import layout as lay
from hybridflow.engines.bridge import reshard as rs


def _divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


LAYOUTS = [lay.Layout(p, t, d, p_g, t_g)
           for p, t, d in itertools.product((1, 2, 4), (1, 2, 4, 8), (1, 2, 3))
           for p_g in _divisors(p) for t_g in _divisors(t)]


@pytest.mark.parametrize("L", LAYOUTS, ids=str)
def test_groups_partition_the_world(L):
    for groups, size in ((lay.train_tp_groups(L), L.t), (lay.train_pp_groups(L), L.p), (lay.train_dp_groups(L), L.d),
                         (lay.micro_dp_groups(L), L.d_g), (lay.gen_tp_groups(L), L.t_g),
                         (lay.gen_pp_groups(L), L.p_g), (base.naive_gen_tp_groups(L), L.t_g)):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(L.world))
        assert {len(g) for g in groups} == {size}


@pytest.mark.parametrize("L", LAYOUTS, ids=str)
def test_hybridflow_grouping_is_redundancy_free(L):
    assert base.redundancy_free(L)
    for g in lay.micro_dp_groups(L):
        tps = sorted({L.coords(r)[0] for r in g})
        assert tps == list(range(tps[0], tps[0] + L.s_t)), "micro-DP groups are consecutive TP ranks"
        # the micro-DP group's training shards are exactly one generation shard
        shards = {lay.train_shard(L, r) for r in g}
        gen_tps, gen_pps = lay.gen_shard(L, g[0])
        assert shards == {(a, b) for a in gen_tps for b in gen_pps}
    for g in lay.gen_tp_groups(L):
        tps = [L.coords(r)[0] for r in g]
        assert all(b - a == L.s_t for a, b in zip(tps, tps[1:])), "generation TP ranks at stride t/t_g"
        assert sorted(lay.gen_tp_rank(L, r) for r in g) == list(range(L.t_g))


@pytest.mark.parametrize("L", LAYOUTS, ids=str)
def test_communication_formula(L):
    M = 1
    hf = base.comm_fraction(L, "hybridflow")
    # (d_g - 1) training shards of size M/(t p) arrive at every rank
    assert hf == Fraction(L.d_g - 1, L.t * L.p) * M
    assert hf <= base.comm_fraction(L, "hybridflow-v") <= base.comm_fraction(L, "deepspeed-chat")
    # generation memory, measured on the generation shard itself (the reference the real transitions are checked
    # against) for every rank: the formula's share of the TP-split weights (norms are replicated, so held whole)
    specs = [s for s in decoder_specs(4, 8) if s.split_dim is not None]
    memory = base.peak_memory_fraction(L, "hybridflow") * model_bytes(specs)
    for rank in range(L.world):
        assert sum(t.nbytes for t in base.expected_generation_shard(L, rank, specs).values()) == memory, rank


def test_naive_grouping_loses_zero_redundancy_where_the_paper_says():
    L = lay.Layout(1, 4, 1, 1, 2)
    assert any(lay.train_shard(L, r)[0] not in base.naive_gen_shard(L, r)[0] for r in range(L.world))


def test_invalid_layout():
    with pytest.raises(ValueError, match="must divide"):
        lay.Layout(1, 4, 1, 1, 3)


TRANSITIONS = [lay.Layout(1, 4, 1, 1, 2), lay.Layout(2, 2, 1, 1, 2), lay.Layout(1, 2, 2, 1, 1),
               lay.Layout(2, 2, 1, 1, 1)]

# --- real transitions on gloo: the cases of every test below run on ONE spawn of 4 ranks (the gloo fixture) ---------


def _transition_case(L, scheme):
    return Transition(L, scheme, layers=4, hidden=64)


def _bucketed_case(L, bucket_bytes):
    return Transition(L, "hybridflow", layers=4, hidden=64, bucket_bytes=bucket_bytes)


def _megatron_case(L, bucket_bytes):
    return MegatronGather(L, bucket_bytes)


_GLOO_CASES = {  # test -> its case, from its parameters
    "test_transition_builds_exact_generation_weights_with_the_predicted_traffic": _transition_case,
    "test_bucketed_all_gather_on_gloo_is_exact_and_bounded": _bucketed_case,
    "test_megatron_micro_dp_gather_is_exact": _megatron_case,
}


@pytest.fixture(scope="module")
def gloo(request):
    """Starting 4 processes and importing torch costs seconds, a case milliseconds: the cases of all the selected
    tests below run on one spawn of gloo ranks, each case on process groups of its own (run_cases), and each test
    then reads its own case's per-rank results. A case that failed (a rank raised, died or hung) fails its test
    only, with each rank's traceback; run_cases leaves no process behind, whatever happened."""
    cases = []
    for item in request.session.items:
        make = _GLOO_CASES.get(getattr(item, "originalname", None))
        if make is not None and item.module is request.module:
            case = make(**item.callspec.params)
            if case not in cases:
                cases.append(case)
    results = dict(zip(cases, run_cases(cases))) if cases else {}

    def results_of(case):
        if case not in results:  # a test that was not among the session's items
            results[case] = run_cases([case])[0]
        got = results[case]
        if isinstance(got, str):
            pytest.fail(got, pytrace=False)
        return got

    return results_of


@pytest.mark.slow
@pytest.mark.parametrize("L", TRANSITIONS, ids=str)
@pytest.mark.parametrize("scheme", ["hybridflow", "hybridflow-v", "deepspeed-chat"])
def test_transition_builds_exact_generation_weights_with_the_predicted_traffic(gloo, L, scheme):
    case = _transition_case(L, scheme)
    M = model_bytes(decoder_specs(case.layers, case.hidden))
    results = gloo(case)
    assert all(r["ok"] for r in results), results
    predicted = float(base.comm_fraction(L, scheme)) * M
    for r in results:
        # replicated norm weights travel whole; everything else matches the formula: within 1%
        assert r["bytes_received"] == pytest.approx(predicted, rel=0.01, abs=1)
    if scheme == "hybridflow":
        gen = results[0]["generation_bytes"]
        assert gen == pytest.approx(float(base.peak_memory_fraction(L, scheme)) * M, rel=0.01)


# --- HybridFlow's gather: byte-target buckets, one contiguous all-gather buffer each, direct tensors in place ------

def test_byte_buckets_coalesce_up_to_the_target_and_never_mix_kinds():
    sizes = [1, 1, 5, 1, 1, 1, 3, 2]
    buckets = list(rs.byte_buckets(iter(sizes), lambda n: n, 3))
    assert buckets == [[1, 1], [5], [1, 1, 1], [3], [2]]  # in order, whole items, an oversize item alone
    assert [n for b in buckets for n in b] == sizes
    items = [(1, "a"), (1, "a"), (1, "b"), (1, "b")]
    assert list(rs.byte_buckets(items, lambda x: x[0], 100, kind=lambda x: x[1])) == [items[:2], items[2:]]


class _Recorder:
    """collectives.all_gather_into that keeps what this rank sends (and gathers zeros): a member's inputs, bucket by
    bucket."""

    def __init__(self):
        self.sent = []

    def __call__(self, out, flat, group=None):
        self.sent.append(flat.clone())
        out.zero_()


class _Loopback:
    """collectives.all_gather_into for one member of a micro-DP group in one process: the i-th call gathers every
    member's i-th recorded input, and checks this member sends what it sent when recorded."""

    def __init__(self, sent: list[list], me: int):
        self.sent, self.me, self.calls = sent, me, 0

    def __call__(self, out, flat, group=None):
        i, self.calls = self.calls, self.calls + 1
        assert torch.equal(flat, self.sent[self.me][i])
        out.view(-1).copy_(torch.cat([inputs[i] for inputs in self.sent]))


IN_PROCESS = [L for L in LAYOUTS if L.d == 1 and L.d_g > 1]


@pytest.mark.parametrize("bucket_bytes", [200, 5000, 1 << 30], ids=["blocks", "mixed", "everything"])
@pytest.mark.parametrize("L", IN_PROCESS, ids=str)
def test_bucketed_gather_builds_the_exact_generation_shard_with_a_bounded_buffer(monkeypatch, L, bucket_bytes):
    """Every rank of every micro-DP group, whatever the bucket size (tensors cut into blocks of a few rows or
    columns, blocks and whole tensors coalesced across layers, the whole local model at once): the generation shard
    equals the full model's slice, no all-gather input exceeds the bucket, and the transient buffers stay within
    one bucket gathered d_g ways, its input and one joined block."""
    layers, hidden = 4, 16
    specs = decoder_specs(layers, hidden)
    for group in lay.micro_dp_groups(L):
        sent = []
        for rank in group:
            monkeypatch.setattr(rs.collectives, "all_gather_into", _Recorder())
            base.reshard_hybridflow(L, rank, base.train_shards(L, rank, specs), specs, group, None, bucket_bytes)
            sent.append(rs.collectives.all_gather_into.sent)
        for me, rank in enumerate(group):
            monkeypatch.setattr(rs.collectives, "all_gather_into", _Loopback(sent, me))
            shards = base.train_shards(L, rank, specs)
            gen, stats = base.reshard_hybridflow(L, rank, shards, specs, group, None, bucket_bytes)
            expected = base.expected_generation_shard(L, rank, specs)
            assert gen.keys() == expected.keys()
            assert all(torch.equal(gen[k], expected[k]) for k in expected), (L, rank)
            assert stats.bytes_received == (L.d_g - 1) * sum(t.nbytes for t in shards.values())
            piece = max(bucket_bytes, _largest_slice(shards, specs))  # the most one joined all-gather can take
            whole = {t.nbytes for t in shards.values()}
            assert all(x.nbytes <= piece or x.nbytes in whole for x in sent[me])  # else a direct shard, whole
            assert stats.peak_transient_bytes <= (2 * L.d_g + 1) * piece
            # buffers kept as generation tensors hold nothing else: generation memory is exactly the shard's bytes
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in gen.values()}
            assert sum(storages.values()) == stats.generation_bytes


def _largest_slice(shards, specs):
    """The largest block a shard can be cut into: one slice along the axis its TP split leaves whole (a 1-D
    tensor travels whole)."""
    def one(spec):
        t = shards[spec.name]
        return t.nbytes if t.dim() < 2 else t.nbytes // t.shape[1 if spec.split_dim == 0 else 0]
    return max(one(s) for s in specs if s.name in shards)


@pytest.mark.slow
@pytest.mark.parametrize("bucket_bytes", [1000, 50_000, rs.BUCKET_BYTES], ids=["blocks", "mixed", "default"])
@pytest.mark.parametrize("L", [lay.Layout(1, 4, 1, 1, 2), lay.Layout(2, 2, 1, 1, 1)], ids=str)
def test_bucketed_all_gather_on_gloo_is_exact_and_bounded(gloo, L, bucket_bytes):
    """The real collective (gloo's all_gather_single into one buffer) at several bucket sizes: the same generation
    shards and bytes, and a transient peak of at most one bucket gathered d_g ways, its input and one joined block:
    with buckets smaller than the model, far below the generation memory M/(t_g p_g) of the paper's formula."""
    case = _bucketed_case(L, bucket_bytes)
    specs = decoder_specs(case.layers, case.hidden)
    M = model_bytes(specs)
    results = gloo(case)
    assert all(r["ok"] for r in results), results
    piece = max(bucket_bytes, _largest_slice(base.train_shards(L, 0, specs), specs))
    generation = float(base.peak_memory_fraction(L, "hybridflow")) * M
    for r in results:
        assert r["bytes_received"] == pytest.approx(float(base.comm_fraction(L, "hybridflow")) * M, rel=0.01)
        assert r["generation_bytes"] == pytest.approx(generation, rel=0.01)
        assert r["peak_transient_bytes"] <= (2 * L.d_g + 1) * piece
        if bucket_bytes <= 50_000:
            assert r["peak_transient_bytes"] < generation / 2


@pytest.mark.slow
@pytest.mark.parametrize("bucket_bytes", [1, 3000, rs.BUCKET_BYTES], ids=["slices", "mixed", "default"])
@pytest.mark.parametrize("L", [lay.Layout(1, 4, 1, 1, 2), lay.Layout(1, 2, 2, 1, 1), lay.Layout(2, 2, 1, 1, 1),
                               lay.Layout(2, 2, 1, 1, 2)],
                         ids=str)
def test_megatron_micro_dp_gather_is_exact(gloo, L, bucket_bytes):
    """The actor's path (gather_micro_dp; gather_stages where pipeline stages join) over every megatron sharding
    rule, bf16 beside fp32, on real gloo: every generation shard equals sharding the whole weights t_g ways, dtypes
    kept (names in order where nothing joins stages)."""
    results = gloo(_megatron_case(L, bucket_bytes))
    assert all(r["ok"] for r in results), results
    M = sum(t.numel() * t.element_size() for t in megatron_weights().values())
    # the mean: stages hold unequal shares (the embedding); replicated norms (fp32 at hidden 32, ~2% of these bytes)
    # travel to every member of the group, not a 1/t share of them as the formula counts
    mean = sum(r["bytes_received"] for r in results) / len(results)
    assert mean == pytest.approx(float(base.comm_fraction(L, "hybridflow")) * M, rel=0.05)
