"""Context parallelism: exact attention over a sequence split across ranks (ring attention).

Each of P ranks holds a shard of the sequence: q, k, v (batch, local_seqlen, heads, head_dim), in
zigzag order for causal balance (``zigzag_shard``: the sequence cut into 2P chunks, rank r holding
chunks r and 2P - 1 - r). The K/V shards travel around the ring (rank r sends to r + 1 and receives
from r - 1) while each rank attends its queries to the shard in hand; the partial outputs merge
exactly through their logsumexp (o = sum_s exp(lse_s - lse) o_s in float32). The backward sends
K/V around again with float32 dK/dV accumulators, which arrive home summed after P shifts; dQ
stays local.

Chunk-level causality makes each step one dense call (``ring_blocks``):
    step 0 (own K/V):              causal over the local shards (the concatenation of two chunks
                                   keeps the global order of every pair it does not skip);
    K/V from a rank before this one: all local queries against the K/V's first chunk, no mask;
    K/V from a rank after this one:  the local second chunk of queries against all of it, no mask;
so every rank does the same work at every step, and skipped blocks are never launched. Without a
mask every step is one unmasked call over the whole shards.

Transports: ``LoopbackRing`` runs P virtual ranks in one process (the same schedule; a shift is a
rotation of the ranks' payloads), so exactness is tested on one GPU, or on the CPU with a dense
backend; ``NcclRing`` is one process per GPU over NCCL (CuPy's ``cupy.cuda.nccl``), the shifts on a
stream of their own so the next K/V travels while this one is attended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers

import numpy

from ._checks import check_softmax_scale
from ._features import check_window
from ._rendezvous import launch_environment
from .reference import _xp

__all__ = ["zigzag_shard", "zigzag_indices", "zigzag_unshard", "zigzag_shard_packed", "zigzag_unshard_packed",
           "zigzag_packed_indices", "local_cu_seqlens", "ring_blocks", "packed_ring_blocks", "RingBlock",
           "LoopbackRing", "NcclRing", "launch_environment", "ring_attention_forward", "ring_attention_backward",
           "simulate_ring_forward", "simulate_ring_backward", "ulysses_attention_forward",
           "ulysses_attention_backward", "simulate_ulysses_forward", "simulate_ulysses_backward", "hybrid_shard",
           "hybrid_unshard", "hybrid_attention_forward", "hybrid_attention_backward", "simulate_hybrid_forward",
           "simulate_hybrid_backward"]


# ---------------------------------------------------------------------------------------------
# Layout.

def _check_world(rank, world) -> None:
    for name, value in (("world", world), ("rank", rank)):
        if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if world < 1:
        raise ValueError(f"world is {world}; at least 1 rank")
    if not 0 <= rank < world:
        raise ValueError(f"rank is {rank}; expected 0 <= rank < world = {world}")


def zigzag_shard(x, rank: int, world: int, axis: int = 1):
    """Rank ``rank``'s shard of a full sequence ``x``: of the 2 * world equal chunks along ``axis``,
    chunk rank then chunk 2 * world - 1 - rank (a new array). The length along ``axis`` must be a
    multiple of 2 * world."""
    _check_world(rank, world)
    length = x.shape[axis]
    if length % (2 * world):
        raise ValueError(f"x has {length} rows along axis {axis}; zigzag shards need a multiple of 2 * world = {2 * world}")
    chunk = length // (2 * world)
    index = [slice(None)] * x.ndim
    parts = []
    for c in (rank, 2 * world - 1 - rank):
        index[axis] = slice(c * chunk, (c + 1) * chunk)
        parts.append(x[tuple(index)])
    return _xp(x).concatenate(parts, axis=axis)


def zigzag_indices(length: int, world: int) -> numpy.ndarray:
    """The row order that puts a full sequence of ``length`` rows in zigzag shards: ``x[:, index]``
    is the ranks' shards (zigzag_shard) one after another, so a mesh's contiguous split of that
    axis hands rank r its zigzag shard (the JAX ring, jax_adapter.ring_attention);
    ``numpy.argsort(index)`` puts the rows back."""
    _check_world(0, world)
    if length % (2 * world):
        raise ValueError(f"length is {length}; zigzag shards need a multiple of 2 * world = {2 * world}")
    chunk = length // (2 * world)
    return numpy.concatenate([numpy.arange(c * chunk, (c + 1) * chunk) for rank in range(world)
                              for c in (rank, 2 * world - 1 - rank)])


def zigzag_unshard(shards, axis: int = 1):
    """The full sequence from the ranks' zigzag shards (``shards[r]`` of rank r), along ``axis``."""
    world = len(shards)
    if world < 1:
        raise ValueError("shards is empty; expected one shard per rank")
    length = shards[0].shape[axis]
    if length % 2 or any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"shards must have one shape with an even length along axis {axis}, got "
                         f"{[tuple(s.shape) for s in shards]}")
    half = length // 2
    index = [slice(None)] * shards[0].ndim
    chunks = [None] * (2 * world)
    for rank, shard in enumerate(shards):
        for position, c in enumerate((rank, 2 * world - 1 - rank)):
            index[axis] = slice(position * half, (position + 1) * half)
            chunks[c] = shard[tuple(index)]
    return _xp(shards[0]).concatenate(chunks, axis=axis)


# Packed (variable-length) batches: each sequence cut into 2P chunks as a dense one is, a rank
# holding chunks r and 2P - 1 - r of every sequence, chunk-major: rows [0, half) hold chunk r of
# each sequence in turn, rows [half, 2 half) chunk 2P - 1 - r of each. Each half is then a packed
# batch of its own with one prefix-sum array (``local_cu_seqlens``), so a ring step is a packed call
# per pair of halves (packed_ring_blocks).

def _packed_lengths(cu_seqlens, world: int) -> numpy.ndarray:
    """The sequences' lengths (int64) from the whole batch's ``cu_seqlens`` (host or GPU), each a
    multiple of 2 x world, else ValueError naming the first that is not."""
    host = numpy.asarray(cu_seqlens.get() if hasattr(cu_seqlens, "get") else cu_seqlens)
    if host.ndim != 1 or host.shape[0] < 2 or host.dtype.kind not in "iu":
        raise ValueError(f"cu_seqlens must be a 1-D integer array of batch + 1 >= 2 offsets, got shape {host.shape} "
                         f"and dtype {host.dtype}")
    host = host.astype(numpy.int64)
    lengths = numpy.diff(host)
    if host[0] != 0 or (lengths < 0).any():
        raise ValueError(f"cu_seqlens must start at 0 and not decrease (prefix sums of lengths), got {host.tolist()[:16]}")
    off = numpy.flatnonzero(lengths % (2 * world))
    if off.size:
        b = int(off[0])
        raise ValueError(f"cu_seqlens: sequence {b} has {int(lengths[b])} tokens; on a ring of {world} ranks each "
                         f"sequence is cut into {2 * world} equal chunks, so its length must be a multiple of {2 * world}")
    return lengths


def local_cu_seqlens(cu_seqlens, world: int) -> numpy.ndarray:
    """int32 prefix sums of one chunk of each sequence: each half of a rank's packed shard is a packed
    batch with these offsets (the shard holds 2 x their last rows)."""
    chunks = _packed_lengths(cu_seqlens, world) // (2 * world)
    return numpy.concatenate([[0], numpy.cumsum(chunks)]).astype(numpy.int32)


def zigzag_packed_indices(cu_seqlens, rank: int, world: int) -> numpy.ndarray:
    """The rows of the whole packed batch that rank ``rank`` holds, in its shard's order: chunk r of
    every sequence, then chunk 2P - 1 - r of every sequence."""
    _check_world(rank, world)
    lengths = _packed_lengths(cu_seqlens, world)
    starts, chunks = numpy.concatenate([[0], numpy.cumsum(lengths)[:-1]]), lengths // (2 * world)
    return numpy.concatenate([numpy.arange(start + c * size, start + (c + 1) * size, dtype=numpy.int64)
                              for c in (rank, 2 * world - 1 - rank) for start, size in zip(starts, chunks)]
                             + [numpy.zeros(0, numpy.int64)])


def zigzag_shard_packed(x, cu_seqlens, rank: int, world: int, axis: int = 0):
    """Rank ``rank``'s shard of a packed batch ``x`` (rows along ``axis``: q, k, v, o, do (total,
    heads, d); lse (heads, total) with axis=1) with the whole batch's ``cu_seqlens``."""
    xp = _xp(x)
    return xp.take(x, xp.asarray(zigzag_packed_indices(cu_seqlens, rank, world)), axis=axis)


