// CUDA kernels behind include/kvzap/compaction.h.
//
// Threshold compaction (the decisions) splits every (sequence, head) row into tiles of whole 4,096-position
// steps, one CUDA block per tile, so that one sequence fills the GPU (batch 1 x 8 KV heads x 128k tokens: 256
// blocks, where one block per row gave 8 blocks on 132 SMs). A block needs the number of kept positions before
// its tile (the slot of its first kept position); it *recounts* them from the scores, like the Triton kernel:
//   1. count the kept positions of [0, min(tile start, length)): those of the sink and the window by arithmetic,
//      the others from the scores (16-byte loads, 8 in flight per thread, one compare per score);
//   2. walk its tile in steps of 4,096 positions, 16 per thread in a striped layout (position = step start +
//      item * 256 + thread: coalesced loads and stores of any alignment). Per step: write keep, one warp ballot
//      per item, the kept counts of the 128 (item, warp) groups scanned in position order, then each kept
//      position goes to slot = count before the step + its group's prefix + kept lanes below it in the ballot;
//   3. the row's last kFillTiles tiles also count the kept positions after them, so each knows the row's count;
//      they split the -1 tail of indices, slots [count, seq), into equal parts (16-byte stores), and the last tile
//      writes counts. (The last tile alone writing the tail took ~8 us of 24 at 128k on an H100.)
// Every block writes addresses no other block writes (its own keep range, its own slots, and a fill tile its part
// of the slots past the count, which no kept position takes) and reads only its inputs: blocks never wait for one
// another, so there is no inter-block protocol to get wrong, no atomics, no workspace (so no ABI change and
// nothing for TensorRT's workspace or a CUDA graph to provide), one launch, and a deterministic result.
// Why not count-then-scan over a workspace or a decoupled look-back: both are linear in the scores read where
// recounting re-reads about (tiles per row - 1) / 2 rows' worth, but they need a workspace in the C ABI and the
// TensorRT plugin, and the first needs a second launch (a few microseconds, as much as the whole kernel at 4k).
// The re-read is bounded instead: tiles per row = min(steps of the row, ceil(kTargetBlocks / rows)), so it adds
// at most about kTargetBlocks / 2 rows' worth of scores in total whatever the batch, served from L2 while the
// scores fit there (batch 1 x 8 x 128k: 2 MiB in bf16, re-read ~15.5 times = 31 MiB of L2 reads; at batch >= 48 x
// 8 heads a row is one tile and nothing is re-read).
#include "kvzap/compaction.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstring>

