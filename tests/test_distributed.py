"""CPU: context parallelism's layout and schedule (cupy_flash/distributed.py) against dense NumPy
computations with simulated ranks, and the whole ring (forward and backward, LoopbackRing) on a
float64 dense backend against attention over the unsplit sequence."""

import numpy
import pytest

from cupy_flash import attention_reference, attention_reference_backward, distributed


def test_zigzag_shards_hold_chunks_r_and_2p_minus_1_minus_r_and_unshard_back():
    x = numpy.arange(2 * 24 * 3).reshape(2, 24, 3)
    for world in (1, 2, 3, 4, 6):
        chunk = 24 // (2 * world)
        shards = [distributed.zigzag_shard(x, r, world) for r in range(world)]
        for r, shard in enumerate(shards):
            assert shard.shape == (2, 2 * chunk, 3)
            assert (shard[:, :chunk] == x[:, r * chunk:(r + 1) * chunk]).all()
            assert (shard[:, chunk:] == x[:, (2 * world - 1 - r) * chunk:(2 * world - r) * chunk]).all()
        assert (distributed.zigzag_unshard(shards) == x).all()
    with pytest.raises(ValueError, match="multiple of 2 \\* world"):
        distributed.zigzag_shard(x, 0, 5)
    with pytest.raises(ValueError, match="rank"):
        distributed.zigzag_shard(x, 2, 2)
    with pytest.raises(TypeError, match="world"):
        distributed.zigzag_shard(x, 0, 2.0)


def test_zigzag_indices_order_the_rows_as_the_shards_one_after_another():
    x = numpy.arange(2 * 24 * 3).reshape(2, 24, 3)
    for world in (1, 2, 3, 4, 6):
        index = distributed.zigzag_indices(24, world)
        shards = [distributed.zigzag_shard(x, r, world) for r in range(world)]
        assert (x[:, index] == numpy.concatenate(shards, axis=1)).all()
        assert (x[:, index][:, numpy.argsort(index)] == x).all()
    with pytest.raises(ValueError, match="multiple of 2 \\* world"):
        distributed.zigzag_indices(20, 3)


def _global_rows(rank, world, local):
    """Global positions of a rank's zigzag rows."""
    half = local // 2
    return numpy.concatenate([numpy.arange(c * half, (c + 1) * half) for c in (rank, 2 * world - 1 - rank)])


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, (4, -1)), (False, (2, 5)), (False, (-1, 0)),
                                           (False, (7, -1)), (True, (0, -1)), (False, (0, 0)), (True, (40, -1))])
def test_ring_blocks_compute_exactly_the_visible_pairs_and_balance_the_ranks(world, causal, window):
    local = 6
    work = []
    for rank in range(world):
        done = numpy.zeros((local * world, local * world), dtype=int)   # (query, key) pairs, global
        pairs = 0
        for step in range(world):
            source = distributed.source_rank(rank, world, step)
            rows, keys = _global_rows(rank, world, local), _global_rows(source, world, local)
            for b in distributed.ring_blocks(rank, world, step, causal, local, window):
                assert b.window is None or (not b.causal and min(b.window) >= -1), b
                mask = _visible(b.q_stop - b.q_start, b.k_stop - b.k_start, b.causal, b.window)   # bottom-right
                qi, ki = numpy.nonzero(mask)
                numpy.add.at(done, (rows[b.q_start + qi], keys[b.k_start + ki]), 1)
                pairs += mask.size   # a dense call's work, masked entries included
        mine = _global_rows(rank, world, local)
        dense = _visible(local * world, local * world, causal, window)
        want = numpy.zeros_like(done)
        want[mine] = dense[mine]
        assert (done == want).all(), (rank, world)   # every visible pair once, nothing else
        work.append(pairs)
    if window is None:
        assert max(work) == min(work)   # zigzag: every rank the same work