def zigzag_unshard_packed(shards, cu_seqlens, axis: int = 0):
    """The whole packed batch from every rank's shard (the inverse of zigzag_shard_packed)."""
    world = len(shards)
    order = numpy.concatenate([zigzag_packed_indices(cu_seqlens, r, world) for r in range(world)])
    xp = _xp(shards[0])
    return xp.take(xp.concatenate(list(shards), axis=axis), xp.asarray(numpy.argsort(order)), axis=axis)


def packed_ring_blocks(rank: int, world: int, step: int, causal: bool, local_rows: int) -> list[RingBlock]:
    """The calls rank ``rank`` makes at ``step`` on chunk-major packed shards of ``local_rows`` rows:
    one per pair of halves (its chunk r or 2P - 1 - r of every sequence, against the shard in
    hand's) that sees anything, causal where the two chunks are the same (each sequence's block on
    the diagonal, equal lengths), unmasked where the keys' chunk comes first (chunk_visibility)."""
    if not 0 <= step < world:
        raise ValueError(f"step is {step}; expected 0 <= step < world = {world}")
    half = local_rows // 2
    seen = chunk_visibility(rank, world, step, causal)
    return [RingBlock(i * half, (i + 1) * half, j * half, (j + 1) * half, seen[i, j] == "diag")
            for i in range(2) for j in range(2) if seen[i, j] != "skip"]


# ---------------------------------------------------------------------------------------------
# The schedule.

@dataclasses.dataclass(frozen=True)
class RingBlock:
    """One dense call of a ring step, in the rank's local rows: queries [q_start, q_stop) of its
    shard against keys [k_start, k_stop) of the K/V shard in hand, with or without the causal mask,
    or with ``window`` = (left, right), flash_forward's window_size for the block (both masks aligned
    as flash_forward aligns them: bottom-right)."""
    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    causal: bool
    window: tuple[int, int] | None = None


def source_rank(rank: int, world: int, step: int) -> int:
    """The rank whose K/V shard rank ``rank`` holds at ``step`` (shifts go r -> r + 1)."""
    return (rank - step) % world


def ring_blocks(rank: int, world: int, step: int, causal: bool, local_seqlen: int,
                window_size=None) -> list[RingBlock]:
    """The dense calls rank ``rank`` makes at ``step`` on shards of ``local_seqlen`` rows (zigzag:
    two chunks of local_seqlen / 2), from the chunk-level mask; an empty list skips the step.
    ``window_size`` = (left, right) over the whole sequence, as flash_forward's (causal: right 0):
    a call per pair of chunks the band reaches (_band_block)."""
    _check_world(rank, world)
    if not 0 <= step < world:
        raise ValueError(f"step is {step}; expected 0 <= step < world = {world}")
    if banded(causal, window_size):
        left, right = check_window(window_size)
        if local_seqlen % 2:
            raise ValueError(f"local_seqlen is {local_seqlen}; zigzag shards hold two equal chunks")
        half = local_seqlen // 2
        source = source_rank(rank, world, step)
        blocks = []
        for q_row, q_chunk in enumerate((rank, 2 * world - 1 - rank)):
            for k_row, k_chunk in enumerate((source, 2 * world - 1 - source)):
                block = _band_block(half, (q_chunk - k_chunk) * half, left, 0 if causal else right)
                if block is not None:
                    q0, q1, k0, k1, window = block
                    blocks.append(RingBlock(q_row * half + q0, q_row * half + q1, k_row * half + k0, k_row * half + k1,
                                            False, window))
        return blocks
    if not causal:
        return [RingBlock(0, local_seqlen, 0, local_seqlen, False)]
    if local_seqlen % 2:
        raise ValueError(f"local_seqlen is {local_seqlen}; zigzag shards hold two equal chunks")
    half = local_seqlen // 2
    source = source_rank(rank, world, step)
    if source == rank:
        return [RingBlock(0, local_seqlen, 0, local_seqlen, True)]
    if source < rank:   # its first chunk precedes both of ours; its second follows both
        return [RingBlock(0, local_seqlen, 0, half, False)]
    return [RingBlock(half, local_seqlen, 0, local_seqlen, False)]   # both of its chunks precede our second


def banded(causal: bool, window_size) -> bool:
    """Whether ``window_size`` bounds a ring call beyond its causal mask: ring_blocks then runs a
    call per pair of chunks the band reaches."""
    left, right = check_window(window_size)
    return left >= 0 or (right >= 0 and not causal)


def _band_block(size: int, offset: int, left: int, right: int):
    """A chunk of ``size`` queries starting ``offset`` rows after a chunk of ``size`` keys, under the
    band key - query in [-left, right] (-1: unbounded): None where no pair is visible, the whole
    chunk pair (window None) where all are, else (q0, q1, k0, k1, (left, right)): the rows and keys
    with a visible pair, and the window that flash_forward's bottom-right alignment gives them."""
    lo = -math.inf if left < 0 else offset - left     # key - query (local) in [lo, hi]
    hi = math.inf if right < 0 else offset + right
    if lo > size - 1 or hi < -(size - 1):
        return None
    if lo <= -(size - 1) and hi >= size - 1:
        return 0, size, 0, size, None
    q0 = max(0, -hi) if hi < math.inf else 0          # queries before it see no key
    k0 = max(0, q0 + lo) if lo > -math.inf else 0     # keys before every query's band
    k1 = min(size, size + hi) if hi < math.inf else size
    q1 = min(size, k1 - lo) if lo > -math.inf else size
    n, m, shift = q1 - q0, k1 - k0, (k1 - k0) - (q1 - q0)
    lo, hi = lo + q0 - k0, hi + q0 - k0               # the band in the cropped block's rows
    window = (-1 if lo == -math.inf else int(shift - lo), -1 if hi == math.inf else int(hi - shift))
    assert n > 0 and m > 0 and window[0] >= -1 and window[1] >= -1
    return q0, q1, k0, k1, window


def chunk_visibility(rank: int, world: int, step: int, causal: bool) -> numpy.ndarray:
    """(2, 2) of 'full' / 'diag' / 'skip': how query chunk i of ``rank`` sees key chunk j of the shard
    it holds at ``step``, from the global chunk order (the definition ring_blocks must cover)."""
    source = source_rank(rank, world, step)
    mine = (rank, 2 * world - 1 - rank)
    theirs = (source, 2 * world - 1 - source)
    out = numpy.empty((2, 2), dtype=object)
    for i, qc in enumerate(mine):
        for j, kc in enumerate(theirs):
            out[i, j] = "full" if not causal or kc < qc else ("diag" if kc == qc else "skip")
    return out


# ---------------------------------------------------------------------------------------------
# Per-rank state: the merge of partial outputs, and the gradient pieces of each step.

def _flash_backend(softcap: float = 0.0):
    """(forward, backward) of one block on the flash kernels; ``softcap`` applies to every block's
    logits as to one call's (the sink joins once, in _ForwardRank.result)."""
    from .backward import flash_backward
    from .forward import flash_forward

    def forward(q, k, v, causal, scale, window):
        return flash_forward(q, k, v, causal=causal, softmax_scale=scale, softcap=softcap, window_size=window)

    def backward(do, q, k, v, o, lse, causal, scale, window):
        return flash_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=scale, softcap=softcap,
                              window_size=window)
    return forward, backward


def _flash_packed_backend(softcap: float, cu_half, max_half: int):
    """(forward, backward) of one block of packed halves (rows of (1, rows, heads, d) views) on the
    flash kernels' packed path, every sequence of the block a chunk of ``max_half`` rows at most
    with the offsets ``cu_half`` (int32 on the GPU). lse travels as (1, heads, rows)."""
    from .backward import flash_backward
    from .forward import flash_forward

    # softcap only where it is on: a call whose keywords are the offsets alone keeps its plan
    # (known_prefix_sums; ~20 us of host time a call against ~0.5-1 ms checked)
    packed = dict(cu_seqlens_q=cu_half, cu_seqlens_k=cu_half, max_seqlen_q=max_half, max_seqlen_k=max_half,
                  **({"softcap": softcap} if softcap else {}))

    def forward(q, k, v, causal, scale, window):
        o, lse = flash_forward(q[0], k[0], v[0], causal=causal, softmax_scale=scale, **packed)
        return o[None], lse[None]

    def backward(do, q, k, v, o, lse, causal, scale, window):
        grads = flash_backward(do[0], q[0], k[0], v[0], o[0], lse[0], causal=causal, softmax_scale=scale, **packed)
        return tuple(g[None] for g in grads)
    return forward, backward