namespace {

constexpr int kThreads = 256;                  // threads of a decision block: 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kItems = 16;                     // positions per thread per step
constexpr int kStep = kThreads * kItems;       // 4,096 positions: one step; tiles are whole steps
constexpr int kGroups = kItems * kWarps;       // (item, warp) groups of 32 positions per step
constexpr int kTargetBlocks = 384;             // about one wave on an H100: 3 resident blocks per SM x 132 SMs
constexpr int kCountVecs = 8;                  // 16-byte loads in flight per thread while counting earlier tiles
constexpr int kFillTiles = 8;                  // last tiles of a row that share the -1 tail of its indices
constexpr int kMaxGridY = 65535;
static_assert(kGroups == 4 * 32, "the step scan gives each lane of one warp 4 groups");

// Tiles of a row: how many, and positions per tile (whole steps). Every tile but the last is full; the last
// one ends at seq and is not empty (a row of seq 0 has one empty tile, which writes counts = 0).
struct Tiling {
  int64_t tilesPerRow;
  int64_t span;
};

__host__ __device__ Tiling tiling(int64_t rows, int64_t seq) {
  const int64_t steps = seq > 0 ? (seq + kStep - 1) / kStep : 1;
  const int64_t want = rows >= kTargetBlocks ? 1 : (kTargetBlocks + rows - 1) / rows;
  const int64_t tiles = want < steps ? want : steps;
  const int64_t stepsPerTile = (steps + tiles - 1) / tiles;
  return {(steps + stepsPerTile - 1) / stepsPerTile, stepsPerTile * kStep};  // no empty tile
}

// Scores are compared in float32 against tau rounded to the scores' dtype: exact, and equal to comparing in
// that dtype (every fp16/bf16 value is a float32 value), which is what torch does with a Python float.
template <typename T> __device__ float roundThreshold(float tau);
template <> __device__ float roundThreshold<float>(float tau) { return tau; }
template <> __device__ float roundThreshold<__half>(float tau) { return __half2float(__float2half_rn(tau)); }
template <> __device__ float roundThreshold<__nv_bfloat16>(float tau) { return __bfloat162float(__float2bfloat16_rn(tau)); }

template <typename T> __device__ float toFloat(T v);
template <> __device__ float toFloat<float>(float v) { return v; }
template <> __device__ float toFloat<__half>(__half v) { return __half2float(v); }
template <> __device__ float toFloat<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// The decision rule of one position of a row.
struct Rule {
  int length;
  int64_t windowStart;
  int sink;
  float tau;
  __device__ bool keeps(int pos, float score) const {
    // !(score < tau) is true for NaN: a NaN score is kept. Padding (pos >= length) never is. Bitwise, no branches.
    return (pos < length) & ((pos >= windowStart) | (pos < sink) | !(score < tau));
  }
};

// This thread's share of the n scores of x that are not below tau (NaN counts): a scalar head up to the first
// 16-byte boundary, then 16-byte vectors (kCountVecs per thread in flight), then a scalar tail.
template <typename T>
__device__ int countNotBelow(const T* __restrict__ x, int n, float tau) {
  constexpr int kVec = 16 / sizeof(T);
  const int misaligned = static_cast<int>(reinterpret_cast<uintptr_t>(x) % 16 / sizeof(T));
  const int head = min((kVec - misaligned) % kVec, n);
  const int tid = static_cast<int>(threadIdx.x);
  int count = 0;
  if (tid < head) count += !(toFloat<T>(x[tid]) < tau);
  const int vectors = (n - head) / kVec;
  const uint4* vec = reinterpret_cast<const uint4*>(x + head);
  for (int first = 0; first < vectors; first += kThreads * kCountVecs) {
    uint4 loaded[kCountVecs];
#pragma unroll
    for (int u = 0; u < kCountVecs; ++u) {  // all loads first
      const int v = first + u * kThreads + tid;
      loaded[u] = v < vectors ? vec[v] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kCountVecs; ++u) {  // independent sums per vector, no branch: the compares interleave
      T elems[kVec];
      memcpy(elems, &loaded[u], sizeof(elems));
      int notBelow = 0;
#pragma unroll
      for (int e = 0; e < kVec; ++e) notBelow += !(toFloat<T>(elems[e]) < tau);
      count += first + u * kThreads + tid < vectors ? notBelow : 0;
    }
  }
  for (int i = head + vectors * kVec + tid; i < n; i += kThreads) count += !(toFloat<T>(x[i]) < tau);
  return count;
}

// This thread's share of the kept positions in [from, to) of a row, from <= to <= length (no padding there):
// positions below lo = sink (clamped to [from, to]) and from hi = the window's start (clamped to [lo, to]) on are
// kept whatever their score (thread 0 counts them); those of [lo, hi) are counted from the scores.
template <typename T>
__device__ int countKept(const T* __restrict__ row, int from, int to, const Rule& rule) {
  const int lo = max(from, min(rule.sink, to));
  const int hi = static_cast<int>(min(max(rule.windowStart, static_cast<int64_t>(lo)), static_cast<int64_t>(to)));
  return (threadIdx.x == 0 ? (lo - from) + (to - hi) : 0) + countNotBelow(row + lo, hi - lo, rule.tau);
}

// x[0, n) = -1 by the block: a scalar head up to the first 16-byte boundary, 16-byte stores, a scalar tail.
__device__ void fillNone(int32_t* __restrict__ x, int n) {
  const int misaligned = static_cast<int>(reinterpret_cast<uintptr_t>(x) % 16 / sizeof(int32_t));
  const int head = min((4 - misaligned) % 4, n);
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < head) x[tid] = -1;
  const int vectors = (n - head) / 4;
  int4* vec = reinterpret_cast<int4*>(x + head);
  for (int v = tid; v < vectors; v += kThreads) vec[v] = make_int4(-1, -1, -1, -1);
  for (int i = head + vectors * 4 + tid; i < n; i += kThreads) x[i] = -1;
}

