// C ABI of kvzap-export's compaction CUDA kernels (libkvzap_kernels.so).
//
// Semantics: kvzap_export/ops/compaction.py (the PyTorch reference); outputs are bit-identical to it.
//   keep[b,h,t]  = t < lengths[b] and (t >= lengths[b] - window or t < sink or !(scores[b,h,t] < threshold))
//   counts[b,h]  = number of kept t
//   indices[b,h] = kept positions ascending, then -1
// The comparison happens in the scores' dtype (threshold rounded to it, as torch compares a bf16 tensor with
// a Python float), so a NaN score is kept and padding (t >= lengths[b]) never is.
//
// Choices of this ABI:
// - lengths are int32: the bundle's ONNX graphs and TensorRT carry them as int32.
// - threshold (one float32) and window (one int32) are read from *device* memory: TensorRT hands graph inputs
//   over as device pointers, and reading them on the device needs no host synchronization (CUDA-graph safe).
// - keep is written as KVZAP_BOOL (1 byte, 0/1, torch.bool's layout) or KVZAP_INT32 (0/1): TensorRT plugins
//   cannot output DataType::kBOOL (NvInferRuntime.h, IPluginV3OneBuild::getOutputDataTypes).
// Every function returns a cudaError_t value (0 = cudaSuccess); launches are asynchronous on `stream`.
#pragma once
#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum KvzapDtype { KVZAP_FLOAT32 = 0, KVZAP_FLOAT16 = 1, KVZAP_BFLOAT16 = 2, KVZAP_BOOL = 3, KVZAP_INT32 = 4 };

// scores [batch, heads, seq] of scores_dtype (KVZAP_FLOAT32/FLOAT16/BFLOAT16); lengths [batch] int32 in [0, seq].
// Outputs: keep [batch, heads, seq] of keep_dtype (KVZAP_BOOL or KVZAP_INT32), counts [batch, heads] int32,
// indices [batch, heads, seq] int32. Each (sequence, head) row is split into tiles (see
// kvzap_threshold_compaction_grid), one CUDA block each, in one launch; no workspace, no host synchronization.
int kvzap_threshold_compaction(const void* scores, int scores_dtype, const int32_t* lengths, const float* threshold,
                               const int32_t* window, int batch, int heads, int seq, int sink, void* keep,
                               int keep_dtype, int32_t* counts, int32_t* indices, cudaStream_t stream);

// The launch geometry kvzap_threshold_compaction uses for these sizes, computed on the host (no GPU, no CUDA call):
// *blocks = CUDA blocks of the launch (batch * heads * tiles per row), *positions_per_block = positions of a row
// per tile (a multiple of 4096; a row's last tile may be shorter). Either pointer may be NULL. Returns
// cudaErrorInvalidValue for sizes the launch refuses (batch or heads <= 0, seq < 0 or > 2^31 - 1 - 4096, more
// than 2^31 - 1 blocks).
int kvzap_threshold_compaction_grid(int batch, int heads, int seq, int64_t* blocks, int64_t* positions_per_block);

// keys/values [batch, heads, seq, head_dim], elements of elem_size bytes (2: bf16/fp16, 4: fp32); indices as
// above. Each head's kept rows move to the front in order; the rest of keys_out/values_out is zero. An index
// outside [0, seq) gives a zero row and reads nothing (memory-safe for any indices). Rows move in 16-byte
// vectors when the row size and every pointer allow it. Outputs must not alias the inputs.
int kvzap_kv_compaction(const void* keys, const void* values, const int32_t* indices, int batch, int heads, int seq,
                        int head_dim, int elem_size, void* keys_out, void* values_out, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