def _per_sequence_backend(backend, cu_half: numpy.ndarray):
    """A dense (forward, backward) run on each sequence of a block of packed halves in turn (the
    CPU tests' float64 backend), with the flash packed backend's contract."""
    forward, backward = backend
    bounds = [(a, b) for a, b in zip(cu_half[:-1].tolist(), cu_half[1:].tolist()) if b > a]   # empty ones: no rows

    def each(x, start, stop, axis=1):
        return x[(slice(None),) * axis + (slice(start, stop),)]

    def packed_forward(q, k, v, causal, scale, window):
        xp = _xp(q)
        parts = [forward(each(q, a, b), each(k, a, b), each(v, a, b), causal, scale, window) for a, b in bounds]
        return xp.concatenate([o for o, _ in parts], axis=1), xp.concatenate([lse for _, lse in parts], axis=2)

    def packed_backward(do, q, k, v, o, lse, causal, scale, window):
        xp = _xp(q)
        parts = [backward(each(do, a, b), each(q, a, b), each(k, a, b), each(v, a, b), each(o, a, b), each(lse, a, b, 2),
                          causal, scale, window) for a, b in bounds]
        return tuple(xp.concatenate([p[i] for p in parts], axis=1) for i in range(3))
    return packed_forward, packed_backward


def _rows(x, start, stop):
    return x[:, start:stop]


class _ForwardRank:
    """One rank's running (o, lse) over the K/V shards attended so far (float32)."""

    def __init__(self, q, rank, world, causal, scale, backend, head_dim_v, window_size, schedule=None):
        self.q, self.rank, self.world, self.causal, self.scale, self.backend = q, rank, world, causal, scale, backend
        self.head_dim_v = head_dim_v
        self.schedule = schedule or (lambda step: ring_blocks(rank, world, step, causal, q.shape[1], window_size))
        self.o = self.lse = None   # from the first block where it covers every row (step 0's does)

    def _start(self):
        xp = _xp(self.q)
        batch, seqlen, heads, _ = self.q.shape
        self.o = xp.zeros((batch, seqlen, heads, self.head_dim_v), dtype=xp.float32)   # v's head_dim
        self.lse = xp.full((batch, heads, seqlen), -numpy.inf, dtype=xp.float32)

    def attend(self, step, k, v):
        for block in self.schedule(step):
            o, lse = self.backend[0](_rows(self.q, block.q_start, block.q_stop), _rows(k, block.k_start, block.k_stop),
                                     _rows(v, block.k_start, block.k_stop), block.causal, self.scale, block.window)
            self.add_block(o, lse, block.q_start, block.q_stop)

    def add_block(self, o, lse, q_start, q_stop):
        """Joins a block's partial (o, lse) over rows [q_start, q_stop) into the running (o, lse)."""
        xp = _xp(self.q)
        if self.o is None and (q_start, q_stop) == (0, self.q.shape[1]):
            self.o, self.lse = xp.ascontiguousarray(o, dtype=xp.float32), xp.ascontiguousarray(lse, dtype=xp.float32)
            return
        if self.o is None:
            self._start()
        _merge_rows(self.o, self.lse, o, lse, q_start, q_stop)

    def result(self, sink=None):
        """(o, lse) over every shard; ``sink`` (heads,) float32 joins each row's softmax once, as a
        logit with no value (a row that saw no key then has lse = the sink and o = 0)."""
        if self.o is None:
            self._start()
        if sink is not None:
            xp = _xp(self.o)
            joined = xp.logaddexp(self.lse, sink.astype(xp.float32)[None, :, None])
            self.o *= xp.where(xp.isfinite(self.lse), xp.exp(self.lse - joined), 0).transpose(0, 2, 1)[..., None]
            self.lse = joined
        return self.o.astype(self.q.dtype), self.lse


def _merge_rows(o_acc, lse_acc, o, lse, start, stop):
    """(o_acc, lse_acc)[rows] <- the exact merge with the partial (o, lse) over other keys. A side
    whose lse is -inf (no key) weighs 0; a row no side saw stays o = 0, lse = -inf."""
    xp = _xp(o_acc)
    if xp is not numpy:   # one kernel pass (preprocess.cu) where the array operations below take six
        from .families.rows import ring_merge
        ring_merge(o_acc, lse_acc, xp.ascontiguousarray(o), xp.ascontiguousarray(lse, dtype=xp.float32), start)
        return
    old = lse_acc[:, :, start:stop]
    lse = lse.astype(xp.float32)
    new = xp.logaddexp(old, lse)
    seen = xp.isfinite(new)
    safe = xp.where(seen, new, 0)
    w_old = xp.where(seen, xp.exp(old - safe), 0).transpose(0, 2, 1)[..., None]
    w_new = xp.where(seen, xp.exp(lse - safe), 0).transpose(0, 2, 1)[..., None]
    o_acc[:, start:stop] = o_acc[:, start:stop] * w_old + o.astype(xp.float32) * w_new
    lse_acc[:, :, start:stop] = new


class _BackwardRank:
    """One rank's dQ (float32) and the dK/dV pieces of the K/V shard in hand at each step."""

    def __init__(self, do, q, o, lse, rank, world, causal, scale, backend, window_size, schedule=None):
        self.do, self.q, self.o, self.lse = do, q, o, lse
        self.rank, self.world, self.causal, self.scale, self.backend = rank, world, causal, scale, backend
        self.schedule = schedule or (lambda step: ring_blocks(rank, world, step, causal, q.shape[1], window_size))
        self.dq = None   # from the first block where it covers every row (step 0's does)

    def gradients(self, step, k, v):
        """Adds this step's dQ rows into dq; returns its dK/dV pieces [(k_start, k_stop, dk, dv)], to
        be added into the travelling accumulators once they arrive (their shift overlaps this)."""
        xp = _xp(self.q)
        pieces = []
        for b in self.schedule(step):
            # lse's rows as a contiguous copy: a strided view would be copied inside the call, which
            # then takes the checked route every time instead of its kept plan
            dq, dk, dv = self.backend[1](_rows(self.do, b.q_start, b.q_stop), _rows(self.q, b.q_start, b.q_stop),
                                         _rows(k, b.k_start, b.k_stop), _rows(v, b.k_start, b.k_stop),
                                         _rows(self.o, b.q_start, b.q_stop),
                                         xp.ascontiguousarray(self.lse[:, :, b.q_start:b.q_stop]),
                                         b.causal, self.scale, b.window)
            if self.dq is None and (b.q_start, b.q_stop) == (0, self.q.shape[1]):
                self.dq = xp.ascontiguousarray(dq, dtype=xp.float32)
            else:
                if self.dq is None:
                    self.dq = xp.zeros(self.q.shape, dtype=xp.float32)
                _accumulate_rows(self.dq, dq, b.q_start)
            pieces.append((b.k_start, b.k_stop, dk, dv))
        return pieces


def _accumulate_rows(acc, x, start):
    """acc[:, start:start + n] += x in float32 (acc float32, x of n rows)."""
    xp = _xp(acc)
    if xp is numpy:
        acc[:, start:start + x.shape[1]] += x.astype(xp.float32)
    else:   # one kernel pass (preprocess.cu), where a cast and a strided add took three
        from .families.rows import ring_accumulate
        ring_accumulate(acc, xp.ascontiguousarray(x), start)


def _accumulators(k, v, pieces):
    """Float32 (dK, dV) accumulators of a K/V shard holding the sum of its ``pieces``: the first
    piece itself where it covers the whole shard (step 0's does), else zeros."""
    xp = _xp(k)
    if pieces and (pieces[0][0], pieces[0][1]) == (0, k.shape[1]):
        dk_acc, dv_acc = (xp.ascontiguousarray(x, dtype=xp.float32) for x in pieces[0][2:])
        pieces = pieces[1:]
    else:
        dk_acc, dv_acc = xp.zeros(k.shape, xp.float32), xp.zeros(v.shape, xp.float32)
    _add_pieces(dk_acc, dv_acc, pieces)
    return dk_acc, dv_acc


def _add_pieces(dk_acc, dv_acc, pieces):
    for start, _, dk, dv in pieces:
        _accumulate_rows(dk_acc, dk, start)
        _accumulate_rows(dv_acc, dv, start)


# ---------------------------------------------------------------------------------------------
# Transports: shift(payloads) moves each local rank's payload (a tuple of arrays) to the next rank.

class LoopbackRing:
    """P virtual ranks in one process: a shift is a rotation (rank r receives rank r - 1's payload,
    or r + 1's with ``reverse``: the same arrays, no copy). The schedule is the NCCL ring's; only
    the transport differs."""

    def __init__(self, world: int):
        _check_world(0, world)
        self.world = world
        self.ranks = tuple(range(world))

    def start_shift(self, payloads, reverse=False):
        return [payloads[(r + (1 if reverse else -1)) % self.world] for r in range(self.world)]

    def finish_shift(self, handle):
        return handle

    def all_to_all(self, payloads):
        """payloads[r][j]: what rank r sends rank j; returns received[r][j], what rank r got from j."""
        return [[payloads[j][r] for j in range(self.world)] for r in range(self.world)]