def test_chunk_visibility_agrees_with_ring_blocks():
    for world in (2, 3, 4):
        for rank in range(world):
            for step in range(world):
                seen = distributed.chunk_visibility(rank, world, step, True)
                blocks = distributed.ring_blocks(rank, world, step, True, 4)
                covered = numpy.full((2, 2), "skip", dtype=object)
                for b in blocks:
                    for i in range(b.q_start // 2, b.q_stop // 2):
                        for j in range(b.k_start // 2, b.k_stop // 2):
                            # a causal block over both chunks masks its upper-right chunk
                            covered[i, j] = "full" if not b.causal or j < i else ("diag" if i == j else "skip")
                assert (covered == seen).all(), (world, rank, step, seen, blocks)


def _visible(nq: int, nk: int, causal: bool, window=None) -> numpy.ndarray:
    """flash_forward's mask, written from its definition: key j is visible from query i iff
    shift - left <= j - i <= shift + right, shift = nk - nq (causal: right 0; -1 unbounded)."""
    left, right = window if window is not None else (-1, -1)
    right = 0 if causal else right
    offset = numpy.arange(nk)[None, :] - numpy.arange(nq)[:, None] - (nk - nq)
    return (offset <= (right if right >= 0 else nq + nk)) & (offset >= (-left if left >= 0 else -nq - nk))


# A float64 dense backend with flash_forward's and flash_backward's contracts (o, lse; gradients
# from the given o and lse, GQA group sums), that also checks no call sees more than one shard.
class DenseBackend:
    def __init__(self, local):
        self.local = local

    def _shape_check(self, q, k):
        assert q.shape[1] <= self.local and k.shape[1] <= self.local, "a call saw more than a shard"

    def forward(self, q, k, v, causal, scale, window=None):
        self._shape_check(q, k)
        return attention_reference(q, k, v, causal=causal, softmax_scale=scale, window_size=window)

    def backward(self, do, q, k, v, o, lse, causal, scale, window=None):
        self._shape_check(q, k)
        group = q.shape[2] // k.shape[2]
        kk, vv = numpy.repeat(k, group, axis=2), numpy.repeat(v, group, axis=2)
        s = scale * numpy.einsum("bqhd,bkhd->bhqk", q, kk)
        s = numpy.where(_visible(q.shape[1], k.shape[1], causal, window), s, -numpy.inf)
        p = numpy.exp(s - lse[..., None])
        dv = numpy.einsum("bhqk,bqhd->bkhd", p, do)
        dp = numpy.einsum("bqhd,bkhd->bhqk", do, vv)
        delta = numpy.einsum("bqhd,bqhd->bhq", do, o)
        ds = p * (dp - delta[..., None])
        dq = scale * numpy.einsum("bhqk,bkhd->bqhd", ds, kk)
        dk = scale * numpy.einsum("bhqk,bqhd->bkhd", ds, q)
        batch, nk, heads_kv, d = k.shape
        return dq, dk.reshape(batch, nk, heads_kv, group, d).sum(3), dv.reshape(batch, nk, heads_kv, group, -1).sum(3)

    def pair(self):
        return self.forward, self.backward


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv, d_v", [(4, 16), (2, 16), (1, 16), (2, 24)])   # d_v: v's head_dim
def test_simulated_ring_equals_attention_over_the_whole_sequence(world, causal, heads_kv, d_v):
    rng = numpy.random.default_rng(world * 10 + heads_kv + causal)
    batch, seqlen, heads, d = 2, 8 * world, 4, 16
    q = rng.standard_normal((batch, seqlen, heads, d))
    k = rng.standard_normal((batch, seqlen, heads_kv, d))
    v = rng.standard_normal((batch, seqlen, heads_kv, d_v))
    do = rng.standard_normal((batch, seqlen, heads, d_v))
    backend = DenseBackend(seqlen // world).pair()
    shard = lambda x: [distributed.zigzag_shard(x, r, world) for r in range(world)]   # noqa: E731
    outs = distributed.simulate_ring_forward(shard(q), shard(k), shard(v), causal=causal, softmax_scale=0.3,
                                             _backend=backend)
    o = distributed.zigzag_unshard([o for o, _ in outs])
    lse = distributed.zigzag_unshard([lse for _, lse in outs], axis=2)
    o_ref, lse_ref = attention_reference(q, k, v, causal=causal, softmax_scale=0.3)
    assert numpy.abs(o - o_ref).max() < 1e-6 and numpy.abs(lse - lse_ref).max() < 1e-5   # merged in float32
    grads = distributed.simulate_ring_backward(shard(do), shard(q), shard(k), shard(v),
                                               shard(o_ref), [distributed.zigzag_shard(lse_ref, r, world, axis=2)
                                                              for r in range(world)],
                                               causal=causal, softmax_scale=0.3, _backend=backend)
    refs = DenseBackend(seqlen).backward(do, q, k, v, o_ref, lse_ref, causal, 0.3)
    for i, name in enumerate(("dq", "dk", "dv")):
        ours = distributed.zigzag_unshard([g[i] for g in grads])
        scale = numpy.abs(refs[i]).max()
        assert numpy.abs(ours - refs[i]).max() <= 1e-6 * scale, name   # summed in float32


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal,window", [(True, (5, -1)), (False, (3, 9)), (False, (-1, 2)), (False, (20, 20)),
                                           (True, (0, -1)), (True, (3, -1)), (True, (4, -1)), (False, (2, 0))])
def test_simulated_ring_with_a_window_equals_attention_over_the_whole_sequence(world, causal, window):
    """A sliding window over global positions, forward and backward against the whole sequence's
    attention: on the ring, each step's calls (a chunk pair each, cropped to the band); with no key
    ahead and at most a chunk (4 rows) back, the halo exchange (halo_window: the last four)."""
    rng = numpy.random.default_rng(world * 7 + causal + window[0])
    batch, seqlen, heads, heads_kv, d = 2, 8 * world, 4, 2, 16
    assert (distributed.halo_window(causal, window, 8) is not None) == (window[1] <= 0 and 0 <= window[0] <= 4)
    q = rng.standard_normal((batch, seqlen, heads, d))
    k, v = (rng.standard_normal((batch, seqlen, heads_kv, d)) for _ in range(2))
    do = rng.standard_normal((batch, seqlen, heads, d))
    backend = DenseBackend(seqlen // world).pair()
    shard = lambda x, axis=1: [distributed.zigzag_shard(x, r, world, axis=axis) for r in range(world)]   # noqa: E731
    options = dict(causal=causal, softmax_scale=0.3, window_size=window, _backend=backend)
    outs = distributed.simulate_ring_forward(shard(q), shard(k), shard(v), **options)
    o = distributed.zigzag_unshard([o for o, _ in outs])
    lse = distributed.zigzag_unshard([lse for _, lse in outs], axis=2)
    o_ref, lse_ref = attention_reference(q, k, v, causal=causal, softmax_scale=0.3, window_size=window)
    assert numpy.abs(o - o_ref).max() < 1e-6 and numpy.abs(lse - lse_ref).max() < 1e-5
    grads = distributed.simulate_ring_backward(shard(do), shard(q), shard(k), shard(v), shard(o_ref),
                                               shard(lse_ref, 2), **options)
    refs = DenseBackend(seqlen).backward(do, q, k, v, o_ref, lse_ref, causal, 0.3, window)
    for i, name in enumerate(("dq", "dk", "dv")):
        ours = distributed.zigzag_unshard([g[i] for g in grads])
        assert numpy.abs(ours - refs[i]).max() <= 1e-6 * numpy.abs(refs[i]).max(), name


def test_ring_arguments_are_checked():
    backend = DenseBackend(8).pair()
    q = [numpy.zeros((1, 8, 2, 16))] * 2
    with pytest.raises(ValueError, match="k has 1 shards"):
        distributed.simulate_ring_forward(q, q[:1], q, _backend=backend)
    with pytest.raises(ValueError, match="local_seqlen"):
        distributed.simulate_ring_forward([numpy.zeros((1, 7, 2, 16))] * 2, [numpy.zeros((1, 7, 2, 16))] * 2,
                                          [numpy.zeros((1, 7, 2, 16))] * 2, causal=True, _backend=backend)
    with pytest.raises(ValueError, match=r"k\[0\]"):
        distributed.simulate_ring_forward(q, [numpy.zeros((1, 6, 2, 16))] * 2, q, _backend=backend)
    with pytest.raises(ValueError, match="window_size left"):
        distributed.simulate_ring_forward(q, q, q, window_size=(-2, 0), _backend=backend)
    with pytest.raises(TypeError, match="window_size"):
        distributed.simulate_ring_backward(q, q, q, q, q, [numpy.zeros((1, 2, 8))] * 2, window_size=4, _backend=backend)


class _OneRankOfMany:
    """Rank 0's view of a ring of ``world`` ranks: a shift hands back arrays of the payloads' shapes
    and dtypes (new ones, as a receive would), so the rank runs the whole schedule alone."""

    def __init__(self, world):
        self.world, self.ranks = world, (0,)

    def start_shift(self, payloads):
        return [tuple(x.copy() for x in payload) for payload in payloads]

    def finish_shift(self, handle):
        return handle


def _peak_bytes_of_one_rank(world, local, causal):
    import tracemalloc

    rng = numpy.random.default_rng(world)
    batch, heads, d = 1, 4, 256   # wide rows: a shard's K/V outweigh the dense stand-in's local^2 scores
    q, k, v, do = (rng.standard_normal((batch, local, heads, d)).astype(numpy.float32) for _ in range(4))
    backend = DenseBackend(local).pair()
    ring = _OneRankOfMany(world)
    distributed._run_forward(_OneRankOfMany(1), [q], [k], [v], causal, None, backend)   # first-call allocations
    tracemalloc.start()
    try:
        ((o, lse),) = distributed._run_forward(ring, [q], [k], [v], causal, None, backend)
        distributed._run_backward(ring, [do], [q], [k], [v], [o], [lse], causal, None, backend)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("causal", [False, True])
def test_a_ranks_memory_is_linear_in_its_shard_and_independent_of_the_ring(causal):
    """O(local tokens) per rank (NumPy's allocations, traced): at a fixed shard, 8 ranks' sequence
    costs a rank what 2 ranks' does (a rank that kept every K/V shard it saw fails: checked by
    hand), and doubling the shard at most triples it (the dense stand-in's scores grow as local^2;
    the flash kernels store none)."""
    two, eight = (_peak_bytes_of_one_rank(world, 64, causal) for world in (2, 8))
    assert eight <= 1.25 * two, (two, eight)   # keeping every shard seen: 2.7x
    assert _peak_bytes_of_one_rank(2, 128, causal) <= 3 * two


def test_packed_shards_hold_chunks_r_and_2p_minus_1_minus_r_of_every_sequence_and_unshard_back():
    cu = numpy.array([0, 8, 8, 24, 32])   # lengths 8, 0, 16, 8 on 2 ranks: chunks of 2, 0, 4, 2
    x = numpy.arange(32 * 3).reshape(32, 3)
    shards = [distributed.zigzag_shard_packed(x, cu, r, 2) for r in range(2)]
    assert shards[0][:, 0].tolist() == [3 * i for i in (0, 1, 8, 9, 10, 11, 24, 25, 6, 7, 20, 21, 22, 23, 30, 31)]
    assert distributed.local_cu_seqlens(cu, 2).tolist() == [0, 2, 2, 6, 8]
    assert (distributed.zigzag_unshard_packed(shards, cu) == x).all()
    lse = numpy.arange(2 * 32).reshape(2, 32)   # (heads, total): rows along axis 1
    assert (distributed.zigzag_unshard_packed([distributed.zigzag_shard_packed(lse, cu, r, 2, axis=1)
                                               for r in range(2)], cu, axis=1) == lse).all()


def _packed_reference(q, k, v, do, cu, causal, sink=None):
    """Attention, its lse and gradients over each sequence of a packed batch on its own (float64)."""
    outs = []
    for a, b in zip(cu[:-1], cu[1:]):
        if a == b:
            continue
        o, lse = attention_reference(q[None, a:b], k[None, a:b], v[None, a:b], causal=causal, softmax_scale=0.3,
                                     sink=sink)
        grads = DenseBackend(b - a).backward(do[None, a:b], q[None, a:b], k[None, a:b], v[None, a:b], o, lse, causal, 0.3) \
            if sink is None else (None,) * 3
        outs.append((o[0], lse[0], *(g if g is None else g[0] for g in grads)))
    return [numpy.concatenate([x[i] for x in outs], axis=1 if i == 1 else 0) if outs[0][i] is not None else None
            for i in range(5)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [4, 1])
def test_simulated_ring_over_packed_shards_equals_each_sequence_alone(world, causal, heads_kv):
    """A packed batch of mixed lengths (an empty sequence among them) on the ring: each sequence cut
    into 2P chunks, the shards chunk-major; forward and backward against attention over each whole
    sequence on its own."""
    rng = numpy.random.default_rng(world * 5 + causal + heads_kv)
    lengths = numpy.array([3, 0, 1, 5]) * 2 * world
    cu = numpy.concatenate([[0], numpy.cumsum(lengths)])
    total, heads, d = int(cu[-1]), 4, 16
    q, do = (rng.standard_normal((total, heads, d)) for _ in range(2))
    k, v = (rng.standard_normal((total, heads_kv, d)) for _ in range(2))
    backend = DenseBackend(total).pair()
    shard = lambda x, axis=0: [distributed.zigzag_shard_packed(x, cu, r, world, axis) for r in range(world)]   # noqa: E731
    options = dict(causal=causal, softmax_scale=0.3, cu_seqlens=cu, _backend=backend)
    outs = distributed.simulate_ring_forward(shard(q), shard(k), shard(v), **options)
    o = distributed.zigzag_unshard_packed([o for o, _ in outs], cu)
    lse = distributed.zigzag_unshard_packed([lse for _, lse in outs], cu, axis=1)
    o_ref, lse_ref, *refs = _packed_reference(q, k, v, do, cu, causal)
    assert numpy.abs(o - o_ref).max() < 1e-6 and numpy.abs(lse - lse_ref).max() < 1e-5
    grads = distributed.simulate_ring_backward(shard(do), shard(q), shard(k), shard(v), shard(o_ref), shard(lse_ref, 1),
                                               **options)
    for i, name in enumerate(("dq", "dk", "dv")):
        ours = distributed.zigzag_unshard_packed([g[i] for g in grads], cu)
        assert numpy.abs(ours - refs[i]).max() <= 1e-6 * numpy.abs(refs[i]).max(), name


def test_packed_ring_takes_a_sink():
    world, rng = 3, numpy.random.default_rng(2)
    cu = numpy.array([0, 12, 18, 42])
    q, k, v = (rng.standard_normal((42, 2, 8)) for _ in range(3))
    sink = numpy.array([0.5, -1.0])
    shard = lambda x: [distributed.zigzag_shard_packed(x, cu, r, world) for r in range(world)]   # noqa: E731
    outs = distributed.simulate_ring_forward(shard(q), shard(k), shard(v), causal=True, softmax_scale=0.3, sink=sink,
                                             cu_seqlens=cu, _backend=DenseBackend(42).pair())
    o = distributed.zigzag_unshard_packed([o for o, _ in outs], cu)
    o_ref, lse_ref, *_ = _packed_reference(q, k, v, q, cu, True, sink=sink)
    assert numpy.abs(o - o_ref).max() < 1e-6
    assert numpy.abs(distributed.zigzag_unshard_packed([lse for _, lse in outs], cu, axis=1) - lse_ref).max() < 1e-5


def test_packed_ring_arguments_are_checked():
    backend = DenseBackend(8).pair()
    q = [numpy.zeros((8, 2, 16))] * 2
    with pytest.raises(ValueError, match="sequence 1 has 6 tokens.*multiple of 4"):
        distributed.simulate_ring_forward(q, q, q, cu_seqlens=numpy.array([0, 8, 14]), _backend=backend)
    with pytest.raises(ValueError, match="window_size is not supported with cu_seqlens"):
        distributed.simulate_ring_forward(q, q, q, cu_seqlens=numpy.array([0, 16]), window_size=(4, 0), _backend=backend)
    with pytest.raises(ValueError, match=r"q\[0\] has shape \(8, 2, 16\).*12 rows"):
        distributed.simulate_ring_forward(q, q, q, cu_seqlens=numpy.array([0, 24]), _backend=backend)
    with pytest.raises(ValueError, match="no tokens"):
        distributed.simulate_ring_forward(q, q, q, cu_seqlens=numpy.array([0, 0]), _backend=backend)
    with pytest.raises(ValueError, match="start at 0"):
        distributed.simulate_ring_forward(q, q, q, cu_seqlens=numpy.array([4, 20]), _backend=backend)


class ReferenceBackend:
    """float64 attention_reference with every option, as the all-to-all mode's backend."""

    @staticmethod
    def forward(q, k, v, causal, scale, options):
        return attention_reference(q, k, v, causal=causal, softmax_scale=scale, **options)

    @staticmethod
    def backward(do, q, k, v, o, lse, causal, scale, options):
        return attention_reference_backward(do, q, k, v, causal=causal, softmax_scale=scale, **options)

    @classmethod
    def pair(cls):
        return cls.forward, cls.backward


ULYSSES_VARIANTS = {
    "plain": {}, "causal": dict(causal=True), "window": dict(causal=True, window_size=(5, -1)),
    "softcap, sink": dict(softcap=3.0, sink=numpy.array([0.5, -1.0, 2.0, 0.0])),
    "alibi": dict(alibi_slopes=numpy.array([0.1, 0.2, 0.4, 0.8])),
}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("heads_kv", [4, 2])
@pytest.mark.parametrize("variant", list(ULYSSES_VARIANTS))
def test_simulated_all_to_all_equals_attention_over_the_whole_sequence(world, heads_kv, variant):
    """All-to-all over heads (contiguous shards; each rank attends heads / P over the whole sequence)
    against the whole sequence's attention: o, lse and the gradients (dsink: the ranks' parts add
    up)."""
    if heads_kv % world:
        pytest.skip("K/V heads must be a multiple of the ranks")
    options = dict(ULYSSES_VARIANTS[variant])
    rng = numpy.random.default_rng(world * 3 + heads_kv + len(variant))
    batch, seqlen, heads, d = 2, 6 * world, 4, 8
    q, do = (rng.standard_normal((batch, seqlen, heads, d)) for _ in range(2))
    k, v = (rng.standard_normal((batch, seqlen, heads_kv, d)) for _ in range(2))

    def shard(x, axis=1):
        return numpy.split(x, world, axis=axis)

    outs = distributed.simulate_ulysses_forward(shard(q), shard(k), shard(v), softmax_scale=0.3,
                                                _backend=ReferenceBackend.pair(), **options)
    o, lse = numpy.concatenate([o for o, _ in outs], axis=1), numpy.concatenate([lse for _, lse in outs], axis=2)
    o_ref, lse_ref = attention_reference(q, k, v, softmax_scale=0.3, **options)
    assert numpy.abs(o - o_ref).max() < 1e-12 and numpy.abs(lse - lse_ref).max() < 1e-12
    grads = distributed.simulate_ulysses_backward(shard(do), shard(q), shard(k), shard(v), shard(o_ref),
                                                  shard(lse_ref, 2), softmax_scale=0.3,
                                                  _backend=ReferenceBackend.pair(), **options)
    refs = attention_reference_backward(do, q, k, v, softmax_scale=0.3, **options)
    for i, name in enumerate(("dq", "dk", "dv")):
        ours = numpy.concatenate([g[i] for g in grads], axis=1)
        assert numpy.abs(ours - refs[i]).max() <= 1e-12 * numpy.abs(refs[i]).max(), name
    if "sink" in options:
        assert numpy.abs(sum(g[3] for g in grads) - refs[3]).max() <= 1e-12 * numpy.abs(refs[3]).max()


def test_all_to_all_arguments_are_checked():
    backend = ReferenceBackend.pair()
    q = numpy.split(numpy.zeros((1, 8, 4, 8)), 2, axis=1)
    with pytest.raises(ValueError, match="k has 3 heads, not a multiple of the 2 ranks"):
        distributed.simulate_ulysses_forward(q, numpy.split(numpy.zeros((1, 8, 3, 8)), 2, axis=1), q, _backend=backend)
    with pytest.raises(TypeError, match="does not take bias"):
        distributed.simulate_ulysses_forward(q, q, q, bias=numpy.zeros((1, 4, 8, 8)), _backend=backend)
    with pytest.raises(ValueError, match=r"sink has shape \(3,\)"):
        distributed.simulate_ulysses_forward(q, q, q, sink=numpy.zeros(3), _backend=backend)


@pytest.mark.parametrize("world,group_size", [(4, 2), (4, 4), (4, 1), (6, 2), (6, 3)])
@pytest.mark.parametrize("causal,window,sink", [(True, None, False), (False, None, True), (True, (5, -1), False),
                                                (True, (20, -1), True)])
def test_simulated_hybrid_equals_attention_over_the_whole_sequence(world, group_size, causal, window, sink):
    """All-to-all over heads inside groups, the ring across them (group_size 1: the ring alone;
    group_size = world: all-to-all alone), against the whole sequence's attention."""
    groups = world // group_size
    rng = numpy.random.default_rng(world * 7 + group_size + causal)
    batch, seqlen, heads, heads_kv, d = 2, 4 * world * groups, 6 if world == 6 else 4, 6 if world == 6 else 4, 8
    heads = heads * (group_size if heads % group_size else 1)
    heads_kv = heads
    q, do = (rng.standard_normal((batch, seqlen, heads, d)) for _ in range(2))
    k, v = (rng.standard_normal((batch, seqlen, heads_kv, d)) for _ in range(2))
    sinks = rng.standard_normal(heads) if sink else None
    options = dict(group_size=group_size, causal=causal, softmax_scale=0.3, window_size=window, sink=sinks,
                   _backend=DenseBackend(seqlen).pair())

    def shard(x, axis=1):
        return [distributed.hybrid_shard(x, r, world, group_size, axis=axis) for r in range(world)]

    outs = distributed.simulate_hybrid_forward(shard(q), shard(k), shard(v), **options)
    o = distributed.hybrid_unshard([o for o, _ in outs], group_size)
    lse = distributed.hybrid_unshard([lse for _, lse in outs], group_size, axis=2)
    o_ref, lse_ref = attention_reference(q, k, v, causal=causal, softmax_scale=0.3, window_size=window, sink=sinks)
    assert numpy.abs(o - o_ref).max() < 1e-6 and numpy.abs(lse - lse_ref).max() < 1e-5
    grads = distributed.simulate_hybrid_backward(shard(do), shard(q), shard(k), shard(v), shard(o_ref), shard(lse_ref, 2),
                                                 **options)
    refs = attention_reference_backward(do, q, k, v, causal=causal, softmax_scale=0.3, window_size=window, sink=sinks)
    for i, name in enumerate(("dq", "dk", "dv")):
        ours = distributed.hybrid_unshard([g[i] for g in grads], group_size)
        assert numpy.abs(ours - refs[i]).max() <= 1e-6 * numpy.abs(refs[i]).max(), name
    if sink:
        assert numpy.abs(sum(g[3] for g in grads) - refs[3]).max() <= 1e-6 * numpy.abs(refs[3]).max()


def test_hybrid_group_size_is_checked():
    q = [numpy.zeros((1, 8, 4, 8))] * 4
    with pytest.raises(ValueError, match="group_size is 3; expected a positive integer dividing the 4 ranks"):
        distributed.simulate_hybrid_forward(q, q, q, group_size=3)
    with pytest.raises(ValueError, match="q has 4 heads, not a multiple of the 8 ranks"):
        distributed.simulate_hybrid_forward([numpy.zeros((1, 8, 4, 8))] * 8, [numpy.zeros((1, 8, 4, 8))] * 8,
                                            [numpy.zeros((1, 8, 4, 8))] * 8, group_size=8)