// Sum over the block of one value per thread, returned to every thread. Called once per block (warpSums is not
// reused afterwards, so no barrier is needed after the reads). Two non-negative int counts travel as one int64
// (low and high halves; neither sum reaches 2^31, so no carry crosses).
__device__ int64_t blockSum(int64_t value, int64_t* warpSums) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  if (threadIdx.x % 32 == 0) warpSums[threadIdx.x / 32] = value;
  __syncthreads();
  int64_t total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += warpSums[w];
  return total;
}

// One block per tile: block b handles tile b % tilesPerRow of row b / tilesPerRow (row = sequence * heads + head).
// At most 80 registers (3 resident blocks per SM; ptxas reports no spills at that bound for sm_80 and sm_90).
template <typename T, typename K>
__global__ void __launch_bounds__(kThreads, 3)
    decideKernel(const T* __restrict__ scores, const int32_t* __restrict__ lengths, const float* __restrict__ threshold,
                 const int32_t* __restrict__ window, int heads, int seq, int sink, int64_t tilesPerRow, int64_t span,
                 K* __restrict__ keep, int32_t* __restrict__ counts, int32_t* __restrict__ indices) {
  // A step's kept count per (item, warp) group, then its exclusive prefix; groups[kGroups]: the step's total.
  __shared__ int groups[kGroups + 1];
  __shared__ int64_t warpSums[kWarps];
  const int64_t row = static_cast<int64_t>(blockIdx.x) / tilesPerRow;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) % tilesPerRow;
  const int64_t base = row * seq;
  const T* rowScores = scores + base;
  const int length = lengths[row / heads];
  const Rule rule{length, static_cast<int64_t>(length) - window[0], sink, roundThreshold<T>(threshold[0])};
  const int begin = static_cast<int>(min(tile * span, static_cast<int64_t>(seq)));
  const int end = static_cast<int>(min(tile * span + span, static_cast<int64_t>(seq)));
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const unsigned lanesBelow = (1u << lane) - 1u;

  // The row's last fill tiles also count the kept positions after them: each then knows the row's count and
  // writes its share of the -1 tail (one block alone writing up to a whole row of -1 took ~8 us at 128k).
  const int64_t fillTiles = min(tilesPerRow, static_cast<int64_t>(kFillTiles));
  const int64_t fillPart = tile - (tilesPerRow - fillTiles);  // >= 0 for a fill tile
  const int valid = max(0, min(length, seq));  // positions that may be kept: [0, valid)
  // This thread's shares of the kept positions before the tile and (fill tiles) after it, summed as one int64.
  const int64_t before = countKept(rowScores, 0, min(begin, valid), rule);
  const int64_t counted =
      blockSum(before + (fillPart >= 0 ? static_cast<int64_t>(countKept(rowScores, min(end, valid), valid, rule)) << 32 : 0),
               warpSums);
  int count = static_cast<int>(counted & 0xffffffff);  // kept before this tile
  const int after = static_cast<int>(counted >> 32);   // kept after it (fill tiles only)
  for (int step = begin; step < end; step += kStep) {
    float score[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {  // all loads first: 16 in flight per thread
      const int pos = step + i * kThreads + static_cast<int>(threadIdx.x);
      score[i] = pos < end ? toFloat<T>(rowScores[pos]) : 0.0f;
    }
    unsigned ballot[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int pos = step + i * kThreads + static_cast<int>(threadIdx.x);
      const bool kept = pos < end && rule.keeps(pos, score[i]);
      if (pos < end) keep[base + pos] = static_cast<K>(kept);
      ballot[i] = __ballot_sync(0xffffffffu, kept);
      if (lane == i) groups[i * kWarps + warp] = __popc(ballot[i]);
    }
    __syncthreads();
    if (warp == 0) {  // exclusive scan of the 128 group counts, in position order (item-major, then warp)
      int part[4], sum = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) part[j] = groups[4 * lane + j], sum += part[j];
      int inclusive = sum;
      for (int offset = 1; offset < 32; offset <<= 1) {
        const int up = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += up;
      }
      int prefix = inclusive - sum;
#pragma unroll
      for (int j = 0; j < 4; ++j) groups[4 * lane + j] = prefix, prefix += part[j];
      if (lane == 31) groups[kGroups] = inclusive;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      if ((ballot[i] >> lane) & 1u) {
        const int pos = step + i * kThreads + static_cast<int>(threadIdx.x);
        indices[base + count + groups[i * kWarps + warp] + __popc(ballot[i] & lanesBelow)] = pos;
      }
    }
    count += groups[kGroups];
    __syncthreads();  // groups is rewritten by the next step
  }
  if (fillPart >= 0) {  // count + after is the row's count; slots [count + after, seq) are -1, in fillTiles parts
    const int total = count + after;
    const int share = static_cast<int>((seq - total + fillTiles - 1) / fillTiles);
    const int from = static_cast<int>(min(total + fillPart * share, static_cast<int64_t>(seq)));
    fillNone(indices + base + from, min(share, seq - from));
    if (tile == tilesPerRow - 1 && threadIdx.x == 0) counts[row] = total;
  }
}