class NcclRing:
    """This process's rank of a ring of ``world`` GPUs over NCCL (``cupy.cuda.nccl``; one process per
    GPU). Shifts run on a stream of their own: ``start_shift`` waits for the work queued so far on
    the current stream, sends this rank's payload to rank + 1 and receives rank - 1's into new
    arrays (with ``reverse``, to rank - 1 from rank + 1); ``finish_shift`` makes the current stream
    wait for them. ``communicator`` is a ``cupy.cuda.nccl.NcclCommunicator`` (``NcclRing.create``
    makes one from an id shared by the launcher, e.g. through mpi4py)."""

    def __init__(self, communicator, rank: int, world: int):
        _check_world(rank, world)
        import cupy

        self.communicator, self.rank, self.world = communicator, rank, world
        self.ranks = (rank,)
        self.stream = cupy.cuda.Stream(non_blocking=True)

    @classmethod
    def create(cls, rank: int, world: int, unique_id=None, broadcast=None):
        """A ring over all ``world`` ranks: rank 0 makes the NCCL id and ``broadcast(id)`` (e.g.
        ``mpi4py.MPI.COMM_WORLD.bcast``) hands it to every rank; or give ``unique_id``."""
        from cupy.cuda import nccl

        if unique_id is None:
            unique_id = nccl.get_unique_id() if rank == 0 else None
            if broadcast is None:
                raise ValueError("broadcast is missing: the ranks must share rank 0's NCCL id (or pass unique_id)")
            unique_id = broadcast(unique_id)
        return cls(nccl.NcclCommunicator(world, unique_id, rank), rank, world)

    @classmethod
    def from_environment(cls, timeout: float = 300.0, group_size: int | None = None):
        """A ring over every rank of the job that started this process, from its launcher's
        environment (torchrun, ``python -m cupy_flash launch``, mpirun, srun: see
        ``_rendezvous``): the current device becomes the local rank's GPU (modulo the GPUs
        visible), and rank 0's NCCL id reaches the other ranks over TCP (MASTER_ADDR, port
        CUPY_FLASH_PORT or MASTER_PORT + 1), without MPI or PyTorch; under mpirun with no
        MASTER_ADDR set, through mpi4py's broadcast where it imports (hosts need not share an
        address then). A process started alone is a ring of one.

        ``group_size`` U (dividing the world): instead (within, across) for the hybrid mode:
        ``within`` over the U ranks of this rank's group (ranks g U ... g U + U - 1), ``across``
        over the world / U ranks that share this rank's place u in their groups."""
        import cupy

        place = launch_environment()
        cupy.cuda.Device(place.local_rank % cupy.cuda.runtime.getDeviceCount()).use()
        if group_size is None:
            (unique_id,) = _shared_nccl_ids(place, 1, timeout)
            return cls.create(place.rank, place.world, unique_id=unique_id)
        groups = _check_group_size(group_size, place.world)
        g, u = divmod(place.rank, group_size)
        ids = _shared_nccl_ids(place, groups + group_size, timeout)
        within = cls.create(u, group_size, unique_id=ids[g])
        return within, cls.create(g, groups, unique_id=ids[groups + u])

    def start_shift(self, payloads, reverse=False):
        import cupy
        from cupy.cuda import nccl

        (payload,) = payloads
        ready = cupy.cuda.get_current_stream().record()
        self.stream.wait_event(ready)
        received = tuple(cupy.empty_like(x) for x in payload)
        following, preceding = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        if reverse:
            following, preceding = preceding, following
        nccl.groupStart()
        for sent, into in zip(payload, received):
            # Bytes: NCCL has no bfloat16 for every CuPy build; the arrays are contiguous.
            self.communicator.send(sent.data.ptr, sent.nbytes, nccl.NCCL_UINT8, following, self.stream.ptr)
            self.communicator.recv(into.data.ptr, into.nbytes, nccl.NCCL_UINT8, preceding, self.stream.ptr)
        nccl.groupEnd()
        # The sent arrays stay referenced until finish_shift, after which the current stream has
        # waited for the shift: their memory is reused only behind it.
        return received, payload, self.stream.record()

    def finish_shift(self, handle):
        import cupy

        received, _sent, done = handle
        cupy.cuda.get_current_stream().wait_event(done)
        return [received]

    def all_to_all(self, payloads):
        """``payloads`` = [chunks]: chunks[j] (C-contiguous) goes to rank j, and what rank j sends
        this rank arrives in a new array of chunks[j]'s shape (every rank sends equal chunks); on the
        current stream, in one NCCL group. Returns [received]."""
        import cupy
        from cupy.cuda import nccl

        (chunks,) = payloads
        stream = cupy.cuda.get_current_stream().ptr
        received = [cupy.empty_like(x) for x in chunks]
        nccl.groupStart()
        for peer, (sent, into) in enumerate(zip(chunks, received)):
            self.communicator.send(sent.data.ptr, sent.nbytes, nccl.NCCL_UINT8, peer, stream)
            self.communicator.recv(into.data.ptr, into.nbytes, nccl.NCCL_UINT8, peer, stream)
        nccl.groupEnd()
        return [received]


def _check_group_size(group_size, world: int) -> int:
    """The number of groups, or ValueError: ``group_size`` must be a positive int dividing world."""
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size < 1 \
            or world % group_size:
        raise ValueError(f"group_size is {group_size!r}; expected a positive integer dividing the {world} ranks")
    return world // int(group_size)


def _shared_nccl_ids(place, count: int, timeout: float) -> list:
    """``count`` NCCL ids made by rank 0, on every rank: by mpi4py's broadcast under mpirun without
    MASTER_ADDR (where it imports), else over TCP (_rendezvous.share_from_rank0)."""
    import os

    from cupy.cuda import nccl

    from . import _rendezvous

    def made():   # the ids as JSON: CuPy 14's are bytes, older ones' tuples of ints
        ids = [nccl.get_unique_id() for _ in range(count)]
        return [{"bytes": isinstance(x, bytes), "values": list(x)} for x in ids]

    broadcast = _mpi_broadcast(place.world) if place.source in ("OMPI_COMM_WORLD_RANK", "PMI_RANK") \
        and "MASTER_ADDR" not in os.environ else None
    if broadcast is not None:
        shared = broadcast(made() if place.rank == 0 else None)
    else:
        shared = _rendezvous.share_from_rank0(place, made, _rendezvous.rendezvous_address(), _rendezvous.job_id(),
                                              timeout)
    return [bytes(x["values"]) if x["bytes"] else tuple(x["values"]) for x in shared]


