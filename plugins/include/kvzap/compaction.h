// C ABI of kvzap-export's threshold-compaction CUDA kernels (libkvzap_kernels).
// Semantics: kvzap_export/ops/compaction.py (the PyTorch reference); outputs are bit-identical.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum KvzapDtype { KVZAP_FLOAT32 = 0, KVZAP_FLOAT16 = 1, KVZAP_BFLOAT16 = 2 };

// scores [batch, heads, seq] (dtype); lengths [batch] int32; threshold: one float32 and window: one int32,
// both in device memory (as TensorRT hands them over). Outputs: keep [batch, heads, seq] bool (1 byte),
// counts [batch, heads] int32, indices [batch, heads, seq] int32 (kept positions ascending, then -1).
// Returns a cudaError_t value (0 = success).
int kvzap_threshold_compaction(const void* scores, int dtype, const int32_t* lengths, const float* threshold,
                               const int32_t* window, int batch, int heads, int seq, int sink, uint8_t* keep,
                               int32_t* counts, int32_t* indices, cudaStream_t stream);

// keys/values [batch, heads, seq, head_dim] of elem_size bytes; indices as above. Each head's kept rows move
// to the front in order; the rest of the output is zero.
int kvzap_kv_compaction(const void* keys, const void* values, const int32_t* indices, int batch, int heads, int seq,
                        int head_dim, int elem_size, void* keys_out, void* values_out, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