int decisionGrid(int batch, int heads, int seq, int64_t* blocks, int64_t* span) {
  // seq <= INT_MAX - kStep: positions, steps and the -1 fill advance in int without overflowing.
  if (batch <= 0 || heads <= 0 || seq < 0 || seq > INT_MAX - kStep) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t rows = static_cast<int64_t>(batch) * heads;
  const Tiling t = tiling(rows, seq);
  if (rows * t.tilesPerRow > INT_MAX) return static_cast<int>(cudaErrorInvalidValue);  // gridDim.x < 2^31
  if (blocks != nullptr) *blocks = rows * t.tilesPerRow;
  if (span != nullptr) *span = t.span;
  return static_cast<int>(cudaSuccess);
}

template <typename T>
int launchDecisions(const void* scores, const int32_t* lengths, const float* threshold, const int32_t* window,
                    int batch, int heads, int seq, int sink, void* keep, int keepDtype, int32_t* counts,
                    int32_t* indices, cudaStream_t stream) {
  int64_t blocks = 0, span = 0;
  const int status = decisionGrid(batch, heads, seq, &blocks, &span);
  if (status != 0) return status;
  const int64_t tilesPerRow = blocks / (static_cast<int64_t>(batch) * heads);
  const dim3 grid(static_cast<unsigned>(blocks));
  const T* s = static_cast<const T*>(scores);
  if (keepDtype == KVZAP_BOOL) {
    decideKernel<T, uint8_t><<<grid, kThreads, 0, stream>>>(s, lengths, threshold, window, heads, seq, sink, tilesPerRow,
                                                            span, static_cast<uint8_t*>(keep), counts, indices);
  } else {
    decideKernel<T, int32_t><<<grid, kThreads, 0, stream>>>(s, lengths, threshold, window, heads, seq, sink, tilesPerRow,
                                                            span, static_cast<int32_t*>(keep), counts, indices);
  }
  return static_cast<int>(cudaGetLastError());
}

// Grid (sequence*head, y-blocks): each (threadIdx.y) row of threads copies destination rows t, t + stride, ...
// in Vec units. A row whose index lies outside [0, seq) (-1: none) becomes zeros and reads nothing: an index
// past the head's rows would otherwise read another head's entries or past the allocation.
template <typename Vec>
__global__ void kvMoveKernel(const Vec* __restrict__ keys, const Vec* __restrict__ values,
                             const int32_t* __restrict__ indices, int seq, int rowVecs, Vec* __restrict__ keysOut,
                             Vec* __restrict__ valuesOut) {
  const int64_t head = blockIdx.x;
  const int stride = static_cast<int>(gridDim.y * blockDim.y);
  for (int t = static_cast<int>(blockIdx.y * blockDim.y + threadIdx.y); t < seq; t += stride) {
    const int src = indices[head * seq + t];
    const bool has = src >= 0 && src < seq;
    const int64_t dst = (head * seq + t) * rowVecs;
    const int64_t from = (head * seq + (has ? src : 0)) * rowVecs;
    for (int i = static_cast<int>(threadIdx.x); i < rowVecs; i += static_cast<int>(blockDim.x)) {
      Vec k{}, v{};
      if (has) {
        k = keys[from + i];
        v = values[from + i];
      }
      keysOut[dst + i] = k;
      valuesOut[dst + i] = v;
    }
  }
}