def _mpi_broadcast(world: int):
    """mpi4py's broadcast from rank 0 over COMM_WORLD where mpi4py imports and its world is
    ``world``, else None."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    return (lambda value: comm.bcast(value, root=0)) if comm.Get_size() == world else None


# ---------------------------------------------------------------------------------------------
# The ring.

def _check_ring_variant(softcap, sink, like, backend, window_size=None) -> tuple:
    """(softcap as flash_forward checks it, sink as float32 (heads,) where ``like`` (a q shard) lives);
    window_size checked as flash_forward checks it."""
    from ._features import _check_float_array, check_softcap

    check_window(window_size)
    softcap = check_softcap(softcap)
    if sink is not None:
        _check_float_array("sink", sink, [(like.shape[2],)], "(heads_q,)")
        sink = _xp(like).asarray(sink, dtype=numpy.float32)
    if backend is not None and softcap:
        raise ValueError("softcap takes the flash backend")
    return softcap, sink


def _check_shards(name, shards, world, like=None):
    if len(shards) != world:
        raise ValueError(f"{name} has {len(shards)} shards; the ring has {world} ranks")
    for r, x in enumerate(shards):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name}[{r}] must have 4 dimensions (batch, local_seqlen, heads, head_dim), "
                             f"got shape {tuple(getattr(x, 'shape', ()))}")
        if like is not None and x.shape[:2] != like[r].shape[:2]:
            raise ValueError(f"{name}[{r}] has shape {tuple(x.shape)}; its batch and local_seqlen must match "
                             f"q[{r}]'s {tuple(like[r].shape)}")
        if x.shape != shards[0].shape:
            raise ValueError(f"{name}[{r}] has shape {tuple(x.shape)} but {name}[0] has {tuple(shards[0].shape)}; "
                             "every rank holds an equal shard")


def _run_forward(ring, qs, ks, vs, causal, softmax_scale, backend, sink=None, window_size=None, schedule=None):
    """Each rank's (o, lse). ``schedule``: (rank, step) -> the rank's blocks at the step (packed
    shards'); None: ring_blocks."""
    world = ring.world
    _check_shards("q", qs, len(ring.ranks))
    _check_shards("k", ks, len(ring.ranks), like=qs)
    _check_shards("v", vs, len(ring.ranks), like=qs)
    if causal and qs[0].shape[1] % 2:
        raise ValueError(f"q has local_seqlen {qs[0].shape[1]}; causal zigzag shards hold two equal chunks")
    scale = check_softmax_scale(softmax_scale, qs[0].shape[3])
    left = halo_window(causal, window_size, qs[0].shape[1]) if schedule is None else None
    if left is not None:
        return _halo_forward(ring, qs, ks, vs, scale, backend, left, sink)
    ranks = [_ForwardRank(q, r, world, causal, scale, backend, vs[0].shape[3], window_size,
                          schedule and (lambda step, r=r: schedule(r, step))) for q, r in zip(qs, ring.ranks)]
    payloads = [(k, v) for k, v in zip(ks, vs)]
    for step in range(world):
        handle = ring.start_shift(payloads) if step < world - 1 else None
        for rank, (k, v) in zip(ranks, payloads):
            rank.attend(step, k, v)
        if handle is not None:
            payloads = ring.finish_shift(handle)
    return [rank.result(sink) for rank in ranks]


def _run_backward(ring, dos, qs, ks, vs, os_, lses, causal, softmax_scale, backend, sink=None, window_size=None,
                  schedule=None):
    world = ring.world
    for name, shards in (("do", dos), ("q", qs), ("k", ks), ("v", vs), ("o", os_)):
        _check_shards(name, shards, len(ring.ranks), like=qs)
    for r, (q, lse) in enumerate(zip(qs, lses)):
        want = (q.shape[0], q.shape[2], q.shape[1])
        if tuple(lse.shape) != want:
            raise ValueError(f"lse[{r}] has shape {tuple(lse.shape)}; expected (batch, heads, local_seqlen) = {want}")
    scale = check_softmax_scale(softmax_scale, qs[0].shape[3])
    left = halo_window(causal, window_size, qs[0].shape[1]) if schedule is None else None
    if left is not None:
        return _halo_backward(ring, dos, qs, ks, vs, os_, lses, scale, backend, left, sink)
    ranks = [_BackwardRank(do, q, o, lse, r, world, causal, scale, backend, window_size,
                           schedule and (lambda step, r=r: schedule(r, step)))
             for do, q, o, lse, r in zip(dos, qs, os_, lses, ring.ranks)]
    payloads = [(k, v) for k, v in zip(ks, vs)]
    done = None   # each rank's accumulators with its part added: they travel with the next shift
    for step in range(world):
        # One shift a step, under its products: the next step's K/V, and the accumulators completed
        # at the step before (one NCCL group, where two shifts queued on one stream took longer).
        parts = [(kv if step < world - 1 else ()) + (acc if done is not None else ())
                 for kv, acc in zip(payloads, done or [()] * len(payloads))]
        handle = ring.start_shift(parts) if parts[0] else None
        pieces = [rank.gradients(step, k, v) for rank, (k, v) in zip(ranks, payloads)]
        arrived = ring.finish_shift(handle) if handle is not None else None
        if done is None:   # step 0: each rank starts the accumulators of its own K/V
            done = [_accumulators(k, v, own) for (k, v), own in zip(payloads, pieces)]
        else:              # those of the K/V in hand, from the rank before, who added its part
            done = [tuple(received[-2:]) for received in arrived]
            for (dk, dv), own in zip(done, pieces):
                _add_pieces(dk, dv, own)
        if step < world - 1:
            payloads = [tuple(received[:2]) for received in arrived]
    # P shifts of the accumulators in all: the last brings them home, cast first (half the bytes).
    accumulators = ring.finish_shift(ring.start_shift([(dk.astype(k.dtype), dv.astype(v.dtype))
                                                       for (dk, dv), (k, v) in zip(done, payloads)]))
    grads = [(rank.dq.astype(q.dtype), dk, dv) for rank, q, (dk, dv) in zip(ranks, qs, accumulators)]
    if sink is None:
        return grads
    return [g + (_sink_gradient(do, o, lse, sink),) for g, do, o, lse in zip(grads, dos, os_, lses)]


# ---------------------------------------------------------------------------------------------
# Sliding windows with no keys ahead that reach at most one chunk back: halos instead of the ring.

def halo_window(causal: bool, window_size, local_seqlen: int) -> int | None:
    """The left size W of a window with no keys ahead (causal, or right 0) that reaches at most one
    zigzag chunk back (W <= local_seqlen / 2), else None. Each chunk then sees its own keys and the
    last W of the chunk before it, which a neighbouring rank hands over: two shifts of W rows
    instead of the ring's P - 1 shifts of whole shards, and one call per chunk."""
    left, right = check_window(window_size)
    if (causal or right == 0) and 0 <= left <= local_seqlen // 2 and local_seqlen % 2 == 0:
        return left
    return None


def _halos(ring, ks, vs, left):
    """Per local rank, the K/V rows within ``left`` before each of its two chunks: (first chunk's
    halo or None for chunk 0, second chunk's halo), each a (k, v) pair of ``left`` rows."""
    if left == 0:
        return [(None, None)] * len(ks)
    half, world = ks[0].shape[1] // 2, ring.world
    tails = [[tuple(_xp(x).ascontiguousarray(x[:, stop - left:stop]) for x in (k, v)) for k, v in zip(ks, vs)]
             for stop in (half, 2 * half)]
    before, after = tails
    if world > 1:   # chunk r - 1's tail from rank r - 1; chunk 2P - 2 - r's (rank r + 1's second chunk) from rank r + 1
        handles = ring.start_shift(tails[0]), ring.start_shift(tails[1], reverse=True)
        before, after = (ring.finish_shift(h) for h in handles)
    # rank P - 1's second chunk (P) follows its own first (P - 1)
    return [(before[i] if r > 0 else None, after[i] if r < world - 1 else tails[0][i]) for i, r in enumerate(ring.ranks)]


def _with_halo(halo, k, v, start, count):
    """K and V rows [start, start + count), after the halo's rows where there is one."""
    own = (_rows(k, start, start + count), _rows(v, start, start + count))
    if halo is None:
        return own
    return tuple(_xp(k).concatenate([h, x], axis=1) for h, x in zip(halo, own))


def _halo_forward(ring, qs, ks, vs, scale, backend, left, sink):
    half = qs[0].shape[1] // 2
    results = []
    for q, k, v, halos, r in zip(qs, ks, vs, _halos(ring, ks, vs, left), ring.ranks):
        rank = _ForwardRank(q, r, ring.world, True, scale, backend, v.shape[3], None)
        for start, halo in zip((0, half), halos):
            # the halo's left rows first: keys sit `left` rows before their queries' diagonal
            o, lse = backend[0](_rows(q, start, start + half), *_with_halo(halo, k, v, start, half), False, scale, (left, 0))
            rank.add_block(o, lse, start, start + half)
        results.append(rank.result(sink))
    return results


def _halo_backward(ring, dos, qs, ks, vs, os_, lses, scale, backend, left, sink):
    xp, half, world = _xp(qs[0]), qs[0].shape[1] // 2, ring.world
    grads, home = [], ([], [])   # the halos' dK / dV rows, to send to their chunks' ranks
    for do, q, k, v, o, lse, halos, r in zip(dos, qs, ks, vs, os_, lses, _halos(ring, ks, vs, left), ring.ranks):
        dk, dv = xp.zeros(k.shape, xp.float32), xp.zeros(v.shape, xp.float32)
        dq = []
        for side, (start, halo) in enumerate(zip((0, half), halos)):
            rows = start, start + half
            dq_part, dk_part, dv_part = backend[1](_rows(do, *rows), _rows(q, *rows), *_with_halo(halo, k, v, start, half),
                                                   _rows(o, *rows), lse[:, :, start:start + half], False, scale, (left, 0))
            dq.append(dq_part)
            n = 0 if halo is None else left
            _accumulate_rows(dk, dk_part[:, n:], start)
            _accumulate_rows(dv, dv_part[:, n:], start)
            piece = (dk_part[:, :n], dv_part[:, :n])
            if halo is not None and side == 1 and r == world - 1:   # its own first chunk's tail
                _accumulate_rows(dk, piece[0], half - left)
                _accumulate_rows(dv, piece[1], half - left)
            if halo is None or (side == 1 and r == world - 1):
                piece = (xp.zeros((k.shape[0], left) + k.shape[2:], k.dtype), xp.zeros((v.shape[0], left) + v.shape[2:], v.dtype))
            home[side].append(tuple(xp.ascontiguousarray(x) for x in piece))
        grads.append([xp.concatenate(dq, axis=1), dk, dv])
    if left > 0 and world > 1:   # first chunks' halos to rank r - 1, second chunks' to rank r + 1
        handles = ring.start_shift(home[0], reverse=True), ring.start_shift(home[1])
        from_after, from_before = (ring.finish_shift(h) for h in handles)
        for i, r in enumerate(ring.ranks):
            _, dk, dv = grads[i]
            if r < world - 1:   # rank r + 1's first chunk saw our first chunk's tail
                _accumulate_rows(dk, from_after[i][0], half - left)
                _accumulate_rows(dv, from_after[i][1], half - left)
            if r > 0:           # rank r - 1's second chunk saw our second chunk's tail
                _accumulate_rows(dk, from_before[i][0], 2 * half - left)
                _accumulate_rows(dv, from_before[i][1], 2 * half - left)
    out = [(dq, dk.astype(k.dtype), dv.astype(v.dtype)) for (dq, dk, dv), k, v in zip(grads, ks, vs)]
    if sink is None:
        return out
    return [g + (_sink_gradient(do, o, lse, sink),) for g, do, o, lse in zip(out, dos, os_, lses)]


def _sink_gradient(do, o, lse, sink):
    """d loss / d sink of one rank's rows: -sum over them of P(sink) * rowsum(dO * O), P(sink) =
    exp(sink - lse) with lse the forward's (the sink joined). The blocks' backward reads the sink
    through lse alone; the ranks' parts add up to the gradient."""
    xp = _xp(o)
    delta = (do.astype(xp.float32) * o.astype(xp.float32)).sum(axis=3).transpose(0, 2, 1)   # (batch, heads, rows)
    p_sink = xp.exp(sink.astype(xp.float32)[None, :, None] - lse)
    return -(p_sink * delta).sum(axis=(0, 2))


def _packed_ring(cu_seqlens, world: int, q_shards, causal: bool, backend, softcap: float, window_size):
    """(backend, schedule, context) of a ring over packed shards (``cu_seqlens``: the whole batch's),
    after the checks: q shards of 2 x local_cu_seqlens[-1] rows, no window. The ring runs inside
    ``context``, where the flash calls check the halves' offsets from their host copy."""
    if check_window(window_size) != (-1, -1):
        raise ValueError("window_size is not supported with cu_seqlens on the ring: a window would crop each "
                         "sequence's chunks differently")
    cu_half = local_cu_seqlens(cu_seqlens, world)
    rows = 2 * int(cu_half[-1])
    if not rows:
        raise ValueError("cu_seqlens: the batch has no tokens")
    for r, q in enumerate(q_shards):
        if getattr(q, "ndim", None) != 3 or q.shape[0] != rows:
            raise ValueError(f"q[{r}] has shape {tuple(getattr(q, 'shape', ()))}; with cu_seqlens a rank's shard is "
                             f"(2 x {int(cu_half[-1])} = {rows} rows, heads, head_dim): zigzag_shard_packed")
    def schedule(rank, step):
        return packed_ring_blocks(rank, world, step, causal, rows)

    if backend is not None:
        return _per_sequence_backend(backend, cu_half), schedule, contextlib.nullcontext()
    from ._checks import known_prefix_sums

    on_device = _device_offsets(cu_half)
    return (_flash_packed_backend(softcap, on_device, int(numpy.diff(cu_half).max())), schedule,
            known_prefix_sums(on_device, cu_half))


_offsets_on_devices: dict = {}   # (device, offsets' bytes) -> the int32 array on that device


def _device_offsets(cu_half: numpy.ndarray):
    """``cu_half`` on the current device, one array per (device, offsets) and never written: the
    packed calls' kept plans (keyed by its id) serve every ring call with the same lengths."""
    import cupy

    from ._launch import cached

    key = (cupy.cuda.runtime.getDevice(), cu_half.tobytes())
    return cached(_offsets_on_devices, key, lambda: cupy.asarray(cu_half), limit=64)


def _dense_like(qs, cu_seqlens):
    """A q shard as the variant checks read it (batch, rows, heads, d): a packed one with a batch of 1."""
    packed = cu_seqlens is not None and getattr(qs[0], "ndim", None) == 3
    return qs[0][None] if packed else qs[0]


def _forward(ring, qs, ks, vs, causal, softmax_scale, softcap, sink, window_size, cu_seqlens, backend):
    """_run_forward, on dense or (``cu_seqlens``) packed shards: each rank's (o, lse)."""
    softcap, sink = _check_ring_variant(softcap, sink, _dense_like(qs, cu_seqlens), backend, window_size) if qs \
        else (softcap, sink)
    if cu_seqlens is None:
        return _run_forward(ring, qs, ks, vs, causal, softmax_scale, backend or _flash_backend(softcap), sink,
                            window_size)
    backend, schedule, context = _packed_ring(cu_seqlens, ring.world, qs, causal, backend, softcap, window_size)
    with context:
        outs = _run_forward(ring, [q[None] for q in qs], [k[None] for k in ks], [v[None] for v in vs], causal,
                            softmax_scale, backend, sink, None, schedule)
    return [(o[0], lse[0]) for o, lse in outs]


def _backward(ring, dos, qs, ks, vs, os_, lses, causal, softmax_scale, softcap, sink, window_size, cu_seqlens,
              backend):
    """_run_backward, on dense or (``cu_seqlens``) packed shards: each rank's gradients."""
    softcap, sink = _check_ring_variant(softcap, sink, _dense_like(qs, cu_seqlens), backend, window_size) if qs \
        else (softcap, sink)
    if cu_seqlens is None:
        return _run_backward(ring, dos, qs, ks, vs, os_, lses, causal, softmax_scale, backend or _flash_backend(softcap),
                             sink, window_size)
    backend, schedule, context = _packed_ring(cu_seqlens, ring.world, qs, causal, backend, softcap, window_size)
    views = [[x[None] for x in shards] for shards in (dos, qs, ks, vs, os_, lses)]
    with context:
        grads = _run_backward(ring, *views, causal, softmax_scale, backend, sink, None, schedule)
    return [tuple(g[0] for g in rank[:3]) + tuple(rank[3:]) for rank in grads]


def simulate_ring_forward(qs, ks, vs, *, causal=False, softmax_scale=None, softcap=0.0, sink=None, window_size=None,
                          cu_seqlens=None, _backend=None):
    """The ring forward over ``len(qs)`` virtual ranks in this process (``LoopbackRing``): qs[r],
    ks[r], vs[r] are rank r's zigzag shards (``zigzag_shard``); returns [(o_r, lse_r)], each rank's
    output shard (dtype of q) and float32 lse (batch, heads, local_seqlen). ``softcap``, ``sink`` and
    ``window_size`` as flash_forward's over the whole sequence (the sink joins each row's softmax
    once, after the shards' merge; a step whose shard the window does not reach computes nothing).
    ``cu_seqlens``: the shards are a packed batch's (``zigzag_shard_packed`` of (total, heads, d)
    arrays with the whole batch's prefix sums, each length a multiple of 2 x ranks); lse_r is then
    (heads, local rows). Not with window_size."""
    return _forward(LoopbackRing(len(qs)), list(qs), list(ks), list(vs), causal, softmax_scale, softcap, sink,
                    window_size, cu_seqlens, _backend)


def simulate_ring_backward(dos, qs, ks, vs, os_, lses, *, causal=False, softmax_scale=None, softcap=0.0, sink=None,
                           window_size=None, cu_seqlens=None, _backend=None):
    """The ring backward over virtual ranks (see ``simulate_ring_forward``): os_ and lses are the
    forward's per-rank results; returns [(dq_r, dk_r, dv_r)] in the rank's shards, with the sink
    [(dq_r, dk_r, dv_r, dsink_r)]: dsink_r of rank r's rows (their sum is the sink's gradient)."""
    return _backward(LoopbackRing(len(qs)), list(dos), list(qs), list(ks), list(vs), list(os_), list(lses), causal,
                     softmax_scale, softcap, sink, window_size, cu_seqlens, _backend)


def ring_attention_forward(q, k, v, *, ring, causal=False, softmax_scale=None, softcap=0.0, sink=None,
                           window_size=None, cu_seqlens=None):
    """This rank's (o, lse) of attention over the whole sequence, q, k, v being its zigzag shards
    and ``ring`` its ``NcclRing``. Every rank calls it at once. ``softcap``, ``sink`` and
    ``window_size`` as flash_forward's over the whole sequence (sink: (heads_q,) float32, the same
    on every rank; window_size: (left, right) in global positions). ``cu_seqlens``: a packed batch
    (q, k, v its ``zigzag_shard_packed`` shards; the whole batch's prefix sums, the same on every
    rank; lse (heads, local rows))."""
    ((o, lse),) = _forward(ring, [q], [k], [v], causal, softmax_scale, softcap, sink, window_size, cu_seqlens, None)
    return o, lse


def ring_attention_backward(do, q, k, v, o, lse, *, ring, causal=False, softmax_scale=None, softcap=0.0, sink=None,
                            window_size=None, cu_seqlens=None):
    """This rank's (dq, dk, dv) shards, given its shards of do, q, k, v and the forward's o, lse;
    with ``sink`` also this rank's part of dsink (all-reduce the ranks' parts for the gradient)."""
    ((*grads,),) = _backward(ring, [do], [q], [k], [v], [o], [lse], causal, softmax_scale, softcap, sink, window_size,
                             cu_seqlens, None)
    return tuple(grads)


# ---------------------------------------------------------------------------------------------
# All-to-all over heads (DeepSpeed-Ulysses): each rank holds a contiguous shard of the sequence;
# one all-to-all regathers the whole sequence for heads / P of the heads, where one flash call
# (every variant) runs, and another returns the result to the sequence split.

ULYSSES_OPTIONS = frozenset(("window_size", "softcap", "sink", "alibi_slopes"))


def _head_groups(name: str, heads: int, world: int) -> int:
    if heads % world:
        raise ValueError(f"{name} has {heads} heads, not a multiple of the {world} ranks: all-to-all gives each "
                         f"rank heads / {world} of them (repeat the K/V heads, or use the ring)")
    return heads // world


def _check_ulysses(name, shards, world, like=None):
    _check_shards(name, shards, world, like)
    return _head_groups(name, shards[0].shape[2], world)


def _to_heads(ring, shards, heads_axis: int = 2, seq_axis: int = 1):
    """Each rank's shard (rows along ``seq_axis``) -> its head group over the whole sequence: rank r
    sends rank j its rows of head group j; the pieces arrive in rank order, the sequence's."""
    xp = _xp(shards[0])
    world = ring.world
    size = shards[0].shape[heads_axis] // world
    sent = [[xp.ascontiguousarray(_take(x, heads_axis, j * size, (j + 1) * size)) for j in range(world)] for x in shards]
    return [xp.concatenate(pieces, axis=seq_axis) for pieces in ring.all_to_all(sent)]


def _to_sequence(ring, wholes, heads_axis: int = 2, seq_axis: int = 1):
    """The inverse of _to_heads: rank r's head group over the whole sequence -> every head over its
    own rows."""
    xp = _xp(wholes[0])
    world = ring.world
    rows = wholes[0].shape[seq_axis] // world
    sent = [[xp.ascontiguousarray(_take(x, seq_axis, j * rows, (j + 1) * rows)) for j in range(world)] for x in wholes]
    return [xp.concatenate(pieces, axis=heads_axis) for pieces in ring.all_to_all(sent)]


def _take(x, axis: int, start: int, stop: int):
    return x[(slice(None),) * axis + (slice(start, stop),)]


def _ulysses_options(options: dict, rank: int, world: int, heads: int) -> dict:
    """The flash call's options on rank ``rank``'s head group: per-head arrays (sink, alibi_slopes)
    sliced to it; anything the mode does not take is a TypeError naming it."""
    unknown = sorted(set(options) - ULYSSES_OPTIONS)
    if unknown:
        raise TypeError(f"all-to-all attention does not take {', '.join(unknown)} (it takes {', '.join(sorted(ULYSSES_OPTIONS))}"
                        ", causal, softmax_scale)")
    size = heads // world
    out = dict(options)
    for name in ("sink", "alibi_slopes"):
        x = out.get(name)
        if x is not None:
            if getattr(x, "ndim", None) not in (1, 2) or x.shape[-1] != heads:
                raise ValueError(f"{name} has shape {tuple(getattr(x, 'shape', ()))}; expected (heads_q,) = ({heads},)"
                                 + (" or (batch, heads_q)" if name == "alibi_slopes" else ""))
            out[name] = _take(x, x.ndim - 1, rank * size, (rank + 1) * size)
    return out


def _ulysses_forward(ring, qs, ks, vs, causal, softmax_scale, options, backend):
    world = ring.world
    _check_ulysses("q", qs, len(ring.ranks))
    for name, shards in (("k", ks), ("v", vs)):
        _check_ulysses(name, shards, len(ring.ranks), like=qs)
    heads = qs[0].shape[2]
    q_whole, k_whole, v_whole = (_to_heads(ring, x) for x in (qs, ks, vs))
    outs = [backend[0](q, k, v, causal, softmax_scale, _ulysses_options(options, r, world, heads))
            for q, k, v, r in zip(q_whole, k_whole, v_whole, ring.ranks)]
    o = _to_sequence(ring, [o for o, _ in outs])
    lse = _to_sequence(ring, [lse for _, lse in outs], heads_axis=1, seq_axis=2)
    return list(zip(o, lse))


def _ulysses_backward(ring, dos, qs, ks, vs, os_, lses, causal, softmax_scale, options, backend):
    world = ring.world
    for name, shards in (("do", dos), ("q", qs), ("k", ks), ("v", vs), ("o", os_)):
        _check_ulysses(name, shards, len(ring.ranks), like=qs)
    heads = qs[0].shape[2]
    for r, (q, lse) in enumerate(zip(qs, lses)):
        want = (q.shape[0], q.shape[2], q.shape[1])
        if tuple(lse.shape) != want:
            raise ValueError(f"lse[{r}] has shape {tuple(lse.shape)}; expected (batch, heads, local_seqlen) = {want}")
    wholes = [_to_heads(ring, x) for x in (dos, qs, ks, vs, os_)]
    lse_whole = _to_heads(ring, lses, heads_axis=1, seq_axis=2)
    grads = [backend[1](do, q, k, v, o, lse, causal, softmax_scale, _ulysses_options(options, r, world, heads))
             for do, q, k, v, o, lse, r in zip(*wholes, lse_whole, ring.ranks)]
    back = [_to_sequence(ring, [g[i] for g in grads]) for i in range(3)]
    out = [tuple(b[r] for b in back) for r in range(len(ring.ranks))]
    if options.get("sink") is None:
        return out
    return [o + (_heads_gradient(g[3], r, world, heads),) for o, g, r in zip(out, grads, ring.ranks)]


def _heads_gradient(part, index: int, parts: int, heads: int):
    """A per-head gradient of head group ``index`` of ``parts`` (dsink of a rank's heads) placed in a
    (heads,) array of zeros, so that the ranks' parts add up to the gradient (as the ring's do)."""
    full = _xp(part).zeros((heads,), dtype=part.dtype)
    size = heads // parts
    full[index * size:(index + 1) * size] = part
    return full


def _flash_ulysses_backend():
    """(forward, backward) of one rank's head group over the whole sequence, on the flash kernels
    with every option it was given."""
    from .backward import flash_backward
    from .forward import flash_forward

    def forward(q, k, v, causal, scale, options):
        return flash_forward(q, k, v, causal=causal, softmax_scale=scale, **options)

    def backward(do, q, k, v, o, lse, causal, scale, options):
        return flash_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=scale, **options)
    return forward, backward


