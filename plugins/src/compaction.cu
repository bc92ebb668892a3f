// CUDA kernels behind include/kvzap/compaction.h.
#include "kvzap/compaction.h"

#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

constexpr int kThreads = 512;

// τ rounded to the scores' dtype, as kvpress compares `scores < τ` in that dtype.
template <typename T> __device__ float roundThreshold(float tau);
template <> __device__ float roundThreshold<float>(float tau) { return tau; }
template <> __device__ float roundThreshold<__half>(float tau) { return __half2float(__float2half_rn(tau)); }
template <> __device__ float roundThreshold<__nv_bfloat16>(float tau) { return __bfloat162float(__float2bfloat16_rn(tau)); }

template <typename T> __device__ float toFloat(T v);
template <> __device__ float toFloat<float>(float v) { return v; }
template <> __device__ float toFloat<__half>(__half v) { return __half2float(v); }
template <> __device__ float toFloat<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// One block per (sequence, head): chunks of kThreads positions; a block-wide exclusive scan of `keep`
// gives each kept position its slot after the kept positions of earlier chunks.
template <typename T>
__global__ void compactionKernel(const T* __restrict__ scores, const int32_t* __restrict__ lengths,
                                 const float* __restrict__ threshold, const int32_t* __restrict__ window, int heads,
                                 int seq, int sink, uint8_t* __restrict__ keep, int32_t* __restrict__ counts,
                                 int32_t* __restrict__ indices) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scanStorage;
  const int row = blockIdx.x;
  const int64_t base = static_cast<int64_t>(row) * seq;
  const int length = lengths[row / heads];
  const int windowStart = length - window[0];
  const float tau = roundThreshold<T>(threshold[0]);
  int count = 0;
  for (int start = 0; start < seq; start += kThreads) {
    const int pos = start + threadIdx.x;
    int kept = 0;
    if (pos < seq) {
      const float s = toFloat<T>(scores[base + pos]);
      const bool below = s < tau;  // false for NaN: NaN is kept
      kept = (pos < length) && ((pos >= windowStart) || (pos < sink) || !below);
      keep[base + pos] = static_cast<uint8_t>(kept);
    }
    int slot = 0, total = 0;
    Scan(scanStorage).ExclusiveSum(kept, slot, total);
    if (kept) indices[base + count + slot] = pos;
    count += total;
    __syncthreads();  // scanStorage is reused by the next chunk
  }
  for (int pos = count + threadIdx.x; pos < seq; pos += kThreads) indices[base + pos] = -1;
  if (threadIdx.x == 0) counts[row] = count;
}

// Grid (sequence*head, row blocks): each warp-row copies one destination row in Vec units.
template <typename Vec>
__global__ void kvMoveKernel(const Vec* __restrict__ keys, const Vec* __restrict__ values,
                             const int32_t* __restrict__ indices, int seq, int rowVecs, Vec* __restrict__ keysOut,
                             Vec* __restrict__ valuesOut) {
  const int64_t head = blockIdx.x;
  const int t = blockIdx.y * blockDim.y + threadIdx.y;
  if (t >= seq) return;
  const int src = indices[head * seq + t];
  const int64_t dst = (head * seq + t) * rowVecs;
  const int64_t from = (head * seq + (src < 0 ? 0 : src)) * rowVecs;
  for (int i = threadIdx.x; i < rowVecs; i += blockDim.x) {
    Vec k{}, v{};
    if (src >= 0) {
      k = keys[from + i];
      v = values[from + i];
    }
    keysOut[dst + i] = k;
    valuesOut[dst + i] = v;
  }
}

template <typename Vec>
int launchMove(const void* keys, const void* values, const int32_t* indices, int rows, int seq, int rowVecs,
               void* keysOut, void* valuesOut, cudaStream_t stream) {
  const dim3 block(32, 8);
  const dim3 grid(rows, (seq + block.y - 1) / block.y);
  kvMoveKernel<Vec><<<grid, block, 0, stream>>>(static_cast<const Vec*>(keys), static_cast<const Vec*>(values), indices,
                                                seq, rowVecs, static_cast<Vec*>(keysOut), static_cast<Vec*>(valuesOut));
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" int kvzap_threshold_compaction(const void* scores, int dtype, const int32_t* lengths, const float* threshold,
                                          const int32_t* window, int batch, int heads, int seq, int sink, uint8_t* keep,
                                          int32_t* counts, int32_t* indices, cudaStream_t stream) {
  if (batch <= 0 || heads <= 0 || seq < 0 || sink < 0) return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid(batch * heads);
  switch (dtype) {
    case KVZAP_FLOAT32:
      compactionKernel<float><<<grid, kThreads, 0, stream>>>(static_cast<const float*>(scores), lengths, threshold, window,
                                                             heads, seq, sink, keep, counts, indices);
      break;
    case KVZAP_FLOAT16:
      compactionKernel<__half><<<grid, kThreads, 0, stream>>>(static_cast<const __half*>(scores), lengths, threshold,
                                                              window, heads, seq, sink, keep, counts, indices);
      break;
    case KVZAP_BFLOAT16:
      compactionKernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(scores), lengths,
                                                                     threshold, window, heads, seq, sink, keep, counts,
                                                                     indices);
      break;
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

extern "C" int kvzap_kv_compaction(const void* keys, const void* values, const int32_t* indices, int batch, int heads,
                                   int seq, int head_dim, int elem_size, void* keys_out, void* values_out,
                                   cudaStream_t stream) {
  if (batch <= 0 || heads <= 0 || seq < 0 || head_dim <= 0 || elem_size <= 0) return static_cast<int>(cudaErrorInvalidValue);
  if (seq == 0) return 0;
  const int rowBytes = head_dim * elem_size;
  const int rows = batch * heads;
  if (rowBytes % 16 == 0)  // 16-byte vectors: bf16 head_dim 128 = 16 uint4 per row
    return launchMove<uint4>(keys, values, indices, rows, seq, rowBytes / 16, keys_out, values_out, stream);
  if (rowBytes % 4 == 0)
    return launchMove<uint32_t>(keys, values, indices, rows, seq, rowBytes / 4, keys_out, values_out, stream);
  return launchMove<uint8_t>(keys, values, indices, rows, seq, rowBytes, keys_out, values_out, stream);
}