template <typename Vec>
int launchMove(const void* keys, const void* values, const int32_t* indices, int rows, int seq, int rowVecs,
               void* keysOut, void* valuesOut, cudaStream_t stream) {
  const dim3 block(32, 8);
  const int yBlocks = (seq + static_cast<int>(block.y) - 1) / static_cast<int>(block.y);
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(yBlocks < kMaxGridY ? yBlocks : kMaxGridY));
  kvMoveKernel<Vec><<<grid, block, 0, stream>>>(static_cast<const Vec*>(keys), static_cast<const Vec*>(values), indices,
                                                seq, rowVecs, static_cast<Vec*>(keysOut), static_cast<Vec*>(valuesOut));
  return static_cast<int>(cudaGetLastError());
}

bool aligned(std::size_t bytes, const void* a, const void* b, const void* c, const void* d) {
  const auto bits = reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | reinterpret_cast<uintptr_t>(c) |
                    reinterpret_cast<uintptr_t>(d);
  return bits % bytes == 0;
}

}  // namespace

extern "C" int kvzap_threshold_compaction(const void* scores, int scores_dtype, const int32_t* lengths,
                                          const float* threshold, const int32_t* window, int batch, int heads, int seq,
                                          int sink, void* keep, int keep_dtype, int32_t* counts, int32_t* indices,
                                          cudaStream_t stream) {
  if (batch <= 0 || heads <= 0 || seq < 0 || sink < 0) return static_cast<int>(cudaErrorInvalidValue);
  if (keep_dtype != KVZAP_BOOL && keep_dtype != KVZAP_INT32) return static_cast<int>(cudaErrorInvalidValue);
  switch (scores_dtype) {
    case KVZAP_FLOAT32:
      return launchDecisions<float>(scores, lengths, threshold, window, batch, heads, seq, sink, keep, keep_dtype,
                                     counts, indices, stream);
    case KVZAP_FLOAT16:
      return launchDecisions<__half>(scores, lengths, threshold, window, batch, heads, seq, sink, keep, keep_dtype,
                                      counts, indices, stream);
    case KVZAP_BFLOAT16:
      return launchDecisions<__nv_bfloat16>(scores, lengths, threshold, window, batch, heads, seq, sink, keep,
                                             keep_dtype, counts, indices, stream);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

extern "C" int kvzap_threshold_compaction_grid(int batch, int heads, int seq, int64_t* blocks,
                                               int64_t* positions_per_block) {
  return decisionGrid(batch, heads, seq, blocks, positions_per_block);
}

extern "C" int kvzap_kv_compaction(const void* keys, const void* values, const int32_t* indices, int batch, int heads,
                                   int seq, int head_dim, int elem_size, void* keys_out, void* values_out,
                                   cudaStream_t stream) {
  if (batch <= 0 || heads <= 0 || seq < 0 || head_dim <= 0 || elem_size <= 0)
    return static_cast<int>(cudaErrorInvalidValue);
  if (seq == 0) return static_cast<int>(cudaSuccess);
  const int rowBytes = head_dim * elem_size;
  const int rows = batch * heads;
  // 16-byte vectors when possible: a bf16 row of head_dim 128 is 16 uint4 loads.
  if (rowBytes % 16 == 0 && aligned(16, keys, values, keys_out, values_out))
    return launchMove<uint4>(keys, values, indices, rows, seq, rowBytes / 16, keys_out, values_out, stream);
  if (rowBytes % 4 == 0 && aligned(4, keys, values, keys_out, values_out))
    return launchMove<uint32_t>(keys, values, indices, rows, seq, rowBytes / 4, keys_out, values_out, stream);
  return launchMove<uint8_t>(keys, values, indices, rows, seq, rowBytes, keys_out, values_out, stream);
}