def simulate_ulysses_forward(qs, ks, vs, *, causal=False, softmax_scale=None, _backend=None, **options):
    """All-to-all attention over ``len(qs)`` virtual ranks in this process: qs[r], ks[r], vs[r] are
    rank r's contiguous shards of the sequence (batch, local_seqlen, heads, head_dim; heads and
    K/V heads multiples of the ranks); returns [(o_r, lse_r)] in the same split. ``options``:
    window_size, softcap, sink, alibi_slopes, as flash_forward's over the whole sequence."""
    return _ulysses_forward(LoopbackRing(len(qs)), list(qs), list(ks), list(vs), causal, softmax_scale, options,
                            _backend or _flash_ulysses_backend())


def simulate_ulysses_backward(dos, qs, ks, vs, os_, lses, *, causal=False, softmax_scale=None, _backend=None,
                              **options):
    """The all-to-all backward over virtual ranks: [(dq_r, dk_r, dv_r)], with a sink also dsink_r
    (heads,): rank r's head group's part, zeros elsewhere (the ranks' parts add up)."""
    return _ulysses_backward(LoopbackRing(len(qs)), list(dos), list(qs), list(ks), list(vs), list(os_), list(lses),
                             causal, softmax_scale, options, _backend or _flash_ulysses_backend())


