// CUDA kernels behind include/kvzap/compaction.h.
#include "kvzap/compaction.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cub/block/block_scan.cuh>

namespace {

constexpr int kThreads = 512;
constexpr int kMaxGridY = 65535;

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

// One block per (sequence, head) row. The row is walked in chunks of kThreads positions; a block-wide
// exclusive scan of the chunk's keep flags gives each kept position its slot after the kept positions of
// earlier chunks, so indices come out ascending without sorting. The tail after the count is -1.
template <typename T, typename K>
__global__ void __launch_bounds__(kThreads) compactionKernel(const T* __restrict__ scores, const int32_t* __restrict__ lengths,
                                                             const float* __restrict__ threshold,
                                                             const int32_t* __restrict__ window, int heads, int seq, int sink,
                                                             K* __restrict__ keep, int32_t* __restrict__ counts,
                                                             int32_t* __restrict__ indices) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scanStorage;
  const int row = blockIdx.x;
  const int64_t base = static_cast<int64_t>(row) * seq;
  const int length = lengths[row / heads];
  const int64_t windowStart = static_cast<int64_t>(length) - window[0];
  const float tau = roundThreshold<T>(threshold[0]);
  int count = 0;
  for (int start = 0; start < seq; start += kThreads) {
    const int pos = start + static_cast<int>(threadIdx.x);
    int kept = 0;
    if (pos < seq) {
      const bool below = toFloat<T>(scores[base + pos]) < tau;  // false for NaN: a NaN score is kept
      kept = (pos < length) && (pos >= windowStart || pos < sink || !below);
      keep[base + pos] = static_cast<K>(kept);
    }
    int slot = 0, total = 0;
    Scan(scanStorage).ExclusiveSum(kept, slot, total);
    if (kept) indices[base + count + slot] = pos;
    count += total;
    __syncthreads();  // scanStorage is reused by the next chunk
  }
  for (int pos = count + static_cast<int>(threadIdx.x); pos < seq; pos += kThreads) indices[base + pos] = -1;
  if (threadIdx.x == 0) counts[row] = count;
}

template <typename T>
int launchCompaction(const void* scores, const int32_t* lengths, const float* threshold, const int32_t* window,
                     int batch, int heads, int seq, int sink, void* keep, int keepDtype, int32_t* counts,
                     int32_t* indices, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(batch) * static_cast<unsigned>(heads));
  const T* s = static_cast<const T*>(scores);
  if (keepDtype == KVZAP_BOOL) {
    compactionKernel<T, uint8_t><<<grid, kThreads, 0, stream>>>(s, lengths, threshold, window, heads, seq, sink,
                                                                 static_cast<uint8_t*>(keep), counts, indices);
  } else {
    compactionKernel<T, int32_t><<<grid, kThreads, 0, stream>>>(s, lengths, threshold, window, heads, seq, sink,
                                                                 static_cast<int32_t*>(keep), counts, indices);
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
      return launchCompaction<float>(scores, lengths, threshold, window, batch, heads, seq, sink, keep, keep_dtype,
                                     counts, indices, stream);
    case KVZAP_FLOAT16:
      return launchCompaction<__half>(scores, lengths, threshold, window, batch, heads, seq, sink, keep, keep_dtype,
                                      counts, indices, stream);
    case KVZAP_BFLOAT16:
      return launchCompaction<__nv_bfloat16>(scores, lengths, threshold, window, batch, heads, seq, sink, keep,
                                             keep_dtype, counts, indices, stream);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
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
