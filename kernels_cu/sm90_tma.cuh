// Hopper data movement and warp specialisation (sm_90; setmaxnreg needs sm_90a): TMA bulk tensor
// loads completing on mbarriers with transaction counts, a ring of stages with full/empty
// barriers, register reallocation between warpgroups, named barriers.

#pragma once
#include "common.cuh"
#include "tensor_core.cuh"

// A CUtensorMap (cuda.h: 128 bytes, 64-byte aligned), encoded on the host by
// cuTensorMapEncodeTiled (cupy_flash/_tma.py) and passed in a __grid_constant__ kernel parameter:
// TMA reads it from parameter space.
struct alignas(64) TensorMap { unsigned long long opaque[16]; };

// ---- mbarrier ----------------------------------------------------------------------------------
__device__ __forceinline__ void barrier_init(unsigned int bar, unsigned int arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(arrivals) : "memory");
}
// Makes initialised barriers visible to the async proxy (TMA) and the other threads (with a
// __syncthreads after it).
__device__ __forceinline__ void barrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// One arrival that also announces `bytes` of TMA transactions the phase waits for.
__device__ __forceinline__ void barrier_arrive_expect(unsigned int bar, unsigned int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void barrier_arrive(unsigned int bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
// `count` arrivals at once (one thread speaking for several warps it has synchronised with).
__device__ __forceinline__ void barrier_arrive(unsigned int bar, unsigned int count) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
// Returns once the phase of parity `parity` has completed. A fresh barrier is in phase 0, and
// waiting on parity 1 returns at once (the phase "before" it counts as complete): a producer
// waits for empty slots with the parity opposite to its consumers'. The suspend-time hint (10 ms,
// an upper bound: the thread resumes when the phase completes) keeps a waiting warp off the issue
// slots; without it try_wait gave up after about 10 cycles, and the Hopper backward's producer warp
// spun through 12% of the kernel's instructions (ncu, d = 128 8k) waiting for empty slots, on the
// scheduler two consumer warps share with it.
__device__ __forceinline__ void barrier_wait(unsigned int bar, unsigned int parity) {
    asm volatile("{\n.reg .pred done;\n"
                 "WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n"
                 "@!done bra WAIT_%=;\n}\n" :: "r"(bar), "r"(parity), "n"(10000000) : "memory");
}

// A count in shared memory the block's warps add to: the add releases this thread's earlier writes
// (and those it has synchronised with) and acquires those of the adds before it; returns the count
// before the add.
__device__ __forceinline__ unsigned int shared_add_acq_rel(unsigned int* counter, unsigned int value) {
    unsigned int before;
    asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], %2;" : "=r"(before)
                 : "r"((unsigned int)__cvta_generic_to_shared(counter)), "r"(value) : "memory");
    return before;
}

// ---- TMA -----------------------------------------------------------------------------------------
__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"((unsigned long long)map) : "memory");
}
// Box at coordinates (c0 innermost .. c3) of a 4-D tensor map into shared memory at dst; the bytes
// count towards bar's transactions. Elements outside the tensor arrive as zeros (and still count).
__device__ __forceinline__ void tma_load_4d(unsigned int dst, const TensorMap* map, unsigned int bar, int c0, int c1,
                                            int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4, %5, %6}], [%2];"
                 :: "r"(dst), "l"((unsigned long long)map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) of contiguous global memory into shared
// memory at dst, counting towards bar's transactions (row statistics: lse, delta).
__device__ __forceinline__ void bulk_load(unsigned int dst, const void* src, unsigned int bytes, unsigned int bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"((unsigned long long)src), "r"(bytes), "r"(bar) : "memory");
}

// Box of shared memory at src to coordinates (c0 .. c3) of a 4-D tensor map; elements outside the
// tensor are not written. The writes to src must be made visible to the async proxy first (each
// writing thread: fence_async_shared, then a barrier with the issuing thread). Completion is
// tracked in bulk groups: commit, then wait until the group has read its sources (the shared
// memory may then be rewritten; the global writes complete before the kernel does).
__device__ __forceinline__ void tma_store_4d(const TensorMap* map, unsigned int src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
                 :: "l"((unsigned long long)map), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// The same box added element-wise (float32) into the tensor at L2: the Hopper backward's dQ adds.
__device__ __forceinline__ void tma_reduce_add_4d(const TensorMap* map, unsigned int src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
                 :: "l"((unsigned long long)map), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// Until this thread's committed groups have completed their global writes too, which are then
// ordered (proxy fence) before this thread's later generic accesses (deterministic dQ's publish).
__device__ __forceinline__ void tma_store_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;" ::: "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
__device__ __forceinline__ void tma_store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Orders this thread's generic-proxy shared-memory accesses before later async-proxy (TMA) ones.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// A ring of STAGES shared-memory slots: slot i % STAGES in its round i / STAGES. Consumers wait
// for a slot's `full` barrier with the round's parity; the producer waits for its `empty` barrier
// with the opposite parity (so the first round finds every slot free).
struct RingSlot {
    int index;
    unsigned int parity;
};
template <int STAGES>
__device__ __forceinline__ RingSlot ring_slot(int i) {
    return {i % STAGES, (unsigned int)((i / STAGES) & 1)};
}

// ---- warp specialisation -------------------------------------------------------------------------
// setmaxnreg: every warp of the warpgroup executes it; the kernel needs __launch_bounds__(threads,
// 1) or ptxas ignores it (C7508). The pool is 64K registers per SM.
template <int REGISTERS>
__device__ __forceinline__ void release_registers() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(REGISTERS)); }
template <int REGISTERS>
__device__ __forceinline__ void acquire_registers() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(REGISTERS)); }