def ulysses_attention_forward(q, k, v, *, ring, causal=False, softmax_scale=None, **options):
    """This rank's (o, lse) of attention over the whole sequence by all-to-all over heads: q, k, v are
    its contiguous shard, ``ring`` its ``NcclRing`` (the ranks). Every rank calls it at once."""
    ((o, lse),) = _ulysses_forward(ring, [q], [k], [v], causal, softmax_scale, options, _flash_ulysses_backend())
    return o, lse


def ulysses_attention_backward(do, q, k, v, o, lse, *, ring, causal=False, softmax_scale=None, **options):
    """This rank's (dq, dk, dv) shards (with a sink also its part of dsink) by all-to-all over heads."""
    ((*grads,),) = _ulysses_backward(ring, [do], [q], [k], [v], [o], [lse], causal, softmax_scale, options,
                                     _flash_ulysses_backend())
    return tuple(grads)


# ---------------------------------------------------------------------------------------------
# The hybrid: all-to-all over heads inside groups of U ranks, the ring across the G = P / U groups.
# The sequence is zigzag-sharded over the groups (group g holds chunks g and 2G - 1 - g), and each
# group's shard is split contiguously over its U ranks. The all-to-all inside a group gives each of
# its ranks the group's whole shard for heads / U of the heads; the ranks that share a place u in
# their groups then run the ring over those shards; a second all-to-all returns the results.