// Named barriers (0 is __syncthreads): bar.sync waits until `threads` have arrived, counting
// bar.arrive's, which do not wait.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

// ---- a persistent grid's tiles from a counter ----------------------------------------------------
// The counter in global memory, zero at launch (the kernel leaves it zero: release_tile_counter).
// Its size is read by the launcher (tile_counter_bytes; cupy_flash/_launch.TileCounters).
struct TileCounter {
    int claimed;   // tiles taken from the counter so far (past the first gridDim.x)
    int released;  // blocks done fetching
};
__device__ const unsigned int tile_counter_bytes = sizeof(TileCounter);

// Block b starts with tile b and then takes gridDim.x + the counter's count as it finishes one, so
// blocks that drew short tiles take more. One thread (the producer's) fetches each next tile as it
// has issued the current one's loads and hands it to the consumer warps through shared memory: a
// two-entry ring (`round`: how many tiles the block has handed over before), `full` counting the
// producer's arrival, `empty` the consumers'.
struct TileHandover {
    int next_tile[2];
    unsigned long long full[2], empty[2];

    __device__ __forceinline__ void init(int arrivals) {   // receive's or receive_each's, per round
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            barrier_init(smem_addr(&full[s]), 1);
            barrier_init(smem_addr(&empty[s]), arrivals);
        }
    }
    // The producer thread: the next tile, handed over.
    __device__ __forceinline__ int fetch(TileCounter* tile_counter, int round) {
        const int next = gridDim.x + atomicAdd(&tile_counter->claimed, 1);
        const RingSlot slot = ring_slot<2>(round);
        barrier_wait(smem_addr(&empty[slot.index]), slot.parity ^ 1);
        next_tile[slot.index] = next;
        barrier_arrive(smem_addr(&full[slot.index]));   // releases the write to the waiters
        return next;
    }
    // The tile handed over in `round`, for a whole consumer warp (converged; init's arrivals: one
    // a warp): lane 0 reads it, arrives and passes it to the other lanes. (With every lane reading
    // and lane 0 arriving for the warp, racecheck flagged lanes 1-31's reads against the
    // producer's next write to the slot, once blocks took 3+ tiles: an arrival releases the
    // arriving thread's accesses.)
    __device__ __forceinline__ int receive(int round) {
        int next = 0;
        if (threadIdx.x % 32 == 0) next = receive_each(round);
        return __shfl_sync(0xffffffffu, next, 0);
    }
    // ... for one thread, which arrives for itself (init's arrivals: one a thread). The Hopper
    // backward's consumers take this: with receive, its d = 128 consumers spilled 76 bytes.
    __device__ __forceinline__ int receive_each(int round) {
        const RingSlot slot = ring_slot<2>(round);
        barrier_wait(smem_addr(&full[slot.index]), slot.parity);
        const int next = *static_cast<volatile int*>(&next_tile[slot.index]);
        barrier_arrive(smem_addr(&empty[slot.index]));
        return next;
    }
};

// After the producer's last fetch: the counter left as the launch found it, zero, so the launcher
// need not zero it per call (it keeps one per host thread and stream; allocating and zeroing one
// took ~10 us of a call's host time, 5% of a 512-key causal d = 64 forward). Each block counts
// itself out in `released` after its fetches (the fence orders them); the last block zeroes both,
// once every fetch is done.
__device__ __forceinline__ void release_tile_counter(TileCounter* tile_counter) {
    __threadfence();
    if (atomicAdd(&tile_counter->released, 1) == (int)gridDim.x - 1) {
        __threadfence();
        tile_counter->claimed = 0;
        tile_counter->released = 0;
    }
}

// The persistent grid's tile order, one for the Hopper forward and backward: block b starts with
// tile b and takes each next one from the counter (DYNAMIC: the producer thread fetches it and
// hands it over, TileHandover) or by the grid's stride. The consumers receive a handed-over tile
// per warp (receive) or, where EACH_THREAD, per thread (receive_each).
template <bool DYNAMIC, bool EACH_THREAD>
struct PersistentTiles {
    // The tile after `tile` for the producer thread (round: how many it has handed over before).
    static __device__ __forceinline__ int producer_next(int tile, TileCounter* tile_counter, TileHandover& handover, int round) {
        return DYNAMIC ? handover.fetch(tile_counter, round) : tile + (int)gridDim.x;
    }
    // After the producer's last fetch (the kernel leaves the counter zero).
    static __device__ __forceinline__ void release_counter(TileCounter* tile_counter) {
        if (DYNAMIC) release_tile_counter(tile_counter);
    }
    // The same tile, for a consumer.
    static __device__ __forceinline__ int consumer_next(int tile, TileHandover& handover, int round) {
        if constexpr (!DYNAMIC) return tile + (int)gridDim.x;
        else if constexpr (EACH_THREAD) return handover.receive_each(round);
        else return handover.receive(round);
    }
};