def hybrid_shard(x, rank: int, world: int, group_size: int, axis: int = 1):
    """Rank ``rank``'s shard for the hybrid mode: piece u of U (contiguous) of group g's zigzag
    shard over the G groups (rank = g U + u)."""
    groups = _check_group_size(group_size, world)
    g, u = divmod(rank, group_size)
    group = zigzag_shard(x, g, groups, axis=axis)
    rows = group.shape[axis] // group_size
    return _take(group, axis, u * rows, (u + 1) * rows)


def hybrid_unshard(shards, group_size: int, axis: int = 1):
    """The whole sequence from every rank's hybrid shard (rank order)."""
    xp = _xp(shards[0])
    groups = _check_group_size(group_size, len(shards))
    return zigzag_unshard([xp.concatenate(shards[g * group_size:(g + 1) * group_size], axis=axis)
                           for g in range(groups)], axis=axis)


def _heads_part(x, part: int, parts: int):
    """The ``part``-th of ``parts`` equal slices of a per-head array's last axis (None stays None)."""
    if x is None:
        return None
    size = x.shape[-1] // parts
    return _take(x, x.ndim - 1, part * size, (part + 1) * size)


def _hybrid(within_rings, across_rings, shards: dict, run):
    """The hybrid's data movement around ``run`` (a ring call per place u over its groups' shards).
    ``shards``: {name: [[rank (g, u)'s array for u held] for g held]} with lse's rows on axis 2
    (name 'lse'); within_rings[gi] moves group gi's arrays, across_rings[ui] links place ui's.
    Returns run's per-(g, u) results moved back: [[result for u] for g]."""
    names = list(shards)
    gathered = {}
    for name in names:
        heads_axis, seq_axis = (1, 2) if name == "lse" else (2, 1)
        gathered[name] = [_to_heads(ring, shards[name][gi], heads_axis, seq_axis) for gi, ring in enumerate(within_rings)]
    results = [run(ui, ring, {name: [gathered[name][gi][ui] for gi in range(len(within_rings))] for name in names})
               for ui, ring in enumerate(across_rings)]   # results[ui][gi]: a tuple of arrays
    width = len(results[0][0])
    out = [[None] * len(across_rings) for _ in within_rings]
    for gi, ring in enumerate(within_rings):
        moved = []
        for i in range(width):
            wholes = [results[ui][gi][i] for ui in range(len(across_rings))]
            if wholes[0].ndim == 1:   # dsink (heads / U,): stays with its rank
                moved.append(wholes)
                continue
            heads_axis, seq_axis = (1, 2) if wholes[0].ndim == 3 else (2, 1)
            moved.append(_to_sequence(ring, wholes, heads_axis, seq_axis))
        for ui in range(len(across_rings)):
            out[gi][ui] = tuple(m[ui] for m in moved)
    return out


def _hybrid_forward(within_rings, across_rings, qs, ks, vs, causal, softmax_scale, softcap, sink, window_size,
                    backend=None):
    group_size = within_rings[0].world
    for name, grid in (("q", qs), ("k", ks), ("v", vs)):
        _head_groups(name, grid[0][0].shape[2], group_size)

    def run(ui, ring, arrays):
        part = _heads_part(sink, within_rings[0].ranks[ui], group_size)   # place u's heads
        return _forward(ring, arrays["q"], arrays["k"], arrays["v"], causal, softmax_scale, softcap, part, window_size,
                        None, backend)

    return _hybrid(within_rings, across_rings, dict(q=qs, k=ks, v=vs), run)


def _hybrid_backward(within_rings, across_rings, dos, qs, ks, vs, os_, lses, causal, softmax_scale, softcap, sink,
                     window_size, backend=None):
    group_size = within_rings[0].world
    heads = qs[0][0].shape[2]
    for name, grid in (("q", qs), ("k", ks), ("v", vs)):
        _head_groups(name, grid[0][0].shape[2], group_size)

    def run(ui, ring, arrays):
        part = _heads_part(sink, within_rings[0].ranks[ui], group_size)   # place u's heads
        return _backward(ring, arrays["do"], arrays["q"], arrays["k"], arrays["v"], arrays["o"], arrays["lse"], causal,
                         softmax_scale, softcap, part, window_size, None, backend)

    out = _hybrid(within_rings, across_rings, dict(do=dos, q=qs, k=ks, v=vs, o=os_, lse=lses), run)
    if sink is None:
        return out
    for gi, row in enumerate(out):
        for ui, grads in enumerate(row):
            row[ui] = grads[:3] + (_heads_gradient(grads[3], within_rings[gi].ranks[ui], group_size, heads),)
    return out


def simulate_hybrid_forward(qs, ks, vs, *, group_size, causal=False, softmax_scale=None, softcap=0.0, sink=None,
                            window_size=None, _backend=None):
    """The hybrid mode over ``len(qs)`` virtual ranks (groups of ``group_size`` by all-to-all over
    heads, the ring across the groups): qs[r], ks[r], vs[r] are rank r's ``hybrid_shard``s; returns
    [(o_r, lse_r)]. Options as the ring's (sink over all heads)."""
    world = len(qs)
    groups = _check_group_size(group_size, world)

    def grid(xs):
        return [list(xs[g * group_size:(g + 1) * group_size]) for g in range(groups)]

    out = _hybrid_forward([LoopbackRing(group_size)] * groups, [LoopbackRing(groups)] * group_size, grid(qs), grid(ks),
                          grid(vs), causal, softmax_scale, softcap, sink, window_size, _backend)
    return [x for row in out for x in row]


def simulate_hybrid_backward(dos, qs, ks, vs, os_, lses, *, group_size, causal=False, softmax_scale=None, softcap=0.0,
                             sink=None, window_size=None, _backend=None):
    """The hybrid backward over virtual ranks: [(dq_r, dk_r, dv_r[, dsink_r])] (dsink_r: its part)."""
    world = len(qs)
    groups = _check_group_size(group_size, world)

    def grid(xs):
        return [list(xs[g * group_size:(g + 1) * group_size]) for g in range(groups)]

    out = _hybrid_backward([LoopbackRing(group_size)] * groups, [LoopbackRing(groups)] * group_size, grid(dos), grid(qs),
                           grid(ks), grid(vs), grid(os_), grid(lses), causal, softmax_scale, softcap, sink, window_size,
                           _backend)
    return [x for row in out for x in row]


def hybrid_attention_forward(q, k, v, *, within, across, causal=False, softmax_scale=None, softcap=0.0, sink=None,
                             window_size=None):
    """This rank's (o, lse) by the hybrid mode: q, k, v its ``hybrid_shard``s, ``within`` and
    ``across`` from ``NcclRing.from_environment(group_size=U)``. Every rank calls it at once."""
    (((o, lse),),) = _hybrid_forward([within], [across], [[q]], [[k]], [[v]], causal, softmax_scale, softcap, sink,
                                     window_size)
    return o, lse


def hybrid_attention_backward(do, q, k, v, o, lse, *, within, across, causal=False, softmax_scale=None, softcap=0.0,
                              sink=None, window_size=None):
    """This rank's (dq, dk, dv) (with a sink also its part of dsink) by the hybrid mode."""
    ((grads,),) = _hybrid_backward([within], [across], [[do]], [[q]], [[k]], [[v]], [[o]], [[lse]], causal, softmax_scale,
                                   softcap, sink, window_size)
    return tuple(grads)
